"""NCCL (or RCCL on ROCm) behind the `Group` interface, through `cupy.cuda.nccl`.

The unique id is made by the group's rank 0 and broadcast over the group's MPI communicator
(small metadata between our own ranks: the pickling `bcast` is fine). Collectives are enqueued on
the current CuPy stream, so they are ordered with the kernels that produce and consume their
buffers and need no synchronisation; `iallreduce` runs on a side stream and its `wait()` makes
the current stream wait for it (the overlap of issue 4). Byte accounting is inherited from Group.

Not exercised in CI (no GPU there): the GPU test suite runs it on a device when one is lent.
"""

from boostmpi.parallel.comm import Group


def _nccl():
    from cupy.cuda import nccl

    return nccl


def _dtype(nccl, dtype):
    import numpy as np

    table = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float64): nccl.NCCL_FLOAT64,
             np.dtype(np.int64): nccl.NCCL_INT64, np.dtype(np.int32): nccl.NCCL_INT32}
    if dtype in table:
        return table[dtype]
    if getattr(dtype, "name", "") == "bfloat16" and hasattr(nccl, "NCCL_BFLOAT16"):
        return nccl.NCCL_BFLOAT16
    raise TypeError(f"NCCL cannot move arrays of dtype {dtype}")


class _Event:
    """Completion of work enqueued on `stream`, waited for by the current stream."""

    def __init__(self, stream):
        import cupy

        self.event = cupy.cuda.Event(disable_timing=True)
        self.event.record(stream)

    def wait(self):
        import cupy

        cupy.cuda.get_current_stream().wait_event(self.event)

    Wait = wait


class NcclGroup(Group):
    def __init__(self, axis, mpi_comm, counter, overlap=True):
        super().__init__(axis, mpi_comm, counter, overlap)
        if self.size == 1:
            self.nccl_comm = None
            return
        import cupy

        nccl = _nccl()
        uid = nccl.get_unique_id() if self.rank == 0 else None
        uid = mpi_comm.bcast(uid, root=0)
        self.nccl_comm = nccl.NcclCommunicator(self.size, uid, self.rank)
        self.side_stream = cupy.cuda.Stream(non_blocking=True)

    def _stream(self):
        import cupy

        return cupy.cuda.get_current_stream()

    def allreduce(self, buf, op="sum"):
        if self.size == 1:
            return buf
        nccl = _nccl()
        self._count_collective(buf.nbytes)
        self.nccl_comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, _dtype(nccl, buf.dtype),
                                 nccl.NCCL_SUM if op == "sum" else nccl.NCCL_MAX, self._stream().ptr)
        return buf

    def iallreduce(self, buf):
        if self.size == 1 or not self.overlap:
            self.allreduce(buf)
            from boostmpi.parallel.comm import _DONE

            return _DONE
        nccl = _nccl()
        self._count_collective(buf.nbytes)
        self.side_stream.wait_event(_Event(self._stream()).event)  # the buffer's producer first
        self.nccl_comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, _dtype(nccl, buf.dtype), nccl.NCCL_SUM,
                                 self.side_stream.ptr)
        return _Event(self.side_stream)

    def allgather(self, buf):
        import cupy

        if self.size == 1:
            return buf[None]
        nccl = _nccl()
        buf = cupy.ascontiguousarray(buf)
        out = cupy.empty((self.size,) + buf.shape, dtype=buf.dtype)
        self._count_collective(buf.nbytes)
        self.nccl_comm.allGather(buf.data.ptr, out.data.ptr, buf.size, _dtype(nccl, buf.dtype), self._stream().ptr)
        return out

    def isend(self, buf, dest, tag=0):
        nccl = _nccl()
        self.counter.add(self.axis, buf.nbytes)
        self.nccl_comm.send(buf.data.ptr, buf.size, _dtype(nccl, buf.dtype), dest, self._stream().ptr)
        return _Event(self._stream())

    def irecv(self, buf, source, tag=0):
        nccl = _nccl()
        self.nccl_comm.recv(buf.data.ptr, buf.size, _dtype(nccl, buf.dtype), source, self._stream().ptr)
        return _Event(self._stream())


def select_device(local_rank):
    """One GPU per rank, chosen by local rank; returns the device id."""
    import cupy

    n = cupy.cuda.runtime.getDeviceCount()
    device = local_rank % n
    cupy.cuda.Device(device).use()
    return device
