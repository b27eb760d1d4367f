"""The attention backends' seam (boostmpi/gpu/attention.py) and the cuDNN backend (attention_cudnn.py).

On the CuPy stand-in the cuDNN frontend is its stand-in (testing/cudnn_standin/cudnn: 1.28's calls and
keywords, refusals, the graph's declared dims and strides read over device memory, NumPy arithmetic);
on a real GPU it is the installed nvidia-cudnn-frontend, and the tests that read the stand-in's records
(graph builds, recorded operands) say so and skip. References: the NumPy attention of
boostmpi/model/layers.py in float64. bfloat16 tolerance: 2e-2 of each output's largest magnitude
(inputs rounded to bf16, outputs stored as bf16: 3e-3 to 8e-3 on these shapes on the stand-in).
"""

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.gpu_setup import GPU, use_cudnn_frontend
from tests.integration.gpu.test_gpu import assert_step_close, cpu_step

pytestmark = pytest.mark.gpu
TOL = 2e-2


@pytest.fixture
def cudnn(monkeypatch):
    module, forget = use_cudnn_frontend(monkeypatch)
    yield module
    forget()


def _standin_records(cudnn):
    if not getattr(cudnn, "STANDIN", False):
        pytest.skip("reads the records of the frontend's stand-in (a real GPU runs the real frontend)")


def _inputs(B, T, H, Hkv, Dh, seed=0):
    rng = np.random.default_rng(seed)
    import ml_dtypes

    shapes = ((B, T, H, Dh), (B, T, Hkv, Dh), (B, T, Hkv, Dh), (B, T, H, Dh))
    # rounded to bf16 first, so the float64 reference sees exactly what the GPU reads
    return [rng.standard_normal(s).astype(ml_dtypes.bfloat16).astype(np.float64) for s in shapes]


def _to_gpu(a):
    import cupy
    import ml_dtypes

    return cupy.asarray(a.astype(ml_dtypes.bfloat16))


def _rel(got, want):
    import cupy

    return np.abs(cupy.asnumpy(got).astype(np.float64).reshape(want.shape) - want).max() / np.abs(want).max()


def _run(backend, shape, seed=0, alloc=None):
    """(errors of o, dq, dk, dv against the float64 NumPy attention, the backend's context)."""
    from boostmpi.model import layers

    B, T, H, Hkv, Dh = shape
    q, k, v, do = _inputs(*shape, seed=seed)
    o, ctx = backend.forward(_to_gpu(q), _to_gpu(k), _to_gpu(v), alloc=alloc)
    grads = backend.backward(_to_gpu(do), ctx)
    ref_o, cache = layers.attention_forward(q, k, v)
    ref = layers.attention_backward(do.reshape(B, T, -1), cache)
    return [_rel(o, ref_o)] + [_rel(g, r) for g, r in zip(grads, ref)], ctx


SHAPES = [(2, 8, 4, 2, 64), (1, 8, 2, 1, 128), (1, 5, 3, 3, 64)]


@pytest.mark.parametrize("shape", SHAPES, ids=["gqa-d64", "gqa-d128", "mha-odd-T"])
def test_cudnn_forward_backward_equal_the_numpy_attention(cudnn, shape):
    from boostmpi.gpu import attention

    import cupy

    made = []  # the statistic comes from `alloc` when given (recompute = "lowrank" passes the Tape's)
    errors, ctx = _run(attention.make("cudnn", "bfloat16", shape), shape,
                       alloc=lambda s, dtype: made.append((s, np.dtype(dtype))) or cupy.empty(s, dtype=dtype))
    assert max(errors) <= TOL, f"o, dq, dk, dv errors {errors}"
    B, T, H, Hkv, Dh = shape
    assert made == [((B, H, T, 1), np.dtype(np.float32))]
    assert ctx.stats.shape == (B, H, T, 1) and ctx.stats.dtype == np.float32
    assert ctx.row_max is ctx.stats and ctx.row_sum is None  # what recompute = "lowrank" keeps


