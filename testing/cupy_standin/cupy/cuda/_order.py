"""Happens-before tracking of device memory: the stand-in's check of stream order.

The stand-in computes eagerly, so the host always holds final values and a missing wait changes
no result. This module records what a GPU would order instead. Every access to device memory is
made by an *actor* -- a stream (host compute and kernel launches on the current stream, NCCL work
on the stream it was given) or the host itself (CUDA-aware MPI reading or writing a buffer through
`__cuda_array_interface__`) -- at a sequence number of that actor. Each actor carries a vector
clock: the highest sequence number of every actor known to be ordered before its next access.

- program order: a stream's accesses are ordered among themselves;
- `Event.record(s)` copies s's clock into the event; `t.wait_event(e)` joins it into t's clock;
- `Stream.synchronize`, `Event.synchronize`, `Device.synchronize` join into the host's clock, and
  every later access (any stream's, since the host issues it afterwards) is ordered after them;
- the legacy null stream: work on it waits for the blocking streams and they wait for it (streams
  made with `non_blocking=True`, as the engine's are, do neither).

Every allocation of the memory pool keeps the byte ranges of its accesses since they were last
overwritten, across reuse of its bytes by later chunks (split from it or merged over it; the pool's
chunks stay with the stream that allocated them). A read
not ordered after the last write of the bytes it touches, or a write not ordered after the last
write and every read since, raises `StreamOrderError` naming the buffer and both sides.
`BOOSTMPI_STANDIN_TRACK=0` turns the tracking off.
"""

import os
import sys

ENABLED = os.environ.get("BOOSTMPI_STANDIN_TRACK", "1") != "0"
HOST = "host"
CAPTURED = "captured"  # the actor of an access recorded by a stream capture (`issue`)
_STANDIN = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../testing/cupy_standin/cupy
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(_STANDIN)))


class StreamOrderError(RuntimeError):
    """Two accesses to device memory that no event, stream wait or synchronize orders (a data race on a GPU)."""


class _Host:
    def __init__(self):
        self.clock = {}  # what the host knows has finished (and its own accesses)
        self.epoch = 0  # bumped whenever the clock grows: streams join it lazily
        self.seq = 0


_host = _Host()
_issued = {}  # every stream's last sequence number (streams no longer referenced too): what a device synchronize covers


def _actor_name(actor):
    return "the host side (no stream)" if actor == HOST else f"stream {actor:#x}"


def call_site():
    """`file:line (function)` of the first frame outside the stand-in: the code that issued the access."""
    f = sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith(_STANDIN):
        f = f.f_back
    if f is None:
        return "?"
    return f"{_short(f.f_code.co_filename)}:{f.f_lineno} ({f.f_code.co_name})"


def _short(path):
    """A path relative to the repository (or from the installed package's folder on)."""
    if path.startswith(_REPO + os.sep):
        return path[len(_REPO) + 1:]
    i = path.rfind(f"{os.sep}boostmpi{os.sep}")
    return path[i + 1:] if i >= 0 else path


def _join(into, other):
    for actor, seq in other.items():
        if into.get(actor, 0) < seq:
            into[actor] = seq


# ------------------------------------------------------------------ streams, events, the host
def init_stream(stream):
    stream.clock, stream.seq, stream.host_epoch = {}, 0, -1


def issue(stream):
    """A new access on `stream`: (actor, sequence number, clock it is ordered after). On a stream that
    is capturing, nothing runs: the accesses go to the capture (`access` keeps them for the graph,
    whose launches make them on the launch stream; cuda/graph.py)."""
    from cupy.cuda._queue import Stream

    if getattr(stream, "capture", None) is not None:
        return CAPTURED, stream.capture, None

    if stream.host_epoch != _host.epoch:  # issued after what the host has seen finish
        _join(stream.clock, _host.clock)
        stream.host_epoch = _host.epoch
    if stream.ptr == 0:  # the legacy default stream waits for every blocking stream
        for other in list(Stream._live):
            if other.ptr and not other.non_blocking:
                _join(stream.clock, other.clock)
    elif not stream.non_blocking:  # and a blocking stream waits for it
        _join(stream.clock, Stream.null.clock)
    stream.seq += 1
    stream.clock[stream.ptr] = _issued[stream.ptr] = stream.seq
    return stream.ptr, stream.seq, stream.clock


