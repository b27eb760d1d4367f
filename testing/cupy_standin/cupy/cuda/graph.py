"""CUDA graphs by stream capture: `Stream.begin_capture` / `end_capture` / `is_capturing` and
`cupy.cuda.graph.Graph`, as CuPy 14.2.0 has them (cupy/cuda/stream.pyx and cupy/cuda/graph.pyx at tag
v14.2.0), with the CUDA runtime's rules for what a capture allows.

Recorded, not executed. Device work issued to a capturing stream -- every tracked CuPy call
(`_tracked._device_work`: ufuncs, reductions, copies, `astype`, setitem, gathers, RawKernel
launches), a cuBLAS GEMM through `cupy.cuda.cublas`, an NCCL operation, the cuDNN stand-in's
`execute` -- resolves its arguments, dtypes and shapes at once (the call runs in the shapes-only mode,
`_memory.META`, on memory of the process's kind, so it allocates what it would and writes nothing)
and becomes a node of the capture. `Graph.launch(stream)` runs the nodes in issue order, every time:
a call node calls the same function on the same arguments again (arrays over the same bytes, read at launch,
Python scalars and host values are the ones captured) with the arrays it made taken from a scratch
allocator outside the pool, and copies them into the arrays the capture made (whose addresses the
caller holds); a GEMM node computes with the alpha and beta read at capture (host pointer mode: cuBLAS
reads them when the call is made); an NCCL node queues the operation on the launch stream; a cuDNN
node runs the attention plan. The launch is device work on its stream for the order tracking
(cuda/_order.py): each node makes the accesses recorded at capture, on the launch stream (a forked
branch's on an actor of its own, below). A launch
makes no host-side records (call recording, `cublas.called`, `cudnn.executions`): the capture made
them once. A launch counts no host synchronization.

What a capture refuses, as the real stack does:
- CuPy refuses a capture on the legacy default stream (stream.pyx:393) and refuses host transfers
  on a capturing stream before calling CUDA, with a RuntimeError that leaves the capture valid
  (memory.pyx:713-719 `copy_to_host_async`, which `get` calls (core.pyx:2203), so `get`, `item`,
  `float()`, `asnumpy`, a boolean mask (`int(mask_scanned[-1])`, _routines_indexing.pyx:802);
  memory.pyx:614-621 `copy_from_host_async`: `set`, `cupy.array` of host data (core.pyx:2928)).
  On ROCm those checks are skipped (`not runtime._is_hip_environment`), so the runtime call fails.
- The runtime: synchronizing or querying a capturing stream, an event recorded in a capture, or
  the device while a stream captures is invalid and invalidates the capture (CUDA C++ Programming
  Guide, "Prohibited and Unhandled Operations" under "Stream Capture",
  https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#prohibited-and-unhandled-operations):
  cudaErrorStreamCaptureUnsupported (cudaErrorCapturedEvent for an event), and `end_capture` then
  raises cudaErrorStreamCaptureInvalidated; work on the legacy stream while a blocking stream
  captures gives cudaErrorStreamCaptureImplicit (cudaStreamIsCapturing's documentation); a fork
  (another stream waiting on an event of the capture joins it) that is not joined back before
  `end_capture` gives cudaErrorStreamCaptureUnjoined; in the global and thread-local modes a
  cudaMalloc (a new pool allocation) is refused, in relaxed mode, CuPy's default, it is allowed
  (stream.pyx:395-403; the runtime header's documentation of cudaThreadExchangeStreamCaptureMode, as
  bindings reproduce it: https://docs.rs/rcudnn/latest/rcudnn/fn.cudaThreadExchangeStreamCaptureMode.html,
  and of cudaStreamIsCapturing for the legacy stream: https://docs.rs/rcudnn/latest/rcudnn/fn.cudaStreamIsCapturing.html).
Work on a stream that is not capturing runs at once, as always.

Memory: during a capture the pool hands out chunks of the current (capturing) stream's arena and
takes freed ones back at once, as CuPy does, so later captured work reuses them. A graph keeps the
addresses its work uses, not the arrays (`_Held`: the harness allocation behind a chunk stays while a
graph addresses it, even when the pool gives the chunk back or splits it anew). A launch raises
`GraphMemoryError` when one of its nodes would touch bytes that the pool has handed, since the capture,
to an array the graph does not use and that is still alive: the program freed an array the graph uses
(a captured temporary, or an output it dropped) and the bytes now hold other data, which a launch on a
GPU would overwrite (or read). This check reads the accesses the order tracking records, so it is off
with `BOOSTMPI_STANDIN_TRACK=0`.

Forks: a stream that waits on an event recorded in the capture joins it, and its work is a branch of
the graph; the launch runs every node in issue order (a race-free graph gives the same data in any order
its edges allow),
and for the order tracking each branch is an actor of its own, ordered by the graph's edges (the events
recorded and waited for in the capture), so a race between branches of one graph is reported.

Not modelled: host functions (`launch_host_func` during capture), `debug_dot_str`, capture modes beyond
what they allow of cudaMalloc.
"""