def test_cudnn_graphs_are_built_once_per_shape_and_read_kv_unrepeated(cudnn):
    """Three forward/backward pairs of one shape: one forward and one backward graph built (and timed);
    every execute declares K and V with their Hkv heads in BHSD order over BSHD memory, at the bytes of
    [B, T, Hkv, Dh] bf16, on the backward's deterministic algorithm."""
    _standin_records(cudnn)
    from boostmpi.gpu import attention, attention_cudnn

    shape = B, T, H, Hkv, Dh = (2, 8, 4, 2, 64)
    backend = attention.make("cudnn", "bfloat16", shape)
    for seed in range(3):
        assert max(_run(backend, shape, seed)[0]) <= TOL
    assert [e["op"] for e in cudnn.executions] == ["sdpa", "sdpa_backward"] * 3
    for e in cudnn.executions:
        for name in ("k", "v"):
            assert e["operands"][name] == ((B, Hkv, T, Dh), (T * Hkv * Dh, Dh, Hkv * Dh, 1), B * T * Hkv * Dh * 2)
        assert e["operands"]["q"][:2] == ((B, H, T, Dh), (T * H * Dh, Dh, H * Dh, 1))
    assert sum(cudnn.builds.values()) == 2 and sorted(cudnn.builds) == ["boostmpi_attention_backward",
                                                                        "boostmpi_attention_forward"]
    assert len(attention_cudnn.build_seconds) == 2
    assert cudnn.executions[1]["params"]["use_deterministic_algorithm"] is True


def test_cudnn_nondeterministic_backward_is_its_own_graph(cudnn):
    """deterministic=False (train.deterministic = false) builds the backward without cuDNN's deterministic
    algorithm, in a graph of its own next to the deterministic one; the forward graph is shared."""
    _standin_records(cudnn)
    from boostmpi.gpu import attention

    shape = (1, 8, 2, 2, 64)
    fast = attention.make("cudnn", "bfloat16", shape, deterministic=False)
    exact = attention.make("cudnn", "bfloat16", shape)
    assert (fast.deterministic, exact.deterministic) == (False, True)
    for backend in (fast, exact):
        assert max(_run(backend, shape, 0)[0]) <= TOL
    assert [e["params"]["use_deterministic_algorithm"] for e in cudnn.executions if e["op"] == "sdpa_backward"] == \
        [False, True]
    assert cudnn.builds["boostmpi_attention_forward"] == 1 and cudnn.builds["boostmpi_attention_backward"] == 2


def test_cudnn_runs_on_cupys_current_stream_and_the_standin_refuses_another(cudnn):
    _standin_records(cudnn)
    import cupy

    from boostmpi.gpu import attention

    shape = (1, 8, 2, 2, 64)
    backend = attention.make("cudnn", "bfloat16", shape)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        assert max(_run(backend, shape)[0]) <= TOL
        stream.synchronize()
    assert {e["stream"] for e in cudnn.executions} == {stream.ptr}
    q, k, v, _ = (_to_gpu(a) for a in _inputs(*shape))
    cudnn.set_stream(backend.handle, 0)  # the handle left on another stream than CuPy's current one
    with stream:
        built = backend._graph("forward", *shape)
        with pytest.raises(RuntimeError, match="handle on stream"):
            built.graph.execute({built.tensors["q"]: q.data.ptr}, cupy.empty(built.workspace, dtype=np.uint8),
                                handle=backend.handle)


def test_the_frontend_standin_refuses_what_release_1_28_refuses(cudnn):
    _standin_records(cudnn)
    import cupy

    from boostmpi.gpu import attention, attention_cudnn

    assert "multiples of 8" in attention_cudnn.shape_problem("bfloat16", (1, 8, 2, 2, 12))
    assert "up to 128" in attention_cudnn.shape_problem("bfloat16", (1, 8, 2, 2, 256))
    assert "not a multiple" in attention_cudnn.shape_problem("bfloat16", (1, 8, 3, 2, 64))
    with pytest.raises(attention.BackendUnavailable, match="bfloat16 only"):
        attention.make("cudnn", "float32")
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT, handle=attention_cudnn._handles[0])
    q = graph.tensor(dim=[1, 2, 8, 64], stride=[1024, 64, 128, 1])
    graph.sdpa(q, q, q, generate_stats=True, use_causal_mask=True)[0].set_output(True)
    with pytest.raises(cudnn.cudnnGraphNotSupportedError, match="FLOAT"):
        graph.validate()
    with pytest.raises(TypeError, match="not a keyword"):  # 1.28's Python layer would take it silently
        graph.sdpa_backward(q, q, q, q, q, q, causal=True)
    backend = attention.make("cudnn", "bfloat16")
    built = backend._graph("forward", 1, 8, 2, 2, 64)
    arrays = {built.tensors[n]: cupy.zeros(1024, dtype=np.float32).data.ptr for n in ("q", "k", "v", "o", "stats")}
    cudnn.set_stream(backend.handle, cupy.cuda.get_current_stream().ptr)
    with pytest.raises(RuntimeError, match="workspace"):
        built.graph.execute(arrays, cupy.empty(built.workspace - 1, dtype=np.uint8), handle=backend.handle)