def issue_host():
    _host.seq += 1
    _host.clock[HOST] = _host.seq
    _host.epoch += 1
    return HOST, _host.seq, _host.clock


def record(event, stream):
    event.clock = dict(stream.clock)


def wait(stream, event):
    _join(stream.clock, event.clock)


def host_waits(clock):
    """The host has seen everything `clock` covers finish (a synchronize)."""
    _join(_host.clock, clock)
    _host.epoch += 1


def host_waits_all():
    host_waits(_issued)


# ------------------------------------------------------------------ accesses
class _Access:
    __slots__ = ("lo", "hi", "write", "actor", "seq", "what", "where")

    def __init__(self, lo, hi, write, actor, seq, what, where):
        self.lo, self.hi, self.write = lo, hi, write
        self.actor, self.seq, self.what, self.where = actor, seq, what, where

    def describe(self):
        return f"{'written' if self.write else 'read'} by {self.what} on {_actor_name(self.actor)} " \
               f"(its access #{self.seq}) at {self.where}"


def access(mem, lo, hi, write, issued, what, buffer, where=None, doing=None):
    """Check and record an access to bytes [lo, hi) of `mem` (a pool Memory) by the actor in `issued`."""
    if not ENABLED or hi <= lo or mem is None:
        return
    actor, seq, clock = issued
    if mem.chunk is None:
        return
    if actor is CAPTURED:  # recorded into a graph, made when it is launched
        seq.accesses.append((mem, lo, hi, write, what, buffer, where or call_site(), doing))
        return
    # the bytes as the pool's allocation numbers them: a later chunk split from or merged over them sees them
    off = mem.chunk.offset
    lo, hi = lo + off, hi + off
    records = mem.chunk.alloc.__dict__.setdefault("_accesses", [])
    for rec in records:
        if rec.hi <= lo or rec.lo >= hi or not (write or rec.write) or rec.actor == actor:
            continue
        if clock.get(rec.actor, 0) < rec.seq:
            where = where or call_site()
            doing = doing or ("writes" if write else "reads")
            raise StreamOrderError(
                f"stream order: {what} on {_actor_name(actor)} at {where} {doing} {buffer} "
                f"(bytes {lo - off}..{hi - off} of the {mem.size}-byte allocation made at {mem.site}), "
                f"which was {rec.describe()}, and nothing orders the two (no event recorded after it and "
                f"waited for, no stream wait, no synchronize): on a GPU they may run at the same time")
    if write:
        kept = []
        for rec in records:
            if rec.hi <= lo or rec.lo >= hi:
                kept.append(rec)
                continue
            if rec.lo < lo:
                kept.append(_Access(rec.lo, lo, rec.write, rec.actor, rec.seq, rec.what, rec.where))
            if rec.hi > hi:
                kept.append(_Access(hi, rec.hi, rec.write, rec.actor, rec.seq, rec.what, rec.where))
        records[:] = kept
    else:  # an earlier read of these bytes by the same actor is implied by this one
        records[:] = [r for r in records if r.write or r.actor != actor or r.lo < lo or r.hi > hi]
    records.append(_Access(lo, hi, write, actor, seq, what, where or call_site()))


def access_pointer(ptr, nbytes, write, issued, what, where=None):
    """`access` for code that has a raw device pointer (NCCL, cuBLAS): bytes [ptr, ptr + nbytes)."""
    from cupy._memory import host_view

    if not ENABLED or nbytes <= 0:
        return
    _, mem = host_view(ptr, nbytes)
    lo = ptr - mem.ptr
    access(mem, lo, lo + nbytes, write, issued, what, f"the buffer at {ptr:#x}", where)