import contextlib
import weakref

_active = []  # the captures in progress (any thread)


class _Capture:
    def __init__(self, origin, mode):
        self.origin, self.mode = origin, mode
        self.nodes = []
        self.accesses = []  # those of the node being recorded (`_order.access` puts them here)
        self.error = None  # the status that invalidated the capture
        self.forked = {}  # stream -> number of nodes when it last issued work (a fork of the capture)
        self.joined = {}  # stream -> the node count up to which the origin has waited for it
        self.held = weakref.WeakKeyDictionary()  # pool Memory -> its _Held (one per memory)
        self.all_held = []


class _Node:
    """Work of a capture (`run`, its `accesses`), or an event recorded or waited for (`mark`: ("record" or
    "wait", token)), issued on the capture's `stream`."""

    __slots__ = ("what", "run", "accesses", "keep", "stream", "mark")

    def __init__(self, what, run, accesses, keep, stream, mark=None):
        self.what, self.run, self.accesses, self.keep = what, run, accesses, keep
        self.stream, self.mark = stream, mark


def _runtime():
    from cupy.cuda import runtime

    return runtime


def _error(status):
    return _runtime().CUDARuntimeError(status)


def _fail(captures, status):
    """The runtime's answer to an invalid call during capture: the captures are invalidated."""
    for cap in captures:
        if cap.error is None:
            cap.error = status
    raise _error(status)


def capture_of(stream):
    return getattr(stream, "capture", None)


def _blocking_captures():
    return [c for c in _active if any(not s.non_blocking for s in [c.origin, *c.forked])]


# ------------------------------------------------------------------ Stream's capture API
def begin(stream, mode=None):
    """stream.pyx:350 `begin_capture`."""
    runtime = _runtime()
    if stream.ptr in (0, 1):
        raise RuntimeError("cannot capture on the default (legacy) stream")  # stream.pyx:393-394
    if mode is None:
        mode = runtime.streamCaptureModeRelaxed  # stream.pyx:395-403
    if capture_of(stream) is not None:  # "it may only be initiated if the stream is not already in capture mode"
        raise _error(runtime.errorIllegalState)
    stream.capture = _Capture(stream, int(mode))
    _active.append(stream.capture)


def end(stream):
    """stream.pyx:407 `end_capture`: the graph, or the runtime's error (the streams leave the capture either way
    when it was begun on this stream)."""
    runtime = _runtime()
    cap = capture_of(stream)
    if cap is None:
        raise _error(runtime.errorIllegalState)
    if cap.origin is not stream:
        raise _error(runtime.errorStreamCaptureUnmatched)
    for s in [cap.origin, *cap.forked]:
        s.capture = None
    _active.remove(cap)
    unjoined = [s for s, n in cap.forked.items() if cap.joined.get(s, 0) < n]
    if cap.error is None and unjoined:
        cap.error = runtime.errorStreamCaptureUnjoined
    if cap.error is not None:
        raise _error(runtime.errorStreamCaptureInvalidated if cap.error != runtime.errorStreamCaptureUnjoined
                     else cap.error)
    return Graph._from_nodes(cap.nodes, cap.all_held, cap.origin)


def is_capturing(stream):
    """runtime.pyx:1036 `streamIsCapturing`: the legacy stream while a blocking stream captures is an error
    (which does not invalidate); an invalidated capture raises CuPy's RuntimeError."""
    if stream.ptr == 0 and _blocking_captures():
        raise _error(_runtime().errorStreamCaptureImplicit)
    cap = capture_of(stream)
    if cap is not None and cap.error is not None:
        raise RuntimeError("the stream was capturing, but an error has invalidated the capture sequence")
    return cap is not None


