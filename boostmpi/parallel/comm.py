"""Communicators for one process-grid axis, with exact payload accounting.

A `Group` wraps the members of one axis group (tp, pp or dp). Every collective and
point-to-point call goes through it and is counted per axis in a `CommCounter`, following
docs/COMMUNICATION.md: a collective counts the bytes each member contributes, once per group
(by the member of group rank 0); a point-to-point message counts the bytes sent. A group of one
member moves and counts nothing.

Backends: MPI (mpi4py's buffer methods; NumPy arrays, or CuPy arrays through CUDA-aware MPI
after a stream synchronisation) and NCCL (`boostmpi.parallel.nccl`), chosen by the engine.
"""

import time

import numpy as np

AXES = ("tp", "pp", "dp")


class CommCounter:
    """Bytes and calls per axis since the last `reset()`."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.bytes = {a: 0 for a in AXES}
        self.calls = {a: 0 for a in AXES}

    def add(self, axis, nbytes):
        self.bytes[axis] += int(nbytes)
        self.calls[axis] += 1

    def snapshot(self):
        return {"bytes": dict(self.bytes), "calls": dict(self.calls)}


class _Done:
    """A request that has already completed (blocking fallback, or a group of one)."""

    def wait(self):
        return None


_DONE = _Done()


class Group:
    """One axis group. `mpi_comm` is an mpi4py communicator, or None for a group of one."""

    def __init__(self, axis, mpi_comm, counter, overlap=True, sync=None):
        self.axis = axis
        self.comm = mpi_comm
        self.counter = counter
        self.overlap = overlap
        self.size = 1 if mpi_comm is None else mpi_comm.Get_size()
        self.rank = 0 if mpi_comm is None else mpi_comm.Get_rank()
        # before a GPU buffer is handed to MPI the producing stream must have finished
        self._sync = sync or (lambda: None)
        self.wait_seconds = 0.0

    # -- accounting
    def _count_collective(self, nbytes):
        if self.size > 1 and self.rank == 0:
            self.counter.add(self.axis, nbytes)

    # -- collectives (in place where the data allows)
    def allreduce(self, buf, op="sum"):
        """All-reduce `buf` in place (sum or max)."""
        if self.size == 1:
            return buf
        from mpi4py import MPI

        self._count_collective(buf.nbytes)
        self._sync()
        t0 = time.perf_counter()
        self.comm.Allreduce(MPI.IN_PLACE, _mpi_buf(buf), op=MPI.SUM if op == "sum" else MPI.MAX)
        self.wait_seconds += time.perf_counter() - t0
        return buf

    def iallreduce(self, buf):
        """Start an in-place sum all-reduce of `buf`; `.wait()` on the result before reading it."""
        if self.size == 1:
            return _DONE
        if not self.overlap:
            self.allreduce(buf)
            return _DONE
        from mpi4py import MPI

        self._count_collective(buf.nbytes)
        self._sync()
        return _TimedRequest(self.comm.Iallreduce(MPI.IN_PLACE, _mpi_buf(buf), op=MPI.SUM), self)

    def allgather(self, buf):
        """Concatenate every member's `buf` along a new leading dim: [size, *buf.shape]."""
        xp = _xp(buf)
        if self.size == 1:
            return buf[None]
        out = xp.empty((self.size,) + buf.shape, dtype=buf.dtype)
        self._count_collective(buf.nbytes)
        self._sync()
        t0 = time.perf_counter()
        self.comm.Allgather(_mpi_buf(xp.ascontiguousarray(buf)), _mpi_buf(out))
        self.wait_seconds += time.perf_counter() - t0
        return out

    # -- point to point (pipeline)
    def isend(self, buf, dest, tag=0):
        self.counter.add(self.axis, buf.nbytes)
        self._sync()
        return self.comm.Isend(_mpi_buf(buf), dest=dest, tag=tag)

    def irecv(self, buf, source, tag=0):
        return self.comm.Irecv(_mpi_buf(buf), source=source, tag=tag)


class _TimedRequest:
    def __init__(self, req, group):
        self.req, self.group = req, group

    def wait(self):
        t0 = time.perf_counter()
        self.req.Wait()
        self.group.wait_seconds += time.perf_counter() - t0


def _xp(buf):
    from boostmpi.backend import get_array_module

    return get_array_module(buf)


def _mpi_buf(arr):
    """What mpi4py's buffer methods accept: the array itself (NumPy, or CuPy via __cuda_array_interface__)."""
    if isinstance(arr, np.ndarray) and not arr.flags.c_contiguous:
        raise ValueError("MPI buffers must be contiguous")
    return arr