def test_auto_takes_cudnn_where_a_graph_of_the_shape_passes_check_support(cudnn):
    from boostmpi.gpu import attention

    out = io.StringIO()
    assert attention.select("auto", "bfloat16", shape=(2, 16, 4, 2, 16), out=out).name == "cudnn"
    assert out.getvalue() == ""
    assert attention.select("auto", "bfloat16", shape=(2, 16, 4, 2, 12), out=out).name != "cudnn"  # check_support fails


def test_auto_without_the_frontend_falls_to_own_in_one_line(monkeypatch):
    from boostmpi.gpu import attention, attention_cudnn

    monkeypatch.setitem(sys.modules, "cudnn", None)  # `import cudnn` raises ImportError
    monkeypatch.setitem(sys.modules, "boostmpi.gpu.attention_torch", None)
    monkeypatch.setattr(attention_cudnn, "_loaded", [("stand-in", None)])
    out = io.StringIO()
    assert attention.select("auto", "bfloat16", shape=(2, 16, 4, 2, 16), out=out).name == "own"
    line = out.getvalue()
    assert line.count("\n") == 1 and "67.0 / 132.1 ms" in line and "boostmpi[cudnn]" in line
    assert "nvidia-cudnn-frontend is not installed" in line and "torch attention backend unavailable" in line
    with pytest.raises(attention.BackendUnavailable, match="^train.attention = cudnn cannot run here: nvidia-cudnn"):
        attention.select("cudnn", "bfloat16")


