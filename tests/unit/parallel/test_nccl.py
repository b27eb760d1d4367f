"""The NCCL pipeline channels (boostmpi/parallel/nccl.py) against NCCL's blocking send/receive.

No GPU is needed: CuPy and its NCCL binding are replaced by fakes that record, per rank, which
stream and which communicator every send and receive was enqueued on. The engine's own 1F1B
schedule (boostmpi/parallel/pipeline.py) is replayed through real `NcclGroup` objects, one per
stage, and the recorded streams are then run under NCCL's rule: a send and its receive complete
together, and an op on a stream waits for the ops before it on that stream and for every receive
the rank had already waited for (the engine waits on each receive at once).

With the per-direction channels every schedule completes; with every op on one stream per rank
(the design the channels replaced) the same schedules deadlock, which is what the check is for.

Also here, under MPI on the CuPy stand-in: a tp or dp group's collectives share one communicator
between the current stream and the side stream of `iallreduce`, and the stand-in's NCCL checks
that they are chained on the device in the order the host issued them; and a send waits for its
receive.
"""

import itertools
import sys
import types

import numpy as np
import pytest

from boostmpi.parallel.comm import CommCounter
from boostmpi.parallel.pipeline import steps_with_messages
from tests.support.gpu_setup import GPU
from tests.support.mpi_helpers import abort_on_error

_ids = itertools.count(1)


class _Stream:
    def __init__(self, non_blocking=False):
        self.ptr = next(_ids)

    def wait_event(self, event):
        pass


class _Event:
    def __init__(self, disable_timing=True):
        pass

    def record(self, stream):
        pass


class _Recorder:
    """What one rank enqueued: (stream, kind, peer, communicator label), in host order."""

    def __init__(self):
        self.ops = []
        self.comms_made = 0
        self.main = _Stream()


RANK = {"recorder": None}


class _Communicator:
    def __init__(self, size, uid, rank):
        rec = RANK["recorder"]
        self.label = rec.comms_made  # made in the same order on every rank: the label names it
        rec.comms_made += 1

    def send(self, ptr, count, dtype, peer, stream):
        RANK["recorder"].ops.append((stream, "send", peer, self.label, ptr))

    def recv(self, ptr, count, dtype, peer, stream):
        RANK["recorder"].ops.append((stream, "recv", peer, self.label, ptr))


def _fake_cupy(stream=_Stream, event=_Event, communicator=_Communicator, current=lambda: RANK["recorder"].main):
    """Fake `cupy`, `cupy.cuda` and `cupy.cuda.nccl` modules built from the given stand-ins."""
    nccl = types.SimpleNamespace(get_unique_id=lambda: b"uid", NcclCommunicator=communicator,
                                 NCCL_FLOAT32=7, NCCL_FLOAT64=8, NCCL_INT64=4, NCCL_INT32=2, NCCL_SUM=0, NCCL_MAX=2)
    cuda = types.ModuleType("cupy.cuda")
    cuda.Stream, cuda.Event, cuda.nccl = stream, event, nccl
    cuda.get_current_stream = current
    cupy = types.ModuleType("cupy")
    cupy.cuda = cuda
    return cupy, cuda, nccl


class _MpiComm:
    def __init__(self, size, rank):
        self.size, self.rank = size, rank

    def Get_size(self):
        return self.size

    def Get_rank(self):
        return self.rank

    def bcast(self, obj, root=0):
        return obj


_TAGS = {}  # buffer pointer -> the engine's tag of the message it holds


class _Buffer:
    """Stands in for a CuPy array: what NcclGroup reads of one."""

    def __init__(self, tag=None):
        self.data = types.SimpleNamespace(ptr=next(_ids))
        self.tag = tag  # which message it holds (NCCL itself has no tags)
        _TAGS[self.data.ptr] = tag
        self.size, self.nbytes, self.dtype, self.shape = 16, 64, np.dtype(np.float32), (16,)


def _install_fake_cupy(monkeypatch, **stand_ins):
    cupy, cuda, nccl = _fake_cupy(**stand_ins)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", nccl)
    return cuda


