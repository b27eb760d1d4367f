"""NCCL (or RCCL on ROCm) behind the `Group` interface, through `cupy.cuda.nccl`.

The unique id is made by the group's rank 0 and broadcast over the group's MPI communicator
(small metadata between our own ranks: the pickling `bcast` is fine). Collectives are enqueued on
the current CuPy stream, so they are ordered with the kernels that produce and consume their
buffers and need no synchronisation; `iallreduce` runs on a side stream and its `wait()` makes
the current stream wait for it. Byte accounting is inherited from Group.

One communicator, two streams: the group's collectives are chained on the device in the order the
host issued them, whichever stream they are on. An `iallreduce` first waits for the current stream,
and the next collective on the current stream first waits for every side-stream collective issued
before it, waited for or not. Every rank issues the same collectives in the same order, so no two
of them ever run at once on the communicator, and nothing relies on how NCCL orders the kernels of
one communicator that sit on different streams.

Point to point (the pipeline axis): an NCCL send blocks its stream until the peer has posted the
matching receive, so sends and receives of a 1F1B schedule on one stream would deadlock as soon
as two neighbouring stages send to each other at once (stage s sends F(m+1) while stage s+1
sends B(m)). A group made with `p2p=True` therefore holds one extra communicator and stream per
direction of travel: messages going up the ranks (activations, stage s -> s+1) on one, messages
going down (gradients) on the other. On each of them every rank only ever waits on work that
flows the same way, in the same order on both ends, so no cycle can form; each op first waits
for the current stream (the buffer's producer, or its previous user in CuPy's memory pool) and
hands back an event that the current stream waits on.

Interleaved 1F1B (parallel.virtual_stages > 1) sends round a ring: the last rank's activations go
on to rank 0 (the next chunk), rank 0's gradients back to the last rank. A group made with
`ring=True` keys its channels by the kind of message as well (the tag's low bit: 0 an activation,
1 a gradient) and holds four: activations up, activations down (the wrap-around), gradients down,
gradients up (the wrap-around). Between two ranks a channel then carries one kind of message one
way, and the schedule runs every chunk's micro-batches in one order on every rank, so the sender's
order is the receiver's by construction (NCCL matches by order alone), whatever order the two kinds
interleave in. One channel per kind alone would not do: round a ring each is used both ways, and
two neighbours block on sends to each other.

Without a GPU, CI runs it unchanged on the CuPy stand-in's NCCL, carried out by MPI between real
ranks with NCCL's ordering rules (tests/integration/gpu/test_gpu.py, tests/unit/parallel/test_nccl.py; docs/GPU.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import numpy.typing as npt

from boostmpi.arrays import Array
from boostmpi.gpu.ranges import ranged
from boostmpi.parallel.comm import WATCHDOG, CommCounter, Group, HostCollectives, Request

if TYPE_CHECKING:
    import cupy
    from mpi4py import MPI


def _nccl() -> ModuleType:
    from cupy.cuda import nccl

    module: ModuleType = nccl
    return module


def nccl_unavailable_reason() -> str | None:
    """None when CuPy can load NCCL (RCCL on ROCm), else why not, in a few words."""
    import warnings

    try:
        with warnings.catch_warnings():  # CuPy warns when the library is missing; the caller says it once
            warnings.simplefilter("ignore")
            from cupy.cuda import nccl
    except Exception as exc:  # noqa: BLE001 - any import failure means "no NCCL"
        return f"cupy.cuda.nccl does not import ({type(exc).__name__}: {exc})"
    if not getattr(nccl, "available", True) or not hasattr(nccl, "NcclCommunicator"):
        return ("CuPy cannot load the NCCL library (CUDA wheels: pip install boostmpi[gpu], which brings "
                "nvidia-nccl-cu12; or load the site's nccl module; ROCm: RCCL comes with the rocm module)")
    return None


def _dtype(nccl: ModuleType, dtype: npt.DTypeLike) -> int:
    from boostmpi.precision import nccl_dtype_name

    name = nccl_dtype_name(dtype)
    if name is None or not hasattr(nccl, f"NCCL_{name.upper()}"):
        raise TypeError(f"NCCL cannot move arrays of dtype {dtype}")
    return int(getattr(nccl, f"NCCL_{name.upper()}"))


class _Event:
    """Completion of work enqueued on `stream`, waited for by the current stream."""

    def __init__(self, stream: cupy.cuda.Stream) -> None:
        import cupy

        self.event = cupy.cuda.Event(disable_timing=True)
        self.event.record(stream)

    def wait(self) -> None:
        import cupy

        cupy.cuda.get_current_stream().wait_event(self.event)


class _WatchedComm:
    """An NCCL communicator whose calls go through the watchdog's one wrapper (`WATCHDOG.call`): a
    call that blocks longer than parallel.watchdog_s ends the job, after `abort()` (ncclCommAbort,
    registered with the watchdog by the group) has released the device work stuck in it."""

    _UNWATCHED = frozenset({"abort", "destroy", "rank_id", "size", "device_id"})

    def __init__(self, comm: cupy.cuda.nccl.NcclCommunicator, axis: str) -> None:
        self.comm, self.axis = comm, axis

    def __getattr__(self, name: str) -> Callable[..., object]:
        attr: Callable[..., object] = getattr(self.comm, name)
        if name in self._UNWATCHED or not callable(attr):
            return attr
        return lambda *args: WATCHDOG.call(self.axis, f"NCCL {name}", lambda: attr(*args))


def _communicator(nccl: ModuleType, mpi_comm: MPI.Comm | None, size: int, rank: int, axis: str) -> _WatchedComm:
    """A new NCCL communicator over the ranks of `mpi_comm` (collective over it), watched."""
    uid = nccl.get_unique_id() if rank == 0 else None
    uid = HostCollectives(mpi_comm, axis).bcast(uid)
    return _WatchedComm(WATCHDOG.call(axis, "ncclCommInitRank", lambda: nccl.NcclCommunicator(size, uid, rank)), axis)


class NcclGroup(Group):
    def __init__(self, axis: str, mpi_comm: MPI.Comm | None, counter: CommCounter, overlap: bool = True,
                 p2p: bool = False, ring: bool = False) -> None:
        super().__init__(axis, mpi_comm, counter, overlap)
        self.p2p: dict[int | tuple[int, int], tuple[_WatchedComm, cupy.cuda.Stream]] = {}
        self.ring = ring
        if self.size == 1:
            self.nccl_comm: _WatchedComm = None  # type: ignore[assignment]  # a group of one calls no NCCL
            return
        import cupy

        nccl = _nccl()
        self.nccl_comm = _communicator(nccl, mpi_comm, self.size, self.rank, axis)
        self.side_stream = cupy.cuda.Stream(non_blocking=True)
        # the last side-stream collective, until the current stream has waited for it
        self._side_done: _Event | None = None
        if p2p:  # +1: messages to higher ranks, -1: to lower ranks; by kind too round a ring (module docstring)
            for key in ([(kind, d) for kind in (0, 1) for d in (+1, -1)] if ring else [+1, -1]):
                self.p2p[key] = (_communicator(nccl, mpi_comm, self.size, self.rank, axis),
                                 cupy.cuda.Stream(non_blocking=True))
        WATCHDOG.on_fire(self.abort)

    def abort(self) -> int:
        """ncclCommAbort on every communicator of the group (the watchdog's last act); how many."""
        comms = [self.nccl_comm] + [comm for comm, _ in self.p2p.values()]
        for comm in comms:
            comm.abort()
        return len(comms)

    def _stream(self) -> cupy.cuda.Stream:
        import cupy

        return cupy.cuda.get_current_stream()

    def _collective_stream(self) -> cupy.cuda.Stream:
        """The current stream, made to wait for the side-stream collectives issued before (module docstring)."""
        stream = self._stream()
        if self._side_done is not None:
            stream.wait_event(self._side_done.event)
            self._side_done = None
        return stream

    def allreduce(self, buf: Array, op: str = "sum") -> Array:
        if self.size == 1:
            return buf
        nccl = _nccl()
        self._count_collective(buf.nbytes)
        self.nccl_comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, _dtype(nccl, buf.dtype),
                                 nccl.NCCL_SUM if op == "sum" else nccl.NCCL_MAX, self._collective_stream().ptr)
        return buf

    def allreduce_many(self, bufs: list[Array]) -> list[Array]:
        """Sum all-reduces of several buffers (of any dtypes) in one NCCL group: one collective, counted once."""
        if self.size == 1:
            return bufs
        nccl = _nccl()
        self._count_collective(sum(b.nbytes for b in bufs))
        stream = self._collective_stream()
        nccl.groupStart()
        for b in bufs:
            self.nccl_comm.allReduce(b.data.ptr, b.data.ptr, b.size, _dtype(nccl, b.dtype), nccl.NCCL_SUM, stream.ptr)
        nccl.groupEnd()
        return bufs

    def iallreduce(self, buf: Array) -> Request:
        if self.size == 1 or not self.overlap:
            self.allreduce(buf)
            from boostmpi.parallel.comm import _DONE

            return _DONE
        nccl = _nccl()
        self._count_collective(buf.nbytes)
        self.side_stream.wait_event(_Event(self._stream()).event)  # the buffer's producer first
        self.nccl_comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, _dtype(nccl, buf.dtype), nccl.NCCL_SUM,
                                 self.side_stream.ptr)
        self._side_done = _Event(self.side_stream)
        return self._side_done

    def allgather(self, buf: Array) -> Array:
        import cupy

        if self.size == 1:
            return buf[None]
        nccl = _nccl()
        buf = cupy.ascontiguousarray(buf)
        out = cupy.empty((self.size,) + buf.shape, dtype=buf.dtype)
        self._count_collective(buf.nbytes)
        self.nccl_comm.allGather(buf.data.ptr, out.data.ptr, buf.size, _dtype(nccl, buf.dtype),
                                 self._collective_stream().ptr)
        return out

    def ireduce_scatter(self, buf: Array, out: Array, counts: Sequence[int], blocking: bool = False) -> Request:
        """Pieces of unequal length: one reduce per member, rooted at that member, in one NCCL group."""
        if self.size == 1:
            out[...] = buf
            from boostmpi.parallel.comm import _DONE

            return _DONE
        nccl = _nccl()
        self._count_collective(buf.nbytes)
        side = self.overlap and not blocking
        if side:
            self.side_stream.wait_event(_Event(self._stream()).event)
        stream = self.side_stream if side else self._collective_stream()
        dtype, offset = _dtype(nccl, buf.dtype), 0
        nccl.groupStart()
        for root, count in enumerate(counts):
            if not count:  # a bucket that does not reach this member's slice (the same on every member)
                continue
            recv = out.data.ptr if root == self.rank else buf.data.ptr  # only the root's target is written
            self.nccl_comm.reduce(buf.data.ptr + offset * buf.itemsize, recv, int(count), dtype, nccl.NCCL_SUM,
                                  root, stream.ptr)
            offset += int(count)
        nccl.groupEnd()
        if not side:
            from boostmpi.parallel.comm import _DONE

            return _DONE
        self._side_done = _Event(self.side_stream)
        return self._side_done

    def reduce_scatter(self, buf: Array, out: Array, counts: Sequence[int]) -> None:
        self.ireduce_scatter(buf, out, counts, blocking=True)

    def allgather_pieces(self, buf: Array, counts: Sequence[int], counted: bool = False) -> Array:
        """Pieces of unequal length: one broadcast per member, in one NCCL group, in place."""
        if self.size == 1:
            return buf
        nccl = _nccl()
        if not counted:
            self.count_allgather_pieces(buf, counts)
        stream, dtype, offset = self._collective_stream(), _dtype(nccl, buf.dtype), 0
        nccl.groupStart()
        for root, count in enumerate(counts):
            if not count:
                continue
            ptr = buf.data.ptr + offset * buf.itemsize
            self.nccl_comm.broadcast(ptr, ptr, int(count), dtype, root, stream.ptr)
            offset += int(count)
        nccl.groupEnd()
        return buf

    def _p2p_channel(self, direction: int, tag: int) -> tuple[_WatchedComm, cupy.cuda.Stream]:
        if not self.p2p:
            raise RuntimeError(f"NCCL group '{self.axis}' was made without p2p=True: it has no send/receive channels")
        comm, stream = self.p2p[(tag & 1, direction) if self.ring else direction]
        stream.wait_event(_Event(self._stream()).event)
        return comm, stream

    def isend(self, buf: Array, dest: int, tag: int = 0) -> Request:
        nccl = _nccl()
        self.counter.add(self.axis, buf.nbytes)
        comm, stream = self._p2p_channel(+1 if dest > self.rank else -1, tag)
        comm.send(buf.data.ptr, buf.size, _dtype(nccl, buf.dtype), dest, stream.ptr)
        return _Event(stream)

    def irecv(self, buf: Array, source: int, tag: int = 0) -> Request:
        nccl = _nccl()
        comm, stream = self._p2p_channel(+1 if self.rank > source else -1, tag)
        comm.recv(buf.data.ptr, buf.size, _dtype(nccl, buf.dtype), source, stream.ptr)
        return _Event(stream)


def select_device(local_rank: int) -> int:
    """One GPU per rank, chosen by local rank; returns the device id."""
    import cupy

    n: int = cupy.cuda.runtime.getDeviceCount()
    device = local_rank % n
    cupy.cuda.Device(device).use()
    return device


# a named range around each collective and point-to-point call (boostmpi/gpu/ranges.py): a profile
# of a node shows `tp allreduce`, `pp isend`... around the NCCL kernels
for _name in ("allreduce", "allreduce_many", "iallreduce", "allgather", "ireduce_scatter", "reduce_scatter",
              "allgather_pieces", "isend", "irecv"):
    setattr(NcclGroup, _name, ranged(_name, getattr(NcclGroup, _name)))
