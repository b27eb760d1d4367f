"""CUDA stream capture on the CuPy stand-in (testing/cupy_standin/cupy/cuda/graph.py), in-process.

- Work issued to a capturing stream is recorded, not executed; each `Graph.launch` runs it again, in
  order, reading arrays at launch and the scalars captured; the arrays made during the capture keep
  their addresses and a launch writes them.
- What the project issues is capturable (ufuncs with out=, reductions, astype, copies, setitem,
  gathers, RawKernel, cuBLAS through the binding, NCCL, the cuDNN stand-in's execute) and a launch gives
  the bits the same calls give eagerly; the shapes-only mode captures too.
- What is not capture-safe fails as on a GPU: CuPy's refusals of host transfers (the capture stays
  valid) and of the legacy stream; the runtime's errors for a synchronize or query during capture
  (the capture is invalidated and end_capture says so), for the legacy stream while a blocking stream
  captures, for an unjoined fork and for a cudaMalloc outside the relaxed mode.
- A launch's accesses are the launch stream's for the order tracking; it counts no host synchronize.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.gpu_setup import GPU

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not GPU.standin, reason="checks the CuPy stand-in; a real GPU is in use")]

BF16 = np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def cp():
    import cupy

    yield cupy
    for stream in list(cupy.cuda.Stream._live):  # a test that failed mid-capture leaves no capture behind
        if stream.capture is not None and stream.capture.origin is stream:
            try:
                stream.end_capture()
            except RuntimeError:
                pass
    cupy.cuda.Device().synchronize()


def _stream(cp):
    return cp.cuda.Stream(non_blocking=True)


def _capture(cp, stream, fn, *args):
    with stream:
        stream.begin_capture()
        result = fn(*args)
        graph = stream.end_capture()
    return graph, result


def test_captured_work_is_recorded_not_executed_and_each_launch_runs_it(cp):
    s = _stream(cp)
    a = cp.zeros(4, dtype=np.float32)
    cp.cuda.Device().synchronize()
    with s:
        s.begin_capture()
        assert s.is_capturing() and not cp.cuda.Stream.null.is_capturing()
        a += 1
        b = a * 2  # made during the capture: its memory is the graph's target
        ptr = b.data.ptr
        graph = s.end_capture()
    assert not s.is_capturing()
    assert isinstance(graph, cp.cuda.Graph) and graph.standin_nodes() == ["ndarray.__iadd__", "ndarray.__mul__"]
    assert a.get(stream=s).tolist() == [0.0] * 4  # the capture ran nothing
    assert np.isnan(b.get(stream=s)).all()  # b's memory is as the pool gave it (the stand-in fills it with NaN)
    for _ in range(3):
        graph.launch(s)
    s.synchronize()
    assert a.get().tolist() == [3.0] * 4 and b.get().tolist() == [6.0] * 4  # +3, not +4
    assert b.data.ptr == ptr
    with s:
        graph.launch()  # the current stream
    s.synchronize()
    assert a.get().tolist() == [4.0] * 4
    with pytest.raises(NotImplementedError, match="must be created via stream capture"):
        cp.cuda.graph.Graph()


def test_a_launch_reads_arrays_at_launch_and_the_scalars_captured(cp):
    s = _stream(cp)
    x = cp.arange(4, dtype=np.float32)
    k = 3.0
    cp.cuda.Device().synchronize()
    graph, y = _capture(cp, s, lambda: x * k)
    k = 5.0  # noqa: F841  (a Python scalar is frozen in the graph)
    graph.launch(s)
    s.synchronize()
    assert y.get().tolist() == [0.0, 3.0, 6.0, 9.0]
    x.set(np.full(4, 2.0, np.float32))
    cp.cuda.Device().synchronize()
    graph.launch(s)
    s.synchronize()
    assert y.get().tolist() == [6.0] * 4


KERNEL = r'''extern "C" __global__ void axpb(const float* x, float* y, float a, float b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + b;
}'''


def _project_calls(cp, kernel, x, w, wb, idx, acc):
    """One call of each kind the project issues; returns the arrays it made."""
    from boostmpi.gpu import blas

    h = cp.multiply(x, 2.0, out=cp.empty_like(x))  # ufunc with out=
    h += x
    r = h.sum(axis=1)  # reduction
    hb = h.astype(BF16)  # cast
    c = hb.copy()
    c[1:3] = 0.5  # setitem of a slice
    g = h[idx]  # gather
    y = cp.empty_like(x)
    kernel((1,), (x.size,), (h, y, np.float32(1.5), np.float32(-1.0), np.int32(x.size)), stream=cp.cuda.get_current_stream())
    m = h @ w  # CuPy's own matmul (gemmEx inside)
    o = blas.matmul(hb, wb)  # cuBLAS through the binding: gemmEx
    o3 = blas.matmul(hb.reshape(2, 2, 8), wb)  # gemmStridedBatchedEx
    blas.matmul(hb, wb, out=acc, accumulate=True)  # beta = 1: C read too
    z = cp.where(r > 0, r, 0.0) + cp.concatenate([r, r]).mean()
    return [h, r, hb, c, g, y, m, o, o3, acc, z]


def test_what_the_project_issues_is_capturable_and_a_launch_gives_the_eager_bits(cp):
    kernel = cp.RawKernel(KERNEL, "axpb")
    rng = np.random.default_rng(0)
    host = [rng.standard_normal((4, 8)).astype(np.float32), rng.standard_normal((8, 8)).astype(np.float32)]

    def inputs():
        x, w = cp.asarray(host[0]), cp.asarray(host[1])
        return x, w, w.astype(BF16), cp.asarray(np.array([3, 0, 2])), cp.zeros((4, 8), np.float32)

    eager = [a.get() for a in _project_calls(cp, kernel, *inputs())]
    s = _stream(cp)
    args = inputs()
    cp.cuda.Device().synchronize()
    graph, made = _capture(cp, s, _project_calls, cp, kernel, *args)
    assert any(n.startswith("cuBLAS gemmStridedBatchedEx") for n in graph.standin_nodes())
    assert args[-1].get(stream=s).tolist() == np.zeros((4, 8)).tolist()  # the accumulating GEMM did not run
    graph.launch(s)
    s.synchronize()
    for want, got in zip(eager, made):
        assert got.get().tobytes() == want.tobytes()


def test_the_shapes_only_mode_captures_and_launches(cp, monkeypatch):
    from cupy import _memory

    monkeypatch.setattr(_memory, "META", True)
    kernel = cp.RawKernel(KERNEL, "axpb")
    x, w = cp.empty((4, 8), np.float32), cp.empty((8, 8), np.float32)
    args = (x, w, w.astype(BF16), cp.empty(3, np.int64), cp.empty((4, 8), np.float32))
    s = _stream(cp)
    cp.cuda.Device().synchronize()
    graph, made = _capture(cp, s, _project_calls, cp, kernel, *args)
    graph.launch(s)
    s.synchronize()
    assert [a.shape for a in made] == [(4, 8), (4,), (4, 8), (4, 8), (3, 8), (4, 8), (4, 8), (4, 8), (2, 2, 8),
                                       (4, 8), (4,)]


@pytest.mark.parametrize("read", ["get", "float", "item", "asnumpy", "mask", "set", "asarray"])
def test_a_host_transfer_on_the_capturing_stream_raises_cupys_error_and_the_capture_stays_valid(cp, read):
    """memory.pyx:713 and :614 at v14.2.0: CuPy checks before calling CUDA, with a RuntimeError."""
    s = _stream(cp)
    a = cp.ones(4, dtype=np.float32)
    cp.cuda.Device().synchronize()
    reads = {"get": lambda: a.get(), "float": lambda: float(a[0]), "item": lambda: a[1].item(),
             "asnumpy": lambda: cp.asnumpy(a), "mask": lambda: a[a > 0],
             "set": lambda: a.set(np.zeros(4, np.float32)), "asarray": lambda: cp.asarray(np.zeros(2))}
    with s:
        s.begin_capture()
        b = a + 1
        with pytest.raises(RuntimeError, match="the current stream is capturing, so (D2H|H2D) transfers are disallowed"):
            reads[read]()
        assert s.is_capturing()
        graph = s.end_capture()
    graph.launch(s)
    s.synchronize()
    assert b.get().tolist() == [2.0] * 4
    assert a.get(stream=cp.cuda.Stream.null).tolist() == [1.0] * 4  # another stream may copy (relaxed mode)


@pytest.mark.parametrize("sync", ["stream", "query", "device", "event"])
def test_a_synchronize_during_capture_invalidates_it(cp, sync):
    """cudaStreamSynchronize/Query of the capturing stream, cudaDeviceSynchronize, cudaEventSynchronize of
    an event recorded in the capture: the runtime's error, and end_capture reports the invalidation."""
    from cupy.cuda import _queue
    from cupy.cuda.runtime import CUDARuntimeError

    s = _stream(cp)
    a = cp.ones(4, dtype=np.float32)
    syncs = _queue.host_syncs
    calls = {"stream": s.synchronize, "query": lambda: s.done, "device": cp.cuda.Device().synchronize,
             "event": lambda: s.record().synchronize()}
    status = "cudaErrorCapturedEvent" if sync == "event" else "cudaErrorStreamCaptureUnsupported"
    with s:
        s.begin_capture()
        a += 1
        with pytest.raises(CUDARuntimeError, match=f"^{status}: ") as err:
            calls[sync]()
        assert err.value.status == (907 if sync == "event" else 900)
        with pytest.raises(RuntimeError, match="an error has invalidated the capture sequence"):
            s.is_capturing()
        with pytest.raises(CUDARuntimeError, match="^cudaErrorStreamCaptureInvalidated: operation failed due to a "
                                                   "previous error during capture"):
            a *= 2  # more work on an invalidated capture
        with pytest.raises(CUDARuntimeError, match="cudaErrorStreamCaptureInvalidated"):
            s.end_capture()
    assert not s.is_capturing() and _queue.host_syncs == syncs
    s.synchronize()
    assert a.get().tolist() == [1.0] * 4


