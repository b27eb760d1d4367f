"""Communicators for one process-grid axis, with exact payload accounting.

A `Group` wraps the members of one axis group (tp, pp or dp). Every collective and
point-to-point call goes through it and is counted per axis in a `CommCounter`, following
docs/COMMUNICATION.md: a collective counts the bytes each member contributes, once per group
(by the member of group rank 0); a point-to-point message counts the bytes sent. A group of one
member moves and counts nothing.

Backends: MPI (mpi4py's buffer methods; NumPy arrays, or CuPy arrays through CUDA-aware MPI
after a stream synchronisation) and NCCL (`boostmpi.parallel.nccl`), chosen by the engine.

Every call that can block (a collective, or the wait on a request) is watched by `WATCHDOG`:
one that waits longer than `parallel.watchdog_s` ends the job (see `Watchdog`).

`Communicator` declares what a group offers its callers (the engine, the region mappings, the
tensor-parallel strategies, data parallelism); `Group` (MPI) and `NcclGroup` implement it, and the
type check holds both to it. `Request` is what a started call returns.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar, cast

import numpy as np
import numpy.typing as npt

from boostmpi.arrays import Array
from boostmpi.precision import HOST_DTYPE, bits_dtype, mpi_sum_dtype

if TYPE_CHECKING:
    from mpi4py import MPI

AXES = ("tp", "pp", "dp")
T = TypeVar("T")


class Request(Protocol):
    """A started communication: `wait()` completes it; its buffers are read only after."""

    def wait(self) -> None: ...


class Communicator(Protocol):
    """The communicator group of one process-grid axis (tp, pp or dp), as its callers use it. Every
    call moves arrays of the run's backend, counts its payload in `counter` and, where it can block,
    goes through `WATCHDOG`. A group of one member moves and counts nothing."""

    axis: str
    size: int
    rank: int
    overlap: bool
    counter: CommCounter
    wait_seconds: float

    @property
    def comm(self) -> MPI.Comm | None:
        """The group's MPI communicator (small metadata, the host collectives); None for a group of one."""
        ...

    def allreduce(self, buf: Array, op: str = "sum") -> Array:
        """All-reduce `buf` in place (op "sum" or "max"); returns it."""
        ...

    def allreduce_many(self, bufs: list[Array]) -> list[Array]:
        """Sum-all-reduce each of `bufs` in place as one collective (counted once)."""
        ...

    def iallreduce(self, buf: Array) -> Request:
        """Start an in-place sum all-reduce of `buf`."""
        ...

    def allgather(self, buf: Array) -> Array:
        """Every member's `buf` along a new leading dim: [size, *buf.shape]."""
        ...

    def reduce_scatter(self, buf: Array, out: Array, counts: Sequence[int]) -> None:
        """Sum `buf` over the group; member i receives its piece of counts[i] elements in `out`."""
        ...

    def ireduce_scatter(self, buf: Array, out: Array, counts: Sequence[int], blocking: bool = False) -> Request:
        """Start `reduce_scatter`."""
        ...

    def allgather_pieces(self, buf: Array, counts: Sequence[int], counted: bool = False) -> Array:
        """In place: member i's piece of counts[i] elements, at offset sum(counts[:i]), to every member."""
        ...

    def count_allgather_pieces(self, buf: Array, counts: Sequence[int]) -> None:
        """Count an `allgather_pieces` ahead of issuing it."""
        ...

    def isend(self, buf: Array, dest: int, tag: int = 0) -> Request:
        """Start sending `buf` to group rank `dest`."""
        ...

    def irecv(self, buf: Array, source: int, tag: int = 0) -> Request:
        """Start receiving into `buf` from group rank `source`."""
        ...


