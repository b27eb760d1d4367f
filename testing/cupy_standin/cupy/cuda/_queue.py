"""Streams, events and the device work queued on them (the stand-in's ordering model).

Host compute (array operations, kernel launches) runs eagerly, as if on the current stream at the
moment it is issued. Device work that can wait -- NCCL operations -- is a `DeviceOp` queued on a
stream: it starts once everything its stream covered at enqueue time has finished (the ops queued
before it on that stream, and every op covered by the events the stream waited on), and finishes
when its MPI requests complete. A stream's `covered` set is downward closed (it includes the
dependencies of everything in it), so "is op A ordered before op B" is `A in B.deps`.

Blocking points -- `Stream.synchronize`, `Event.synchronize`, the current stream waiting on an
event, device work queued on the current stream -- drive the queue until what they wait for is
done. A wait that makes no progress for `BOOSTMPI_STANDIN_WAIT_S` seconds (default 120) raises
with what it waited for: on a GPU that would be a hang.

This queue only keeps the data right (the eager host compute must see what NCCL delivered). Which
accesses a GPU would order is tracked separately, by the rules CUDA gives (cuda/_order.py): the
waits done here for the data (switching streams, queuing on the current stream) order nothing there.
"""

import itertools
import os
import threading
import time
import weakref

from cupy.cuda import _order, graph

_op_ids = itertools.count(1)
_stream_ptrs = itertools.count(0x5000)
_pending = []  # DeviceOps not yet done, in issue order
_done = set()
_synced = set()  # ops the host has waited for (a synchronize, or a query that saw them done): ordered before all it issues next
_local = threading.local()
host_syncs = 0  # blocking waits of the host for the device (synchronize; get() and the like synchronize too)


def _host_sync():
    global host_syncs
    host_syncs += 1


class StandinDeadlock(RuntimeError):
    """A wait on device work that can never finish (NCCL would hang here)."""


class DeviceOp:
    """Device work with a start (when its dependencies are done) and an asynchronous finish."""

    def __init__(self, what, start, test, finish=None):
        self.id = next(_op_ids)
        self.what = what
        self._start, self._test, self._finish = start, test, finish
        self.deps = frozenset()
        self.started = False

    def __repr__(self):
        return f"op {self.id} ({self.what})"


def progress():
    """Start every queued op whose dependencies are done; finish those whose requests completed."""
    moved = True
    any_moved = False
    while moved:
        moved = False
        for op in list(_pending):
            if not op.started and op.deps <= _done:
                op.started = True
                op._start()
                moved = True
            if op.started and op._test():
                if op._finish is not None:
                    op._finish()
                _pending.remove(op)
                _done.add(op.id)
                moved = True
        any_moved |= moved
    return any_moved


def wait_for(ids, what):
    """Drive the queue until every op in `ids` is done."""
    limit = float(os.environ.get("BOOSTMPI_STANDIN_WAIT_S", "120"))
    last_move = time.monotonic()
    idle = 0
    while not ids <= _done:
        if progress():
            last_move, idle = time.monotonic(), 0
            continue
        idle += 1
        if idle > 50:
            time.sleep(0.0005)  # two cores shared by every rank: let the peers run
        if time.monotonic() - last_move > limit:
            waiting = [op for op in _pending if op.id in ids]
            raise StandinDeadlock(f"{what} waited {limit:g} s for {waiting}; on a GPU this would hang "
                                  f"(a send whose receive is never posted, or ops queued in an order that cannot complete)")


def enqueue(stream, op):
    op.deps = frozenset(stream.covered)
    stream.covered = stream.covered | {op.id}
    _pending.append(op)
    progress()
    if stream is get_current_stream():  # the host computes on this stream next: it must be done
        wait_for({op.id}, f"{op} on the current stream")
    return op


class Stream:
    null = None  # set below
    _live = weakref.WeakSet()  # for finding a stream by its pointer (NCCL gets pointers)

    def __init__(self, null=False, non_blocking=False, ptr=None):
        self.ptr = 0 if null else next(_stream_ptrs)
        self.non_blocking = non_blocking
        self.covered = frozenset()
        self.capture = None  # the stream capture it takes part in (cuda/graph.py)
        _order.init_stream(self)
        Stream._live.add(self)

    def wait_event(self, event):
        if graph.on_wait(self, event):  # an edge of a CUDA graph being captured: nothing waits now
            return
        self.covered = self.covered | event.covers
        _order.wait(self, event)
        if self is get_current_stream():
            wait_for(event.covers, f"the current stream waiting on {event!r}")

    def record(self, event=None):
        from cupy.cuda import Event

        event = Event() if event is None else event
        event.record(self)
        return event

    def synchronize(self):
        graph.check_sync(self)
        _host_sync()
        wait_for(self.covered, f"synchronize of stream {self.ptr:#x}")
        _synced.update(self.covered)
        _order.host_waits(self.clock)

    def begin_capture(self, mode=None):
        """stream.pyx:350 at v14.2.0 (cuda/graph.py)."""
        graph.begin(self, mode)

    def end_capture(self):
        """stream.pyx:407: the captured work as a `cupy.cuda.graph.Graph`."""
        return graph.end(self)

    def is_capturing(self):
        """stream.pyx:427."""
        return graph.is_capturing(self)

    @property
    def done(self):
        graph.check_sync(self)  # cudaStreamQuery
        progress()
        if self.covered <= _done:
            _synced.update(self.covered)
            _order.host_waits(self.clock)  # the host saw it finish: as good as a synchronize
            return True
        return False

    def use(self):
        _local.current = self
        # host compute from here on runs on this stream: its queued device work must be done (data
        # only; for the order tracking this is no synchronize, as CuPy's `use` is none)
        wait_for(self.covered, f"switching to stream {self.ptr:#x}")
        return self

    def __enter__(self):
        _stack().append(get_current_stream())
        return self.use()

    def __exit__(self, *exc):
        _stack().pop().use()
        return False

    def __repr__(self):
        return f"<cupy.cuda.Stream {self.ptr:#x} (stand-in)>"


Stream.null = Stream(null=True)


def _stack():
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def get_current_stream(device_id=None):
    return getattr(_local, "current", Stream.null)


class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.disable_timing = disable_timing
        self.covers = frozenset()
        self.clock = {}
        self.recorded = False

    def record(self, stream=None):
        stream = get_current_stream() if stream is None else stream
        graph.on_record(self, stream)
        self.covers = frozenset(stream.covered)
        _order.record(self, stream)
        self.recorded = True

    def synchronize(self):
        graph.check_event(self)
        _host_sync()
        wait_for(self.covers, f"synchronize of {self!r}")
        _synced.update(self.covers)
        _order.host_waits(self.clock)

    @property
    def done(self):
        graph.check_event(self)  # cudaEventQuery
        progress()
        if self.covers <= _done:
            _synced.update(self.covers)
            _order.host_waits(self.clock)
            return True
        return False

    def __repr__(self):
        return f"<cupy.cuda.Event covering {sorted(self.covers)} (stand-in)>"


def get_elapsed_time(start_event, end_event):
    raise RuntimeError("the CuPy stand-in has no device clock: event timing needs a real GPU")