def test_the_legacy_stream_cannot_capture_nor_be_used_while_a_blocking_stream_captures(cp):
    from cupy.cuda.runtime import CUDARuntimeError

    with pytest.raises(RuntimeError, match=r"^cannot capture on the default \(legacy\) stream$"):
        cp.cuda.Stream.null.begin_capture()
    a = cp.ones(4, dtype=np.float32)
    quiet = _stream(cp)  # a non-blocking capture: the legacy stream runs as usual
    with quiet:
        quiet.begin_capture()
    a += 1
    quiet.end_capture()
    blocking = cp.cuda.Stream()
    cp.cuda.Device().synchronize()
    blocking.begin_capture()
    with pytest.raises(CUDARuntimeError, match="^cudaErrorStreamCaptureImplicit"):
        cp.cuda.Stream.null.is_capturing()  # a query: the capture stays valid
    assert blocking.is_capturing()
    with pytest.raises(CUDARuntimeError, match="^cudaErrorStreamCaptureImplicit"):
        a += 1  # work on the legacy stream
    with pytest.raises(CUDARuntimeError, match="cudaErrorStreamCaptureInvalidated"):
        blocking.end_capture()
    assert a.get().tolist() == [2.0] * 4


def test_other_streams_run_at_once_and_a_fork_must_be_joined(cp):
    from cupy.cuda.runtime import CUDARuntimeError

    s, other, side = _stream(cp), _stream(cp), _stream(cp)
    a, b, c = (cp.ones(4, dtype=np.float32) for _ in range(3))
    cp.cuda.Device().synchronize()
    with s:
        s.begin_capture()
        a += 1
        with other:
            b += 1  # not part of the capture: runs now
        side.wait_event(s.record())  # a fork: side joins the capture
        with side:
            c += a
        s.wait_event(side.record())  # joined back
        graph = s.end_capture()
    other.synchronize()
    assert b.get().tolist() == [2.0] * 4 and c.get(stream=s).tolist() == [1.0] * 4
    graph.launch(s)
    s.synchronize()
    assert a.get().tolist() == [2.0] * 4 and c.get().tolist() == [3.0] * 4
    with s:
        s.begin_capture()
        side.wait_event(s.record())
        with side:
            c += 1
        with pytest.raises(CUDARuntimeError, match="^cudaErrorStreamCaptureUnjoined"):
            s.end_capture()
    assert not side.is_capturing()