def _record(n_stages, n_micro, p2p, monkeypatch, n_chunks=1):
    """Replays the engine's sends and receives on each stage (its schedule, its tags); returns each
    rank's ops."""
    cuda = _install_fake_cupy(monkeypatch)
    from boostmpi.parallel.nccl import NcclGroup

    recorded = []
    for stage in range(n_stages):
        rec = RANK["recorder"] = _Recorder()
        group = NcclGroup("pp", _MpiComm(n_stages, stage), CommCounter(), p2p=p2p, ring=p2p and n_chunks > 1)
        if not p2p:  # the replaced design: everything on the current stream, on the one communicator
            def isend(buf, dest, tag=0, group=group):
                group.nccl_comm.send(buf.data.ptr, buf.size, 0, dest, cuda.get_current_stream().ptr)

            def irecv(buf, source, tag=0, group=group):
                group.nccl_comm.recv(buf.data.ptr, buf.size, 0, source, cuda.get_current_stream().ptr)

            group.isend, group.irecv = isend, irecv
        for step in steps_with_messages(n_stages, stage, n_micro, n_chunks):  # forward_backward's order
            if step.recv is not None:
                group.irecv(_Buffer(step.recv[1]), step.recv[0], tag=step.recv[1])
            if step.send is not None:
                group.isend(_Buffer(step.send[1]), step.send[0], tag=step.send[1])
        recorded.append(rec.ops)
    return recorded


def _runs_to_completion(recorded):
    """NCCL's rule on the recorded streams; True when every op completes and every send meets the
    receive of the same message (NCCL matches them by order alone)."""
    # op i of rank r waits for: the op before it on its stream, and every receive rank r issued before it
    done = [[False] * len(ops) for ops in recorded]

    def ready(r, i):
        stream = recorded[r][i][0]
        return all(done[r][j] for j in range(i) if recorded[r][j][0] == stream or recorded[r][j][1] == "recv")

    progress = True
    while progress:
        progress = False
        for r, ops in enumerate(recorded):
            for i, (_stream, kind, peer, label, ptr) in enumerate(ops):
                if done[r][i] or kind != "send" or not ready(r, i):
                    continue
                # the peer's first not-done receive from r on the same communicator must be this one's match
                match = next((j for j, (_, k, p, lab, _ptr) in enumerate(recorded[peer])
                              if not done[peer][j] and k == "recv" and p == r and lab == label), None)
                if match is not None and ready(peer, match):
                    if _TAGS[ptr] != _TAGS[recorded[peer][match][4]]:
                        return False  # the receive would get another message's data
                    done[r][i] = done[peer][match] = True
                    progress = True
    return all(all(row) for row in done)


@pytest.mark.parametrize("n_stages, n_micro", [(2, 1), (2, 2), (2, 4), (3, 3), (3, 6), (4, 4), (4, 8)])
def test_pipeline_channels_never_deadlock(monkeypatch, n_stages, n_micro):
    recorded = _record(n_stages, n_micro, p2p=True, monkeypatch=monkeypatch)
    for rank, ops in enumerate(recorded):  # activations travel up on one channel, gradients down on the other
        up = {(stream, lab) for stream, kind, peer, lab, _ in ops if (kind == "send") == (peer > rank)}
        down = {(stream, lab) for stream, kind, peer, lab, _ in ops if (kind == "send") != (peer > rank)}
        assert len(up) <= 1 and len(down) <= 1 and not up & down, (rank, up, down)
        assert all(lab != 0 for _, _, _, lab, _ in ops)  # never on the collectives' communicator
    assert _runs_to_completion(recorded)


@pytest.mark.parametrize("n_stages, n_micro, n_chunks", [(2, 2, 2), (2, 4, 2), (2, 6, 3), (3, 3, 2), (3, 6, 3),
                                                     (4, 4, 2), (4, 8, 2), (4, 12, 3), (5, 10, 2)])
def test_ring_channels_never_deadlock(monkeypatch, n_stages, n_micro, n_chunks):
    """Interleaved 1F1B: one channel per kind of message and direction, each used on one stream."""
    recorded = _record(n_stages, n_micro, p2p=True, monkeypatch=monkeypatch, n_chunks=n_chunks)
    for ops in recorded:
        per_channel = {}
        for stream, _kind, _peer, lab, _ in ops:
            per_channel.setdefault(lab, set()).add(stream)
        assert all(len(streams) == 1 for streams in per_channel.values()) and 0 not in per_channel
    assert _runs_to_completion(recorded)


def test_ring_on_channels_by_kind_alone_deadlocks(monkeypatch):
    """The check can fail: with one channel for activations and one for gradients (each used both
    ways round the ring), two neighbouring ranks block on sends to each other."""
    from boostmpi.parallel.nccl import NcclGroup

    real_init, real_channel = NcclGroup.__init__, NcclGroup._p2p_channel

    def init(self, axis, mpi_comm, counter, overlap=True, p2p=False, ring=False):
        real_init(self, axis, mpi_comm, counter, overlap, p2p=p2p, ring=False)  # two channels

    def by_kind(self, direction, tag):
        return real_channel(self, +1 if tag & 1 == 0 else -1, tag)

    monkeypatch.setattr(NcclGroup, "__init__", init)
    monkeypatch.setattr(NcclGroup, "_p2p_channel", by_kind)
    for n_stages, n_micro in ((2, 4), (4, 8)):
        assert not _runs_to_completion(_record(n_stages, n_micro, p2p=True, monkeypatch=monkeypatch, n_chunks=2))