# ------------------------------------------------------------------ what the rest of the stand-in asks
def device_work(stream):
    """Before device work on `stream`: its capture (None: it runs now). The legacy stream while a
    blocking stream captures, and a capture already invalidated, refuse it."""
    runtime = _runtime()
    if stream.ptr == 0:
        blocking = _blocking_captures()
        if blocking:
            _fail(blocking, runtime.errorStreamCaptureImplicit)
        return None
    cap = capture_of(stream)
    if cap is None:
        return None
    if cap.error is not None:
        raise _error(runtime.errorStreamCaptureInvalidated)
    if stream is not cap.origin:
        cap.forked[stream] = len(cap.nodes) + 1
    cap.issuing = stream
    return cap


def host_transfer(stream, direction):
    """A copy between the host and the device on `stream` (CuPy's `copy_to_host_async` /
    `copy_from_host_async`): refused while it captures."""
    if capture_of(stream) is None:
        return
    if _runtime().is_hip:  # CuPy skips its check on ROCm: the runtime's synchronous copy fails
        _fail([capture_of(stream)], _runtime().errorStreamCaptureUnsupported)
    raise RuntimeError(f"the current stream is capturing, so {direction} transfers are disallowed")


def check_sync(stream):
    """cudaStreamSynchronize / cudaStreamQuery of a stream (the legacy one covers the blocking streams)."""
    runtime = _runtime()
    if stream.ptr == 0:
        blocking = _blocking_captures()
        if blocking:
            _fail(blocking, runtime.errorStreamCaptureImplicit)
    elif capture_of(stream) is not None:
        _fail([capture_of(stream)], runtime.errorStreamCaptureUnsupported)


def check_device_sync():
    """cudaDeviceSynchronize while any stream captures."""
    if _active:
        _fail(list(_active), _runtime().errorStreamCaptureUnsupported)


def check_event(event):
    """cudaEventSynchronize / cudaEventQuery of an event last recorded in a capture still in progress."""
    cap = getattr(event, "capture", None)
    if cap is not None and cap in _active:
        _fail([cap], _runtime().errorCapturedEvent)


def on_record(event, stream):
    """Event.record: an event recorded in a capture is a node of it (other streams may wait on it)."""
    cap = capture_of(stream)
    if cap is not None and cap.error is not None:
        raise _error(_runtime().errorStreamCaptureInvalidated)
    event.capture = cap
    event.capture_nodes = len(cap.nodes) if cap is not None else 0
    event.capture_stream = stream
    if cap is not None:
        event.capture_token = object()
        cap.nodes.append(_Node(None, None, [], (), stream, ("record", event.capture_token)))


def on_wait(stream, event):
    """stream.wait_event: waiting on an event of a capture joins the stream to it (a fork); the origin
    waiting on an event of a forked stream joins that stream back up to the event. True: an edge of the
    graph (nothing waits now)."""
    cap = getattr(event, "capture", None)
    if cap is None or cap not in _active:
        return False
    own = capture_of(stream)
    if own is None:
        stream.capture = cap
        cap.forked.setdefault(stream, 0)
    elif own is not cap:
        raise _error(_runtime().errorStreamCaptureUnsupported)  # two captures may not be merged this way
    if stream is cap.origin and event.capture_stream in cap.forked:
        cap.joined[event.capture_stream] = max(cap.joined.get(event.capture_stream, 0), event.capture_nodes)
    cap.nodes.append(_Node(None, None, [], (), stream, ("wait", event.capture_token)))
    return True


def check_malloc():
    """A new pool allocation (cudaMalloc) during a capture in the global or thread-local mode."""
    strict = [c for c in _active if c.mode != _runtime().streamCaptureModeRelaxed]
    if strict:
        _fail(strict, _runtime().errorStreamCaptureUnsupported)


class GraphMemoryError(RuntimeError):
    """A launch would touch bytes the pool has handed, since the capture, to an array outside the graph."""


class _Place:
    __slots__ = ("alloc", "offset")

    def __init__(self, alloc, offset):
        self.alloc, self.offset = alloc, offset


class _Held:
    """A captured array's memory as its graph holds it: the address, the bytes (whose harness allocation is
    kept while the graph lives) and the place in the pool's allocation, not the pool's chunk, which the
    program may free and the pool hand out again, as in CuPy."""

    __slots__ = ("ptr", "host", "chunk", "size", "site", "origin", "__weakref__")

    def __init__(self, mem):
        from cupy import _memory

        self.ptr, self.host, self.size, self.site = mem.ptr, mem.host, mem.size, mem.site
        self.chunk = _Place(mem.chunk.alloc, mem.chunk.offset)
        self.origin = weakref.ref(mem)
        _memory.pin(mem.raw)
        weakref.finalize(self, _memory.unpin, mem.raw)