def test_a_race_between_branches_of_a_graph_is_reported_at_launch(cp):
    """A forked stream's work is a branch of the graph, ordered only by the graph's edges (the events):
    the origin reading what the branch writes before joining it is a race inside the graph."""
    from cupy.cuda._order import StreamOrderError

    s, side = _stream(cp), _stream(cp)
    a, c = cp.ones(4, dtype=np.float32), cp.ones(4, dtype=np.float32)
    cp.cuda.Device().synchronize()
    with s:
        s.begin_capture()
        side.wait_event(s.record())
        with side:
            c += 1
        a += c  # no edge from the branch yet
        s.wait_event(side.record())
        graph = s.end_capture()
    with pytest.raises(StreamOrderError, match=r"ndarray.__iadd__ on stream .* reads .* written by ndarray.__iadd__"):
        graph.launch(s)


def test_launch_accesses_are_the_launch_streams_and_count_no_host_sync(cp):
    from cupy.cuda import _queue
    from cupy.cuda._order import StreamOrderError

    s, launch = _stream(cp), _stream(cp)
    a = cp.ones(4, dtype=np.float32)
    cp.cuda.Device().synchronize()
    graph, b = _capture(cp, s, lambda: a * 2)
    syncs = _queue.host_syncs
    graph.launch(launch)
    assert _queue.host_syncs == syncs
    with pytest.raises(StreamOrderError, match=f"written by ndarray.__mul__ on stream {launch.ptr:#x}"):
        b + 1  # the current (legacy) stream has not waited for the launch stream
    cp.cuda.get_current_stream().wait_event(launch.record())
    assert (b + 1).get().tolist() == [3.0] * 4
    a.fill(5)  # the legacy stream writes a: a launch on `launch` must wait for it
    with pytest.raises(StreamOrderError, match="reads .* written by ndarray.fill on stream 0x0"):
        graph.launch(launch)