@pytest.mark.parametrize("n_stages, n_micro", [(2, 2), (3, 6), (4, 8)])
def test_one_stream_per_rank_deadlocks(monkeypatch, n_stages, n_micro):
    """The check can fail: the same schedules on a single stream per rank do not complete."""
    assert not _runs_to_completion(_record(n_stages, n_micro, p2p=False, monkeypatch=monkeypatch))


def test_a_group_without_channels_refuses_point_to_point(monkeypatch):
    _install_fake_cupy(monkeypatch)
    from boostmpi.parallel.nccl import NcclGroup

    RANK["recorder"] = _Recorder()
    group = NcclGroup("tp", _MpiComm(2, 0), CommCounter())
    with pytest.raises(RuntimeError, match="without p2p=True"):
        group.isend(_Buffer(), 1)


# ---------------------------------------------------------------- the NCCL stand-in, between real ranks
# A tp or dp group's collectives share one communicator between the current stream and the side
# stream of `iallreduce`; the CuPy stand-in's NCCL (testing/cupy_standin/cupy/cuda/nccl.py) refuses an
# operation that is not ordered on the device after every earlier one of its communicator, and
# carries out the data over MPI. These run where the stand-in is in use (the GPU suite otherwise
# runs on a real device), on the first two ranks of the job.
needs_standin = pytest.mark.skipif(not GPU.standin, reason="checks the CuPy stand-in's NCCL; a real GPU is in use")


def _pair_group(p2p=False):
    """An NcclGroup over world ranks 0 and 1 (None on the others), made on every rank together."""
    from mpi4py import MPI

    from boostmpi.parallel.nccl import NcclGroup, select_device

    world = MPI.COMM_WORLD
    select_device(world.Get_rank())  # one GPU per rank, as NCCL requires
    comm = world.Split(0 if world.Get_rank() < 2 else 1, world.Get_rank())
    if world.Get_rank() >= 2:
        comm.Free()
        return None
    return NcclGroup("tp", comm, CommCounter(), p2p=p2p)


def _filled(value, n=5):
    import cupy

    return cupy.full(n, float(value), dtype=np.float32)


@needs_standin
@pytest.mark.mpi(min_size=2)
def test_collectives_on_one_communicator_run_in_issue_order():
    """Side-stream all-reduces in flight, an all-reduce and an all-gather on the current stream
    issued before anyone waited for them: the stand-in accepts the order and every sum is right."""
    with abort_on_error():
        group = _pair_group()
        if group is None:
            return
        r = group.rank + 1  # 1 and 2: every all-reduce gives 3 x its input's scale
        a, b, c, e = _filled(r), _filled(10 * r), _filled(100 * r), _filled(1000 * r)
        first, second = group.iallreduce(a), group.iallreduce(b)
        group.allreduce(c)
        gathered = group.allgather(_filled(r, 3))
        third = group.iallreduce(e)
        third.wait()
        first.wait(), second.wait()
        for arr, want in ((a, 3), (b, 30), (c, 300), (e, 3000)):
            assert (arr.get() == want).all(), (arr.get(), want)
        assert (gathered.get() == np.array([[1.0] * 3, [2.0] * 3])).all()


@needs_standin
@pytest.mark.mpi(min_size=2)
def test_an_unordered_collective_is_refused():
    """The check can fail: without the chaining (the current stream never waiting for the side
    stream) an all-reduce could run while an earlier one of its communicator still does."""
    from cupy.cuda.nccl import NcclOrderError

    with abort_on_error():
        group = _pair_group()
        if group is None:
            return
        group._collective_stream = group._stream
        first = _filled(1)  # kept alive: its memory is the side stream's until the wait
        pending = group.iallreduce(first)
        with pytest.raises(NcclOrderError, match="not ordered after"):
            group.allreduce(_filled(2))
        pending.wait()


@needs_standin
@pytest.mark.mpi(min_size=2)
def test_a_send_waits_for_the_matching_receive():
    """NCCL's rule: a send's stream is blocked until the peer posts the receive (here 1 s late)."""
    import time

    import cupy

    with abort_on_error():
        group = _pair_group(p2p=True)
        if group is None:
            return
        buf = _filled(7.0) if group.rank == 0 else cupy.zeros(5, dtype=np.float32)
        group.comm.Barrier()
        start = time.monotonic()
        if group.rank == 0:
            group.isend(buf, 1).wait()
            cupy.cuda.get_current_stream().synchronize()
            assert time.monotonic() - start >= 0.9
        else:
            time.sleep(1.0)
            group.irecv(buf, 0).wait()
            assert (buf.get() == 7.0).all()