def _hold(cap, mem):
    from cupy import _memory

    if not isinstance(mem, _memory.Memory) or mem.chunk is None:
        return mem
    held = cap.held.get(mem)
    if held is None:
        held = cap.held[mem] = _Held(mem)
        cap.all_held.append(held)
    return held


def _shadow(cap, value):
    """`value` with each device array replaced by one over the same bytes that holds them as the graph does."""
    from cupy import ndarray

    if isinstance(value, ndarray):
        held = _hold(cap, value._mem)
        return value if held is value._mem else ndarray._view(value._a, held, None)
    if isinstance(value, tuple):
        return tuple(_shadow(cap, v) for v in value)
    if isinstance(value, list):
        return [_shadow(cap, v) for v in value]
    return value


def record(cap, what, run, keep=()):
    """A node of `cap`: `run(launch_stream)` does its work at each launch; the accesses the call made
    (through `_order`) are its accesses; the memory of `keep` is held with the graph."""
    accesses = [(_hold(cap, access[0]),) + access[1:] for access in cap.accesses]
    cap.nodes.append(_Node(what, run, accesses, tuple(_hold(cap, m) for m in keep), getattr(cap, "issuing", cap.origin)))
    cap.accesses = []


@contextlib.contextmanager
def shapes_only():
    """A captured call resolves its shapes and allocates, and computes nothing (the meta mode's paths)."""
    from cupy import _memory

    saved = _memory.META, _memory.memory_mode
    _memory.memory_mode, _memory.META = _memory._meta_memory(), True
    try:
        yield
    finally:
        _memory.META, _memory.memory_mode = saved


# ------------------------------------------------------------------ replay
class _ScratchChunk:
    __slots__ = ("size",)

    def __init__(self, size):
        self.size = size


class _Scratch:
    """Memory for what a call node makes at launch, outside the pool (a graph launch allocates nothing)."""

    def malloc(self, nbytes):
        from cupy import _memory

        size = _memory._round_size(nbytes)
        mem = _memory.Memory(self, _memory._harness().alloc(size), _ScratchChunk(size))
        return mem

    def _release(self, raw, ptr, chunk):
        from cupy import _memory

        _memory._unregister(ptr)
        raw.free()


_SCRATCH = _Scratch()


@contextlib.contextmanager
def _quiet():
    """A node's work at launch: no order tracking (the node's recorded accesses stand for it), no host-side
    records, new arrays from the scratch allocator."""
    from cupy import _memory, _record
    from cupy.cuda import _order, cublas

    saved = (_order.ENABLED, _record.active, _record.gemm_logs, cublas.called, _memory._get_thread_local_allocator())
    _order.ENABLED, _record.active, _record.gemm_logs = False, None, []
    cublas.called = lambda *args, **kwargs: None
    _memory._set_thread_local_allocator(_SCRATCH.malloc)
    try:
        yield
    finally:
        _order.ENABLED, _record.active, _record.gemm_logs, cublas.called = saved[:4]
        _memory._set_thread_local_allocator(saved[4])


def _substitute(value, captured, launch):
    if any(value is s for s in captured):
        return launch
    if isinstance(value, tuple):
        return tuple(_substitute(v, captured, launch) for v in value)
    return value


def record_call(cap, what, fn, args, kwargs, result, made):
    """A tracked CuPy call (`_tracked._device_work`) as a node: `made`, the positions (among the arrays
    of `result`) of the arrays it made, which the launch fills."""
    from cupy import _memory, _tracked

    streams = [cap.origin, *cap.forked]
    args, kwargs, result = _shadow(cap, args), {k: _shadow(cap, v) for k, v in kwargs.items()}, _shadow(cap, result)

    def run(launch):
        with _quiet():
            fresh = _tracked._call(fn, _substitute(args, streams, launch),
                                   {k: _substitute(v, streams, launch) for k, v in kwargs.items()})
        if _memory.META:
            return
        want, got = _tracked._arrays(result, []), _tracked._arrays(fresh, [])
        for i in made:
            if got[i].shape != want[i].shape or got[i].dtype != want[i].dtype:
                raise AssertionError(f"stand-in graph: {what} made a {got[i].dtype} {got[i].shape} array at launch, "
                                     f"a {want[i].dtype} {want[i].shape} one at capture")
            want[i]._a[...] = got[i]._a

    record(cap, what, run)


def record_quiet(cap, what, work, keep=(), always=False):
    """A node whose launch does `work()` (on the launch stream, the current one meanwhile) with the tracking
    and host-side records off (its accesses are the node's); not in the shapes-only mode unless `always`."""
    def run(launch):
        from cupy import _memory

        if always or not _memory.META:
            with _quiet():
                work()

    record(cap, what, run, keep)