def test_the_pool_during_capture(cp):
    """CuPy's pool during a capture: chunks of the capturing stream's arena; a block the program frees goes
    back to that arena at once, where later captured work reuses it; relaxed mode (CuPy's default) allows
    a new allocation (cudaMalloc), the global mode refuses it and invalidates the capture. A launch after
    the program freed an array the graph uses and the pool handed its bytes to another array raises: on a
    GPU the launch would overwrite that array."""
    from cupy.cuda import runtime
    from cupy.cuda.graph import GraphMemoryError
    from cupy.cuda.runtime import CUDARuntimeError

    pool = cp.get_default_memory_pool()
    s = _stream(cp)
    a = cp.ones(1000, dtype=np.float32)
    cp.cuda.Device().synchronize()
    used = pool.used_bytes()
    with s:
        s.begin_capture()
        t = a * 2
        chunk, ptr = t._mem.chunk, t.data.ptr
        del t  # freed: back in the stream's arena now
        assert pool.used_bytes() == used and chunk.free and chunk.arena is pool._arenas[s.ptr]
        u = a + 1  # the same chunk again, within the capture
        graph = s.end_capture()
    assert u.data.ptr == ptr and u._mem.chunk is chunk
    graph.launch(s)
    s.synchronize()
    assert u.get().tolist() == [2.0] * 1000
    del u  # the graph's output dropped: its block goes back too
    with s:
        v = cp.zeros(1000, dtype=np.float32)
    assert v.data.ptr == ptr
    with pytest.raises(GraphMemoryError, match=r"ndarray.__mul__ .* writes a float32 array of shape \(1000,\), whose "
                                               "bytes the pool has since handed to another array"):
        graph.launch(s)
    del v
    graph.launch(s)  # nothing holds the bytes now: the launch writes the free block, as on a GPU
    with s:
        s.begin_capture(runtime.streamCaptureModeGlobal)
        w = a * 3  # the arena's free chunk: no cudaMalloc
        with pytest.raises(CUDARuntimeError, match="^cudaErrorStreamCaptureUnsupported"):
            a * 4  # a new allocation
        with pytest.raises(CUDARuntimeError, match="cudaErrorStreamCaptureInvalidated"):
            s.end_capture()
    assert w._mem.chunk is chunk


