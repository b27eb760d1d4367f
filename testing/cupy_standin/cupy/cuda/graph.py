"""CUDA graphs by stream capture: `Stream.begin_capture` / `end_capture` / `is_capturing` and
`cupy.cuda.graph.Graph`, as CuPy 14.2.0 has them (cupy/cuda/stream.pyx and cupy/cuda/graph.pyx at tag
v14.2.0), with the CUDA runtime's rules for what a capture allows.

Recorded, not executed. Device work issued to a capturing stream -- every tracked CuPy call
(`_tracked._device_work`: ufuncs, reductions, copies, `astype`, setitem, gathers, RawKernel
launches), a cuBLAS GEMM through `cupy.cuda.cublas`, an NCCL operation, the cuDNN stand-in's
`execute` -- resolves its arguments, dtypes and shapes at once (the call runs in the shapes-only mode,
`_memory.META`, on memory of the process's kind, so it allocates what it would and writes nothing)
and becomes a node of the capture. `Graph.launch(stream)` runs the nodes in issue order, every time:
a call node calls the same function on the same argument objects again (arrays are read at launch,
Python scalars and host values are the ones captured) with the arrays it made taken from a scratch
allocator outside the pool, and copies them into the arrays the capture made (whose addresses the
caller holds); a GEMM node computes with the alpha and beta read at capture (host pointer mode: cuBLAS
reads them when the call is made); an NCCL node queues the operation on the launch stream; a cuDNN
node runs the attention plan. The launch is device work on its stream for the order tracking
(cuda/_order.py): each node makes the accesses recorded at capture, on the launch stream. A launch
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
  (stream.pyx:395-403).
Work on a stream that is not capturing runs at once, as always.

Memory: during a capture the pool hands out chunks of the current (capturing) stream's arena as
always. Each array a node uses stays alive with the graph, so a block the program frees during the
capture goes back to the pool only when the graph is gone; CuPy returns it to the stream's arena at
once, where later captured work may reuse it (its launch then writes what the capture put there, and
non-captured work that gets the block meanwhile would see it overwritten): the stand-in uses more
memory than CuPy here and cannot show that hazard.

Not modelled: intra-graph concurrency (the nodes of forked streams replay in issue order on the
launch stream, so a race between two branches of one graph is not reported), host functions
(`launch_host_func` during capture), `debug_dot_str`.
"""

import contextlib
import threading

_local = threading.local()
_active = []  # the captures in progress (any thread)


class _Capture:
    def __init__(self, origin, mode):
        self.origin, self.mode = origin, mode
        self.nodes = []
        self.accesses = []  # those of the node being recorded (`_order.access` puts them here)
        self.error = None  # the status that invalidated the capture
        self.forked = {}  # stream -> number of nodes when it last issued work (a fork of the capture)
        self.joined = {}  # stream -> the node count up to which the origin has waited for it


class _Node:
    __slots__ = ("what", "run", "accesses", "keep")

    def __init__(self, what, run, accesses, keep):
        self.what, self.run, self.accesses, self.keep = what, run, accesses, keep


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
    return Graph._from_nodes(cap.nodes)


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


def on_wait(stream, event):
    """stream.wait_event: waiting on an event of a capture joins the stream to it (a fork); the origin
    waiting on an event of a forked stream joins that stream back up to the event."""
    cap = getattr(event, "capture", None)
    if cap is None or cap not in _active:
        return
    own = capture_of(stream)
    if own is None:
        stream.capture = cap
        cap.forked.setdefault(stream, 0)
    elif own is not cap:
        raise _error(_runtime().errorStreamCaptureUnsupported)  # two captures may not be merged this way
    if stream is cap.origin and event.capture_stream in cap.forked:
        cap.joined[event.capture_stream] = max(cap.joined.get(event.capture_stream, 0), event.capture_nodes)


def check_malloc():
    """A new pool allocation (cudaMalloc) during a capture in the global or thread-local mode."""
    strict = [c for c in _active if c.mode != _runtime().streamCaptureModeRelaxed]
    if strict:
        _fail(strict, _runtime().errorStreamCaptureUnsupported)


def record(cap, what, run, keep=()):
    """A node of `cap`: `run(launch_stream)` does its work at each launch; the accesses the call made
    (through `_order`) are its accesses; `keep` stays alive with the graph."""
    cap.nodes.append(_Node(what, run, cap.accesses, tuple(keep)))
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


def replaying():
    return getattr(_local, "replaying", False)


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

    record(cap, what, run, (args, kwargs, result))


def record_quiet(cap, what, work, keep=()):
    """A node whose launch does `work()` with the tracking and host-side records off."""
    def run(launch):
        from cupy import _memory

        if not _memory.META:  # in the shapes-only mode nothing is computed at launch either
            with _quiet():
                work()

    record(cap, what, run, keep)


class Graph:
    """cupy.cuda.graph.Graph (graph.pyx:8 at v14.2.0): made only by `Stream.end_capture`."""

    def __init__(self, *args, **kwargs):  # graph.pyx:31
        raise NotImplementedError("currently this class cannot be initiated by the user and must be created "
                                  "via stream capture")

    @classmethod
    def _from_nodes(cls, nodes):
        graph = cls.__new__(cls)
        graph._nodes = list(nodes)
        return graph

    def launch(self, stream=None):
        """graph.pyx:44: run the captured work on `stream` (None: the current one), in issue order."""
        from cupy.cuda import _order, _queue

        stream = _queue.get_current_stream() if stream is None else stream
        cap = device_work(stream)
        if cap is not None:  # launched into a capture: a child graph of it
            for node in self._nodes:
                cap.accesses = list(node.accesses)
                record(cap, node.what, node.run, node.keep)
            return
        _queue.wait_for(stream.covered, f"graph launch on stream {stream.ptr:#x}")  # data only (as `use`)
        saved = getattr(_queue._local, "current", None)
        _queue._local.current = stream  # the nodes' work runs on the launch stream
        _local.replaying = True
        try:
            for node in self._nodes:
                if node.accesses and _order.ENABLED:
                    issued = _order.issue(stream)
                    for mem, lo, hi, write, what, buffer, where, doing in node.accesses:
                        _order.access(mem, lo, hi, write, issued, what, buffer, where, doing)
                node.run(stream)
        finally:
            _local.replaying = False
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
        return [node.what for node in self._nodes]