class CommCounter:
    """Bytes and calls per axis since the last `reset()`."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.bytes = {a: 0 for a in AXES}
        self.calls = {a: 0 for a in AXES}

    def add(self, axis: str, nbytes: int) -> None:
        self.bytes[axis] += int(nbytes)
        self.calls[axis] += 1

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {"bytes": dict(self.bytes), "calls": dict(self.calls)}


class Watchdog:
    """Ends the job when one blocking MPI call waits longer than `seconds` (parallel.watchdog_s).

    A dead or stuck peer would otherwise leave every other rank waiting inside MPI for ever.
    The main thread records the call it is about to wait in (one tuple assignment before it,
    one after: the whole fast path); a daemon thread wakes ten times per limit (at most once a
    second) and, when the recorded call is older than the limit, prints the axis and the call
    and ends the job with MPI_Abort. mpi4py releases the GIL inside MPI calls, so the thread
    runs while the main thread waits. It never touches a buffer or changes which MPI calls are
    made, so results are identical with it on or off.
    """

    def __init__(self) -> None:
        self.seconds = 0.0  # 0 = off
        # (axis, call, nbytes, peer, start) of the blocking call in progress
        self._open: tuple[str, str, int | None, int | None, float] | None = None
        self._thread: threading.Thread | None = None
        # what to abort before the job ends (NCCL communicators: ncclCommAbort)
        self._aborts: list[Callable[[], int]] = []

    def configure(self, seconds: float | None) -> None:
        """Set the limit in seconds (0 turns the watchdog off); starts the thread on first use."""
        self.seconds = float(seconds or 0.0)
        if self.seconds > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="boostmpi-watchdog", daemon=True)
            self._thread.start()

    def begin(self, axis: str, call: str, nbytes: int | None = None, peer: int | None = None) -> None:
        self._open = (axis, call, nbytes, peer, time.monotonic())

    def end(self) -> None:
        self._open = None

    def call(self, axis: str, call: str, fn: Callable[[], T], nbytes: int | None = None, peer: int | None = None) -> T:
        """`fn()`, watched: the one wrapper every blocking call goes through (collectives of the groups,
        HostCollectives, the checkpoint's agreement, NCCL group calls, waits on requests)."""
        self.begin(axis, call, nbytes, peer)
        try:
            return fn()
        finally:
            self.end()

    def on_fire(self, abort: Callable[[], int]) -> None:
        """Run `abort()` when the watchdog fires, before the job is ended (an NCCL group registers its
        communicators' ncclCommAbort: device work stuck in a collective would otherwise never return)."""
        self._aborts.append(abort)

    def _watch(self) -> None:
        while True:
            limit = self.seconds
            time.sleep(min(1.0, limit / 10) if limit > 0 else 1.0)
            pending = self._open
            if limit > 0 and pending is not None and time.monotonic() - pending[-1] > limit:
                self._fire(*pending)

    def _fire(self, axis: str, call: str, nbytes: int | None, peer: int | None, start: float) -> None:
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        rank = world.Get_rank()
        what = call + (f" of {nbytes} bytes" if nbytes is not None else "")
        what += f" with {axis} rank {peer}" if peer is not None else ""
        main = sys._current_frames().get(cast(int, threading.main_thread().ident))  # int once started
        stack = "".join(traceback.format_stack(main)) if main is not None else ""
        print(f"watchdog: rank {rank}: {what} on the {axis} axis has waited {time.monotonic() - start:.0f} s, "
              f"longer than parallel.watchdog_s = {self.seconds:g}; a peer rank is stuck or dead; aborting the job\n"
              f"rank {rank} is waiting in:\n{stack}", file=sys.stderr, flush=True)
        time.sleep(0.5)  # lets the launcher forward the message before the abort tears the job down
        # last, right before the job ends: device work stuck in NCCL is released (the call the main
        # thread waits in then fails, and that failure must not get ahead of the abort below)
        aborted = 0
        for abort in self._aborts:
            try:
                aborted += int(abort() or 0)
            except Exception as exc:  # noqa: BLE001 - the job ends anyway; say what failed
                print(f"watchdog: rank {rank}: aborting an NCCL communicator failed: {exc}", file=sys.stderr, flush=True)
        if aborted:
            print(f"watchdog: rank {rank}: aborted {aborted} NCCL communicator(s) (ncclCommAbort)", file=sys.stderr,
                  flush=True)
        if MPI.Query_thread() >= MPI.THREAD_MULTIPLE:
            world.Abort(1)
        # this MPI does not allow a call from a second thread: end this rank, the launcher ends the rest
        os._exit(1)


WATCHDOG = Watchdog()


def configure_watchdog(seconds: float | None) -> None:
    """Apply `parallel.watchdog_s` to every group of this process."""
    WATCHDOG.configure(seconds)


class HostCollectives:
    """Host-side collectives on the world communicator: losses, norms, counters, flags and small
    metadata between our own ranks. Every call is watched by `WATCHDOG` and none is counted as
    model traffic. `comm` None: one process, every call returns its input."""

    def __init__(self, comm: MPI.Comm | None, axis: str = "world") -> None:
        self.comm, self.axis = comm, axis

    def _call(self, call: str, fn: Callable[[MPI.Comm], T]) -> T | None:
        if self.comm is None:
            return None
        comm = self.comm
        return WATCHDOG.call(self.axis, call, lambda: fn(comm))

    def sum(self, values: npt.ArrayLike) -> npt.NDArray[np.float64]:
        """Element-wise sum over all ranks of a sequence of floats, as a float64 array."""
        return self._reduce(values, "sum")

    def max(self, values: npt.ArrayLike) -> npt.NDArray[np.float64]:
        return self._reduce(values, "max")

    def _reduce(self, values: npt.ArrayLike, op: str) -> npt.NDArray[np.float64]:
        buf = np.array(values, dtype=HOST_DTYPE).reshape(-1)
        if self.comm is not None:
            from mpi4py import MPI

            mpi_op = MPI.SUM if op == "sum" else MPI.MAX
            self._call("Allreduce", lambda c: c.Allreduce(MPI.IN_PLACE, buf, op=mpi_op))
        return buf

    def bcast(self, obj: T, root: int = 0) -> T:
        """A small picklable object from `root` to every rank."""
        return obj if self.comm is None else cast(T, self._call("bcast", lambda c: c.bcast(obj, root=root)))

    def barrier(self) -> None:
        self._call("Barrier", lambda c: c.Barrier())

    def gather(self, obj: T, root: int = 0) -> list[T] | None:
        """Every rank's small picklable object, as a list on `root` (None elsewhere)."""
        if self.comm is None:
            return [obj]
        return cast("list[T] | None", self._call("gather", lambda c: c.gather(obj, root=root)))

    def allgather(self, obj: T) -> list[T]:
        """Every rank's small picklable object, as a list on every rank."""
        return [obj] if self.comm is None else cast("list[T]", self._call("allgather", lambda c: c.allgather(obj)))

    def allgather_pieces(self, buf: Array, counts: Sequence[int]) -> Array:
        """In place over a host array: rank i's piece sits at offset sum(counts[:i]) of `buf`; afterwards
        every rank holds every piece (the initial weights the dp replicas drew between them)."""
        if self.comm is None:
            return buf
        run, _ = _allgatherv(self.comm, buf, counts)
        self._call("Allgatherv", lambda c: run())
        return buf

    def agree(self, verdict: tuple[str, str] | None, root: int | None = None) -> None:
        """An error on any rank is an error on all ranks: `verdict` is this rank's (class name, message) or
        None (`errors.verdict_of`). With `root`, that rank's verdict counts (one broadcast), else the first
        rank's that has one (one all-gather); every rank raises it, or none does."""
        from boostmpi.errors import raised_on_all_ranks

        if root is not None:
            found = self.bcast(verdict, root=root)
        else:
            found = next((v for v in self.allgather(verdict) if v is not None), None)
        if found is not None:
            raise raised_on_all_ranks(found)

    def send(self, buf: Array, dest: int, tag: int) -> None:
        self._call(f"Send to rank {dest}", lambda c: c.Send(buf, dest=dest, tag=tag))

    def recv(self, buf: Array, source: int, tag: int) -> None:
        self._call(f"Recv from rank {source}", lambda c: c.Recv(buf, source=source, tag=tag))


class _Done:
    """A request that has already completed (blocking fallback, or a group of one)."""

    def wait(self) -> None:
        return None


_DONE = _Done()


class Group:
    """One axis group. `mpi_comm` is an mpi4py communicator, or None for a group of one."""

    def __init__(self, axis: str, mpi_comm: MPI.Comm | None, counter: CommCounter, overlap: bool = True,
                 sync: Callable[[], None] | None = None) -> None:
        self.axis = axis
        self.comm = mpi_comm
        self.counter = counter
        self.overlap = overlap
        self.size = 1 if mpi_comm is None else mpi_comm.Get_size()
        self.rank = 0 if mpi_comm is None else mpi_comm.Get_rank()
        # before a GPU buffer is handed to MPI the producing stream must have finished
        self._sync = sync or (lambda: None)
        self.wait_seconds = 0.0

    @property
    def _mpi(self) -> MPI.Comm:
        """The MPI communicator, which only a group of more than one member reads."""
        assert self.comm is not None
        return self.comm

    # -- accounting
    def _count_collective(self, nbytes: int) -> None:
        if self.size > 1 and self.rank == 0:
            self.counter.add(self.axis, nbytes)

    # -- collectives (in place where the data allows)
    def allreduce(self, buf: Array, op: str = "sum") -> Array:
        """All-reduce `buf` in place (sum or max)."""
        if self.size == 1:
            return buf
        from mpi4py import MPI

        mpi_op = MPI.SUM if op == "sum" else MPI.MAX
        wide, put_back = _reducible(buf)
        self._blocking("Allreduce", buf.nbytes, lambda: self._mpi.Allreduce(MPI.IN_PLACE, _mpi_buf(wide), op=mpi_op))
        put_back()
        return buf

    def allreduce_many(self, bufs: list[Array]) -> list[Array]:
        """Sum-all-reduce each of `bufs` in place (they may differ in dtype), as one collective: counted
        once, with the bytes of them all (NCCL: one group call; MPI: one call per buffer)."""
        if self.size == 1:
            return bufs
        from mpi4py import MPI

        wides = [_reducible(b) for b in bufs]

        def run() -> None:
            for w, _ in wides:
                self._mpi.Allreduce(MPI.IN_PLACE, _mpi_buf(w), op=MPI.SUM)

        self._blocking("Allreduce", sum(b.nbytes for b in bufs), run)
        for _, put_back in wides:
            put_back()
        return bufs

    def iallreduce(self, buf: Array) -> Request:
        """Start an in-place sum all-reduce of `buf`; `.wait()` on the result before reading it."""
        if self.size == 1:
            return _DONE
        if not self.overlap:
            self.allreduce(buf)
            return _DONE
        from mpi4py import MPI

        self._count_collective(buf.nbytes)
        wide, put_back = _reducible(buf)
        self._sync()
        req = self._mpi.Iallreduce(MPI.IN_PLACE, _mpi_buf(wide), op=MPI.SUM)
        return _WatchedRequest(req, self, "Iallreduce", buf.nbytes, then=put_back, keep=wide)

    def allgather(self, buf: Array) -> Array:
        """Concatenate every member's `buf` along a new leading dim: [size, *buf.shape]."""
        xp = _xp(buf)
        if self.size == 1:
            return buf[None]
        out = xp.empty((self.size,) + buf.shape, dtype=buf.dtype)
        mine = xp.ascontiguousarray(buf)  # made before the stream sync that hands it to MPI
        self._blocking("Allgather", buf.nbytes, lambda: self._mpi.Allgather(_mpi_buf(_bits(mine)), _mpi_buf(_bits(out))))
        return out

    def _blocking(self, call: str, nbytes: int, run: Callable[[], object]) -> None:
        """A blocking collective: counted, after the stream sync, watched and timed."""
        self._count_collective(nbytes)
        self._sync()
        self._watched(call, nbytes, run)

    def _watched(self, call: str, nbytes: int, run: Callable[[], T], peer: int | None = None, timed: bool = True) -> T:
        """`run()` through the watchdog's one wrapper; with `timed` its wait is added to `wait_seconds`."""
        t0 = time.perf_counter()
        try:
            return WATCHDOG.call(self.axis, call, run, nbytes, peer)
        finally:
            if timed:
                self.wait_seconds += time.perf_counter() - t0

    def reduce_scatter(self, buf: Array, out: Array, counts: Sequence[int]) -> None:
        """Sum `buf` over the group; member i receives elements [sum(counts[:i]), sum(counts[:i+1])) of
        the sum in `out` (counts may differ and be zero). Counted as `buf`: what each member contributes."""
        self.ireduce_scatter(buf, out, counts, blocking=True)

    def ireduce_scatter(self, buf: Array, out: Array, counts: Sequence[int], blocking: bool = False) -> Request:
        """Start `reduce_scatter`; `.wait()` on the result before reading `out`."""
        if self.size == 1:
            out[...] = buf
            return _DONE
        from mpi4py import MPI

        self._count_collective(buf.nbytes)
        (wide, _), (wide_out, put_back) = _reducible(buf), _reducible(out, keep=False)
        self._sync()
        counts = [int(c) for c in counts]
        if blocking or not self.overlap:
            self._watched("Reduce_scatter", buf.nbytes, lambda: self._mpi.Reduce_scatter(
                _mpi_buf(wide), _mpi_buf(wide_out), recvcounts=counts, op=MPI.SUM))
            put_back()
            return _DONE
        req = self._mpi.Ireduce_scatter(_mpi_buf(wide), _mpi_buf(wide_out), recvcounts=counts, op=MPI.SUM)
        return _WatchedRequest(req, self, "Ireduce_scatter", buf.nbytes, then=put_back, keep=(wide, wide_out))

    def allgather_pieces(self, buf: Array, counts: Sequence[int], counted: bool = False) -> Array:
        """In place: member i's piece sits at offset sum(counts[:i]) of `buf`; afterwards every member
        holds every piece. Counted as the piece of group rank 0 (the largest when pieces are near-equal),
        unless the caller `counted` it already (`count_allgather_pieces`)."""
        if self.size == 1:
            return buf
        if not counted:
            self.count_allgather_pieces(buf, counts)
        run, piece_bytes = _allgatherv(self._mpi, buf, counts)
        self._sync()
        self._watched("Allgatherv", piece_bytes, run)
        return buf

    def count_allgather_pieces(self, buf: Array, counts: Sequence[int]) -> None:
        """Count an `allgather_pieces` of `buf` ahead of issuing it (so that it falls in the step's totals)."""
        if self.size > 1:
            self._count_collective(int(counts[0]) * buf.itemsize)

    # -- point to point (pipeline)
    # (the requests' wait time is not added to wait_seconds: a receive also waits for the peer's compute)
    def isend(self, buf: Array, dest: int, tag: int = 0) -> Request:
        self.counter.add(self.axis, buf.nbytes)
        self._sync()
        req = self._mpi.Isend(_mpi_buf(_bits(buf)), dest=dest, tag=tag)
        return _WatchedRequest(req, self, "Isend", buf.nbytes, dest, timed=False)

    def irecv(self, buf: Array, source: int, tag: int = 0) -> Request:
        self._sync()  # no kernel still queued on this (possibly reused) memory when MPI writes it
        req = self._mpi.Irecv(_mpi_buf(_bits(buf)), source=source, tag=tag)
        return _WatchedRequest(req, self, "Irecv", buf.nbytes, source, timed=False)


class _WatchedRequest:
    """An MPI request whose wait is watched; with `timed` its wait time is added to `group.wait_seconds`."""

    def __init__(self, req: MPI.Request, group: Group, call: str, nbytes: int, peer: int | None = None,
                 timed: bool = True, then: Callable[[], None] | None = None, keep: object = None) -> None:
        self.req, self.group, self.call, self.nbytes, self.peer, self.timed = req, group, call, nbytes, peer, timed
        self.then = then  # what completes the operation once MPI has (a float32 sum put back into bfloat16)
        self.keep = keep  # buffers MPI works on until the wait (the float32 copies)

    def wait(self) -> None:
        self.group._watched(f"wait on {self.call}", self.nbytes, self.req.Wait, self.peer, self.timed)
        if self.then is not None:
            then, self.then, self.keep = self.then, None, None
            then()


def _xp(buf: Array) -> Array:
    from boostmpi.backend import get_array_module

    return get_array_module(buf)


def _nothing() -> None:
    return None


# NumPy dtype -> MPI datatype, filled on first use (importing MPI initialises it)
_MPI_TYPES: dict[np.dtype[np.generic], MPI.Datatype] = {}


def _mpi_type(dtype: npt.DTypeLike) -> MPI.Datatype | None:
    """The predefined MPI datatype of a NumPy dtype, or None for one MPI does not know (bfloat16). An
    explicit map over mpi4py's public names: the dtypes that reach MPI here, at their fixed widths."""
    if not _MPI_TYPES:
        from mpi4py import MPI

        _MPI_TYPES.update({np.dtype(t): m for t, m in (
            (np.float32, MPI.FLOAT), (np.float64, MPI.DOUBLE), (np.complex64, MPI.C_FLOAT_COMPLEX),
            (np.complex128, MPI.C_DOUBLE_COMPLEX), (np.bool_, MPI.C_BOOL),
            (np.int8, MPI.INT8_T), (np.int16, MPI.INT16_T), (np.int32, MPI.INT32_T), (np.int64, MPI.INT64_T),
            (np.uint8, MPI.UINT8_T), (np.uint16, MPI.UINT16_T), (np.uint32, MPI.UINT32_T), (np.uint64, MPI.UINT64_T))
            if m != MPI.DATATYPE_NULL})  # a type this MPI lacks is left out
    return _MPI_TYPES.get(np.dtype(dtype))


def _mpi_knows(dtype: npt.DTypeLike) -> bool:
    return _mpi_type(dtype) is not None


def _allgatherv(comm: MPI.Comm, buf: Array, counts: Sequence[int]) -> tuple[Callable[[], None], int]:
    """(the in-place Allgatherv over `comm` as a call to make, the bytes of piece 0): rank i's piece of
    `counts[i]` elements sits at offset sum(counts[:i]) of `buf`. A dtype MPI does not know (bfloat16)
    moves as bytes. The one Allgatherv of the host collectives and the groups."""
    from mpi4py import MPI

    mpi_type, counts = _mpi_type(buf.dtype), [int(c) for c in counts]
    if mpi_type is None:
        mpi_type, counts, buf = MPI.BYTE, [c * buf.itemsize for c in counts], buf.view(np.uint8)
    displs = [int(d) for d in np.concatenate([[0], np.cumsum(counts)[:-1]])]
    piece_bytes = counts[0] * (1 if mpi_type == MPI.BYTE else buf.itemsize)
    return (lambda: comm.Allgatherv(MPI.IN_PLACE, [_mpi_buf(buf), counts, displs, mpi_type])), piece_bytes


def _reducible(buf: Array, keep: bool = True) -> tuple[Array, Callable[[], None]]:
    """(an array MPI can sum, a function that puts the sum back into `buf`). MPI has no bfloat16: such a
    buffer is summed as a float32 copy (twice the bytes on the wire; each sum rounded to bfloat16 once,
    at the end) and cast back; the byte counters still count `buf`, the payload. `keep=False`: `buf`
    only receives (an output), its values are not copied in."""
    dtype = mpi_sum_dtype(buf.dtype, _mpi_knows(buf.dtype))
    if dtype == buf.dtype:
        return buf, _nothing
    xp = _xp(buf)
    wide = buf.astype(dtype) if keep else xp.empty(buf.shape, dtype=dtype)

    def put_back() -> None:
        buf[...] = wide.astype(buf.dtype)

    return wide, put_back


def _bits(buf: Array) -> Array:
    """`buf` as MPI can move it unchanged: itself, or for a type MPI does not know (bfloat16) a view of
    its bits as unsigned integers of the same width (bytes for other widths)."""
    if _mpi_knows(buf.dtype):
        return buf
    return buf.view(bits_dtype(buf.dtype))


def _mpi_buf(arr: Array) -> Array:
    """What mpi4py's buffer methods accept: the array itself (NumPy, or CuPy via __cuda_array_interface__)."""
    if isinstance(arr, np.ndarray) and not arr.flags.c_contiguous:
        raise ValueError("MPI buffers must be contiguous")
    return arr