def test_an_nccl_operation_is_recorded_and_queued_on_the_launch_stream(cp):
    from cupy.cuda import nccl

    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    s = _stream(cp)
    a = cp.ones(16, dtype=np.float32)
    cp.cuda.Device().synchronize()

    def step():
        cp.multiply(a, 2, out=a)
        comm.allReduce(a.data.ptr, a.data.ptr, 16, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, s.ptr)
        cp.add(a, 1, out=a)

    graph, _ = _capture(cp, s, step)
    assert comm._issued == [] and graph.standin_nodes()[1] == "NCCL allReduce of 16 x float32"
    graph.launch(s)
    graph.launch(s)
    s.synchronize()
    assert len(comm._issued) == 2 and a.get().tolist() == [7.0] * 16
    comm.destroy()


def test_the_cudnn_attention_is_captured_and_launches_to_the_eager_bits(cp, monkeypatch):
    from boostmpi.gpu import attention
    from tests.support.gpu_setup import use_cudnn_frontend

    cudnn, forget = use_cudnn_frontend(monkeypatch)
    try:
        shape = B, T, H, Hkv, Dh = (1, 8, 2, 1, 64)
        rng = np.random.default_rng(0)
        host = [rng.standard_normal(x).astype(BF16) for x in [(B, T, H, Dh), (B, T, Hkv, Dh), (B, T, Hkv, Dh),
                                                              (B, T, H, Dh)]]
        backend = attention.make("cudnn", "bfloat16", shape)

        def step(q, k, v, do):
            o, ctx = backend.forward(q, k, v)
            return [o, *backend.backward(do, ctx)]

        eager = [x.get() for x in step(*(cp.asarray(h) for h in host))]
        s = _stream(cp)
        args = [cp.asarray(h) for h in host]
        cp.cuda.Device().synchronize()
        graph, made = _capture(cp, s, step, *args)
        assert [n.split(" (")[0] for n in graph.standin_nodes() if n.startswith("cuDNN")] == \
            ["cuDNN sdpa", "cuDNN sdpa_backward"]
        assert np.isnan(made[0].get(stream=s).astype(np.float32)).all()  # the capture computed nothing
        graph.launch(s)
        s.synchronize()
        for want, got in zip(eager, made):
            assert got.get().tobytes() == want.tobytes()
    finally:
        forget()