class Graph:
    """cupy.cuda.graph.Graph (graph.pyx:8 at v14.2.0): made only by `Stream.end_capture`."""

    def __init__(self, *args, **kwargs):  # graph.pyx:31
        raise NotImplementedError("currently this class cannot be initiated by the user and must be created "
                                  "via stream capture")

    @classmethod
    def _from_nodes(cls, nodes, held, origin):
        graph = cls.__new__(cls)
        graph._nodes, graph._held, graph._origin = list(nodes), list(held), origin
        return graph

    def _foreign(self):
        """The pool's chunks in use now by arrays other than those the capture used: allocation -> ranges."""
        from cupy import _memory

        own = {id(h.origin()) for h in self._held if h.origin() is not None}
        found = {}
        for ref in list(_memory._blocks.values()):
            mem = ref()
            if mem is not None and id(mem) not in own and isinstance(mem.chunk, _memory._Chunk):
                found.setdefault(id(mem.chunk.alloc), []).append((mem.chunk.offset, mem.chunk.offset + mem.size, mem))
        return found

    def _check_memory(self, node, foreign, stream):
        for mem, lo, hi, write, what, buffer, where, doing in node.accesses:
            if not isinstance(mem, _Held):
                continue
            lo, hi = lo + mem.chunk.offset, hi + mem.chunk.offset
            for start, stop, other in foreign.get(id(mem.chunk.alloc), ()):
                if start < hi and lo < stop:
                    raise GraphMemoryError(
                        f"graph launch on stream {stream.ptr:#x}: {what} (captured at {where}) "
                        f"{'writes' if write else 'reads'} {buffer}, whose bytes the pool has since handed to "
                        f"another array ({other.size} bytes, made at {other.site}, still in use): the program "
                        f"freed the captured one, and on a GPU the launch would "
                        f"{'overwrite' if write else 'read'} the new one. Keep the arrays a graph uses alive "
                        f"while it is launched (or give the graph a memory pool of its own)")

    def launch(self, stream=None):
        """graph.pyx:44: run the captured work on `stream` (None: the current one), in issue order."""
        from cupy.cuda import _order, _queue

        stream = _queue.get_current_stream() if stream is None else stream
        cap = device_work(stream)
        if cap is not None:  # launched into a capture: a child graph of it
            cap.all_held.extend(self._held)
            cap.nodes.extend(_Node(n.what, n.run, n.accesses, n.keep, stream if n.stream is self._origin else n.stream,
                                   n.mark) for n in self._nodes)
            return
        from cupy import _memory

        _queue.wait_for(stream.covered, f"graph launch on stream {stream.ptr:#x}")  # data only (as `use`)
        foreign = self._foreign()
        saved = getattr(_queue._local, "current", None)
        _queue._local.current = stream  # the nodes' work runs on the launch stream
        _memory.launch_memory.extend(self._held)
        branches, marks = {self._origin: stream}, {}

        def actor(captured):  # a forked stream's work is a branch of the graph: an actor of its own
            if captured not in branches:
                branches[captured] = _queue.Stream(non_blocking=True)
            return branches[captured]

        try:
            for node in self._nodes:
                if node.mark is not None:  # the graph's edges, for the order tracking
                    kind, token = node.mark
                    if kind == "record":
                        marks[token] = dict(actor(node.stream).clock)
                    elif token in marks:
                        _order._join(actor(node.stream).clock, marks[token])
                    continue
                self._check_memory(node, foreign, stream)
                if node.accesses and _order.ENABLED:
                    issued = _order.issue(actor(node.stream))
                    for mem, lo, hi, write, what, buffer, where, doing in node.accesses:
                        _order.access(mem, lo, hi, write, issued, what, buffer, where, doing)
                node.run(stream)
        finally:
            if self._held:
                del _memory.launch_memory[-len(self._held):]
            if saved is None:
                del _queue._local.current
            else:
                _queue._local.current = saved

    def upload(self, stream=None):
        """graph.pyx:65: cudaGraphUpload (on ROCm CuPy's shim answers hipErrorUnknown, cupy_hip_runtime.h:583)."""
        if _runtime().is_hip:
            raise _error(_runtime().errorUnknown)

    def standin_nodes(self):
        """What each node is, in launch order (a stand-in extra, for tests)."""
        return [node.what for node in self._nodes if node.mark is None]