def test_a_missing_libcudnn_is_one_line_listing_every_place_tried(tmp_path):
    import ctypes

    try:  # the last candidate is the plain name, which the system's search path may resolve
        ctypes.CDLL("libcudnn.so.9")
        pytest.skip("libcudnn.so.9 loads from this machine's library search path (a GPU node with cuDNN)")
    except OSError:
        pass
    code = ("from boostmpi.gpu import attention_cudnn as c\n"
            f"try: c.preload(environ={{'LD_LIBRARY_PATH': '/nowhere/a:/nowhere/b'}}, purelib={str(tmp_path)!r})\n"
            "except Exception as e: print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert out.count("\n") == 1 and out.startswith("BackendUnavailable libcudnn.so.9 not found (tried /nowhere/a/libcudnn.so.9, "
                                                   f"/nowhere/b/libcudnn.so.9, {tmp_path}/nvidia/cudnn/lib/libcudnn.so.9, "
                                                   f"{tmp_path}/nvidia/cu13/lib/libcudnn.so.9, libcudnn.so.9)"), out


def test_ranks_that_chose_different_backends_are_refused_in_one_line(monkeypatch):
    from boostmpi.errors import UserError
    from boostmpi.gpu import attention
    from boostmpi.parallel import comm, startup
    from tests.support.gpu_steps import config

    class TwoRanks:  # rank 0 of a world whose rank 1 resolved "auto" to another backend
        def Get_rank(self):
            return 0

        def allgather(self, obj):
            return [obj, None if obj is None else "torch"]

    monkeypatch.setattr(comm.WATCHDOG, "call", lambda axis, call, fn: fn())
    monkeypatch.setattr(attention, "_current", attention.OwnAttention())
    with pytest.raises(UserError, match=r"^train.attention = own chose different backends on the ranks \(rank 0 own, "
                                        r"rank 1 torch\)"):
        startup.choose_attention(config("cola", "gpu", "bfloat16"), TwoRanks())


def test_train_deterministic_reaches_the_backend_start_up_chooses(cudnn, monkeypatch):
    """train.deterministic = false: the cuDNN backend chosen at start-up runs its non-deterministic
    backward; the default keeps the deterministic one."""
    from boostmpi.gpu import attention
    from boostmpi.parallel import comm, startup
    from tests.support.gpu_steps import config

    monkeypatch.setattr(comm.WATCHDOG, "call", lambda axis, call, fn: fn())
    for setting, expected in ((False, False), (True, True)):
        monkeypatch.setattr(attention, "_current", attention.OwnAttention())
        cfg = config("cola", "gpu", "bfloat16", train=dict(attention="cudnn", deterministic=setting))
        assert startup.choose_attention(cfg, None).deterministic is expected
        assert attention.current().deterministic is expected


# svd with lowrank in the default run (the backend's forward run again by the recompute, its statistic from
# the Tape's alloc); the other two archs and recompute modes with the slow tests
@pytest.mark.parametrize("arch,recompute", [pytest.param("cola", "none", marks=pytest.mark.slow), ("svd", "lowrank"),
                                            pytest.param("full", "selective", marks=pytest.mark.slow)])
def test_gpu_step_with_cudnn_attention_equals_the_cpu_path(cudnn, arch, recompute):
    from boostmpi.gpu import attention
    from tests.support.gpu_steps import step

    got = step(arch, "gpu", "bfloat16", train=dict(recompute=recompute, attention="cudnn"))
    assert attention.current().name == "cudnn"
    if getattr(cudnn, "STANDIN", False):
        assert {e["op"] for e in cudnn.executions} == {"sdpa", "sdpa_backward"}
    assert_step_close(got, cpu_step(arch), "bfloat16", f"{arch} recompute={recompute} train.attention=cudnn")


def test_the_cpu_path_accepts_and_ignores_train_attention():
    from boostmpi.gpu import attention
    from tests.support.gpu_steps import step

    before = attention.current()
    loss, _ = step("cola", "cpu", "float32", train=dict(attention="cudnn"))
    assert np.isfinite(loss) and attention.current() is before


def test_tp2_steps_with_cudnn_attention_equal_the_single_rank_step(cudnn, tmp_path):
    """`mpiexec -n 2`, tensor parallelism 2 (each rank's graphs of its own heads), train.attention = cudnn
    on both ranks: cola, svd and full equal the single-rank cudnn step within test_gpu's tolerances."""
    from tests.support.gpu_steps import step

    if not GPU.standin:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 2:
            pytest.skip("two ranks need two GPUs (one GPU per rank)")

    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    assert mpiexec, "mpiexec not found (pip install mpich)"
    out = tmp_path / "tp2.npz"
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, str(Path(__file__).resolve().parents[2] / "support" / "gpu_steps.py"), str(out),
                           "tp2", "bfloat16", "cudnn"], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, f"mpiexec -n 2 failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    with np.load(out) as data:
        results = {k: data[k] for k in data.files}
    for arch in ("cola", "svd", "full"):
        prefix = f"tp2/{arch}/bfloat16/"
        grads = {k[len(prefix) + 5:]: v for k, v in results.items() if k.startswith(prefix + "grad/")}
        want = step(arch, "gpu", "bfloat16", train=dict(attention="cudnn"))
        assert_step_close((float(results[prefix + "loss"]), grads), want, "bfloat16", f"tp2 {arch} cudnn")


def test_train_attention_takes_the_four_settings_and_refuses_others_in_one_line():
    from boostmpi.config import config_from_dict
    from boostmpi.errors import ConfigError

    for name in ("auto", "cudnn", "torch", "own"):
        assert config_from_dict({"train": {"attention": name}}).train.attention == name
    assert config_from_dict({}).train.attention == "auto"
    with pytest.raises(ConfigError, match=r"^train.attention must be one of auto, cudnn, torch, own, got 'flash'$"):
        config_from_dict({"train": {"attention": "flash"}})