def test_on_the_mi250x_model_capture_follows_cupys_hip_build():
    """CuPy 14.2.0 on ROCm calls hipStreamBeginCapture (cupy_hip_runtime.h:430, HIP >= 4.3), skips its own
    host-transfer checks (so the runtime's error comes back, and invalidates), and its hipGraphUpload shim
    answers hipErrorUnknown (cupy_hip_runtime.h:583)."""
    code = """
import numpy as np, cupy as cp
from cupy.cuda.runtime import CUDARuntimeError
s = cp.cuda.Stream(non_blocking=True)
a = cp.ones(4, dtype=np.float32)
cp.cuda.Device().synchronize()
with s:
    s.begin_capture()
    a += 1
    try:
        a.get()
    except CUDARuntimeError as e:
        print(e)
    try:
        s.end_capture()
    except CUDARuntimeError as e:
        print(e)
    s.begin_capture()
    a += 1
    g = s.end_capture()
g.launch(s)
s.synchronize()
print(a.get().tolist())
try:
    g.upload(s)
except CUDARuntimeError as e:
    print(e)
"""
    env = dict(os.environ, BOOSTMPI_STANDIN_GPU="mi250x")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "hipErrorStreamCaptureUnsupported: operation not permitted when stream is capturing",
        "hipErrorStreamCaptureInvalidated: operation failed due to a previous error during capture",
        "[2.0, 2.0, 2.0, 2.0]", "hipErrorUnknown: unknown error"]


@pytest.mark.slow  # a second case of what the default run covers (CI time): `-m slow` runs it
def test_a_training_steps_device_work_captures_and_launches_to_the_eager_bits(cp):
    """The engine's bfloat16 step on the tiny cola model, its micro-batches already on the device: every call up to
    the step's one host read (the loss, which CuPy refuses during the capture, leaving it valid) is
    captured, and a launch writes the eager step's gradients bit for bit, twice."""
    from boostmpi.parallel.engine import Engine
    from tests.support.gpu_steps import batches, config

    eng = Engine(config("cola", "gpu", "bfloat16"), None, local_rank=0)
    micro = [(cp.asarray(x), cp.asarray(y)) for x, y in batches()]
    eng.forward_backward(micro)
    want = eng.grads.data.get()
    eng.grads.data.fill(np.nan)
    s = _stream(cp)
    cp.cuda.Device().synchronize()
    with s:
        s.begin_capture()
        with pytest.raises(RuntimeError, match="capturing, so D2H transfers are disallowed"):
            eng.forward_backward(micro)
        graph = s.end_capture()
    assert np.isnan(eng.grads.data.get(stream=s).astype(np.float32)).all()
    for _ in range(2):
        graph.launch(s)
        s.synchronize()
        assert eng.grads.data.get().tobytes() == want.tobytes()


DP2_STEP = """
import numpy as np, cupy as cp
from mpi4py import MPI
from boostmpi.parallel.engine import Engine
from tests.support.gpu_steps import batches, config
for overlap in (True, False):
    eng = Engine(config("cola", "gpu", "bfloat16", parallel=dict(dp=2, overlap=overlap)), MPI.COMM_WORLD,
                 local_rank=MPI.COMM_WORLD.Get_rank())
    micro = [tuple(cp.asarray(m) for m in batches()[eng.grid.coords.dp])]
    eng.forward_backward(micro)
    want = eng.grads.data.get()
    eng.grads.data.fill(np.nan)
    s = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    with s:
        s.begin_capture()
        try:
            eng.forward_backward(micro)
        except RuntimeError as e:
            assert "D2H transfers are disallowed" in str(e), e
        graph = s.end_capture()
    assert sum(n.startswith("NCCL allReduce") for n in graph.standin_nodes()) > 0
    for _ in range(2):
        graph.launch(s)
        s.synchronize()
        assert eng.grads.data.get().tobytes() == want.tobytes(), overlap
print("ok")
"""


@pytest.mark.slow
def test_a_dp2_step_with_side_stream_all_reduces_captures_and_launches_to_the_eager_bits(tmp_path):
    """Two ranks, data parallel with and without overlap: the side-stream all-reduces join the capture
    through the engine's events (a fork joined back), and each launch gives the eager gradients."""
    from tests.support.mpi_helpers import MPIEXEC

    script = tmp_path / "dp2_capture.py"
    script.write_text(DP2_STEP)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(script)], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("ok") == 2
