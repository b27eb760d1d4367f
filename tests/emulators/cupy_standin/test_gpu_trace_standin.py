"""What the GPU-step trace reads from the CuPy stand-in, in-process.

- `cublas.called` sees each GEMM with the types CuPy 14.2 gives cuBLAS (its own `matmul`: `gemmEx`
  with CUBLAS_COMPUTE_32F at most 2-D, `gemmStridedBatchedEx` with the legacy float32 compute type
  batched; the binding's calls as made), and `cublas.tensor_core_bf16` judges them by the cuBLAS
  guide's type table: bf16 inputs with float32 compute only.
- The shapes-only mode: results of the right shape and dtype without values, host reads of the
  stated value, read-only memory (a write that the mode missed fails), the pool's high-water marks
  and the host-synchronisation count.
"""

import numpy as np
import pytest

from tests.support.gpu_setup import GPU

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not GPU.standin, reason="checks the CuPy stand-in; a real GPU is in use")]

BF16 = np.dtype(pytest.importorskip("ml_dtypes").bfloat16)


@pytest.fixture
def cp():
    """The stand-in (the module conftest.py put first on sys.path)."""
    import cupy

    return cupy


class _Seen(list):
    """The GEMMs `cublas.called` saw, with `beta_zero`: for each, whether it only wrote C."""

    def __init__(self):
        super().__init__()
        self.beta_zero = []

    def __call__(self, *args, beta_zero=True):
        self.append(args)
        self.beta_zero.append(beta_zero)


@pytest.fixture
def gemms(cp, monkeypatch):
    """Every GEMM the cuBLAS model sees during the test: (api, batch, m, n, k, Atype, Btype, Ctype, compute)."""
    from cupy.cuda import cublas

    seen = _Seen()
    monkeypatch.setattr(cublas, "called", seen)
    return seen


@pytest.fixture
def meta(cp, monkeypatch):
    from cupy import _memory

    monkeypatch.setattr(_memory, "META", True)
    yield cp
    cp.cuda.Device().synchronize()


def test_tensor_core_judgement_follows_the_type_table():
    from cupy.cuda import cublas, runtime

    bf, f32 = runtime.CUDA_R_16BF, runtime.CUDA_R_32F
    assert cublas.tensor_core_bf16(bf, bf, bf, cublas.CUBLAS_COMPUTE_32F)
    assert cublas.tensor_core_bf16(bf, bf, f32, cublas.CUBLAS_COMPUTE_32F)  # fp32 output: a row of the table
    assert cublas.tensor_core_bf16(bf, bf, bf, runtime.CUDA_R_32F)  # the legacy compute type CuPy passes batched
    assert not cublas.tensor_core_bf16(f32, f32, f32, cublas.CUBLAS_COMPUTE_32F)  # float32: no tensor cores
    assert not cublas.tensor_core_bf16(f32, f32, f32, cublas.CUBLAS_COMPUTE_32F_FAST_16BF)  # fp32 in memory
    assert not cublas.tensor_core_bf16(bf, bf, bf, cublas.CUBLAS_COMPUTE_32F_PEDANTIC)
    assert not cublas.tensor_core_bf16(bf, f32, bf, cublas.CUBLAS_COMPUTE_32F)  # A and B differ: not in the table


def test_cupy_matmul_reports_the_gemm_cupy_makes(cp, gemms):
    from cupy.cuda import cublas, runtime

    a, b = cp.ones((5, 3), dtype=BF16), cp.ones((3, 4), dtype=BF16)
    cp.matmul(a, b)
    cp.matmul(a.astype(np.float32), b.astype(np.float32))
    cp.matmul(cp.ones((2, 5, 3), dtype=np.float32), cp.ones((2, 3, 4), dtype=np.float32))
    bf, f32 = runtime.CUDA_R_16BF, runtime.CUDA_R_32F
    # cuBLAS is column-major: the row-major 5 x 4 product is its 4 x 5 one
    assert gemms == [("gemmEx", 1, 4, 5, 3, bf, bf, bf, cublas.CUBLAS_COMPUTE_32F),
                     ("gemmEx", 1, 4, 5, 3, f32, f32, f32, cublas.CUBLAS_COMPUTE_32F),
                     ("gemmStridedBatchedEx", 2, 4, 5, 3, f32, f32, f32, f32)]
    assert [cublas.tensor_core_bf16(*g[5:]) for g in gemms] == [True, False, False]
    assert gemms.beta_zero == [True, True, True]  # a new product: C only written


def test_the_engine_blas_wrapper_reports_bf16_on_tensor_cores(cp, gemms):
    from cupy.cuda import cublas

    from boostmpi.gpu import blas

    blas.matmul(cp.ones((2, 5, 3), dtype=BF16), cp.ones((2, 3, 4), dtype=BF16))
    (api, batch, *_, a_type, b_type, c_type, compute), = gemms
    assert (api, batch) == ("gemmStridedBatchedEx", 2) and cublas.tensor_core_bf16(a_type, b_type, c_type, compute)


def test_an_accumulating_gemm_reports_that_it_reads_c(cp, gemms):
    """beta = 1 (a weight gradient added into `out`) reads C as well as writing it: the hook says so,
    which the trace counts as C's bytes twice (bench/gpu_trace.py); beta = 0 only writes C."""
    from boostmpi.gpu import blas

    a, b = cp.ones((5, 3), dtype=BF16), cp.ones((3, 4), dtype=BF16)
    out = cp.zeros((5, 4), dtype=np.float32)
    blas.matmul(a, b, out=out)
    blas.matmul(a, b, out=out, accumulate=True)
    assert [g[0] for g in gemms] == ["gemmEx", "gemmEx"] and gemms.beta_zero == [True, False]
    assert float(out.sum()) == 2 * 5 * 4 * 3.0


def test_mutant_type_table_without_bf16_changes_the_judgement(monkeypatch):
    """The judgement reads the type table: without its bf16 row (the mutant) a bf16 GEMM is not counted."""
    from cupy.cuda import cublas, runtime

    bf = runtime.CUDA_R_16BF
    table = dict(cublas._SUPPORTED)
    table[cublas.CUBLAS_COMPUTE_32F] = table[cublas.CUBLAS_COMPUTE_32F] - {(bf, bf)}
    monkeypatch.setattr(cublas, "_SUPPORTED", table)
    assert not cublas.tensor_core_bf16(bf, bf, bf, cublas.CUBLAS_COMPUTE_32F)


def test_meta_arrays_have_shapes_and_no_values(meta):
    from cupy import _memory

    a = meta.empty((4, 8, 16), dtype=BF16)
    b = (a * 2 + 1).astype(np.float32)
    assert b.shape == (4, 8, 16) and b.dtype == np.float32
    assert b.sum(axis=-1, keepdims=True).shape == (4, 8, 1)
    assert meta.matmul(b, b.transpose(0, 2, 1)).shape == (4, 8, 8)  # (batched bf16: CuPy 14.2 refuses)
    assert a[:, meta.arange(3)].shape == (4, 3, 16)  # a gather (index arrays count as zeros)
    assert a[:, (meta.arange(8) > 3)].shape == (4, 8, 16)  # a mask selects every element
    assert meta.concatenate([a, a], axis=1).shape == (4, 16, 16)
    assert float(b.sum()) == _memory.META_HOST_VALUE and b.get().shape == b.shape
    assert np.all(b.get() == 1.0)
    with pytest.raises(ValueError, match="read-only"):
        b._a[...] = 0  # nothing may write a meta array's memory


def test_pool_high_water_marks_and_host_syncs(meta):
    from cupy.cuda import _queue

    pool = meta.get_default_memory_pool()
    pool.standin_reset_peaks()
    before = pool.used_bytes()
    a = meta.empty(1000, dtype=np.float32)  # 4000 bytes, rounded to 4096
    b = meta.empty(300, dtype=np.float32)  # 1200 -> 1536
    del a
    peaks = pool.standin_peaks()
    assert peaks["largest"] == 4096 and peaks["used"] == before + 4096 + 1536 and peaks["mallocs"] == 2
    syncs = _queue.host_syncs
    float(b.sum())
    b.get()
    assert _queue.host_syncs == syncs + 2  # each copy to the host synchronizes its stream


def test_named_ranges_nest_and_the_engine_names_its_layers(cp, monkeypatch):
    """time_range pushes and pops NVTX ranges; one GPU step names each layer's forward and backward.
    The mutant (the engine without its ranges) leaves the profile without them."""
    from cupy.cuda import nvtx
    from cupyx.profiler import time_range

    from boostmpi.config import config_from_dict
    from boostmpi.gpu import ranges
    from boostmpi.parallel import engine as engine_module

    monkeypatch.setattr(nvtx, "events", [])
    with time_range("outer"):
        with ranges.named_range(cp, "inner"):
            pass
    with ranges.named_range(np, "cpu"):  # nothing on the CPU path
        pass
    assert nvtx.events == [("push", "outer"), ("push", "inner"), ("pop", "inner"), ("pop", "outer")]

    cfg = config_from_dict({"model": {"arch": "cola", "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64,
                                      "rank": 8, "vocab_size": 64, "seq_len": 8},
                            "train": {"device": "gpu", "dtype": "float32", "micro_batch_size": 2}})
    batch = [(np.zeros((2, 8), np.int64), np.ones((2, 8), np.int64))]

    def named(run):
        nvtx.events = []
        run.forward_backward(batch)
        return [name for kind, name in nvtx.events if kind == "push"]

    assert named(engine_module.Engine(cfg)) == ["layer 0 forward", "layer 1 forward", "layer 1 backward",
                                                "layer 0 backward"]
    from contextlib import nullcontext

    monkeypatch.setattr(engine_module, "named_range", lambda xp, name: nullcontext())
    assert named(engine_module.Engine(cfg)) == []


def _step_syncs(cfg, batch):
    from cupy.cuda import _queue

    from boostmpi.parallel.engine import Engine

    eng = Engine(cfg)
    before = _queue.host_syncs
    loss = eng.forward_backward(batch)
    return _queue.host_syncs - before, loss


def test_a_step_of_several_micro_batches_reads_the_device_once(cp, monkeypatch):
    """The loss of each micro-batch stays on the device: a step of 4 micro-batches synchronises the
    host once (loss and gradient norm together), and its loss is the mean of the four. The mutant
    (the head reading its loss to the host per micro-batch, as it once did) synchronises 5 times."""
    from boostmpi.config import config_from_dict
    from boostmpi.parallel import vocab_parallel

    cfg = config_from_dict({"model": {"arch": "cola", "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64,
                                      "rank": 8, "vocab_size": 64, "seq_len": 8},
                            "train": {"device": "gpu", "dtype": "float32", "micro_batch_size": 2, "grad_accum": 4}})
    rng = np.random.default_rng(0)
    batch = [(rng.integers(0, 64, (2, 8)), rng.integers(0, 64, (2, 8))) for _ in range(4)]
    syncs, loss = _step_syncs(cfg, batch)
    assert syncs == 1
    assert np.isfinite(loss) and abs(loss - np.log(64)) < 1.0  # about log V at initialisation
    monkeypatch.setattr(vocab_parallel, "mean_loss", lambda losses: float(losses.mean()))
    mutant_syncs, mutant_loss = _step_syncs(cfg, batch)
    assert mutant_syncs == 5 and mutant_syncs > 2
    assert mutant_loss == pytest.approx(loss, rel=1e-6)


def test_grouped_b_factors_multiply_where_they_lie(cp, monkeypatch):
    """btp's B GEMMs: k and v (and gate and up), whose factors lie one after another in the flat
    buffer, run as one strided-batched GEMM over their column blocks of Zs and the factors in place:
    two GEMMs for q/k/v (grouped-query: q is wider), no stacked copies, the products of one GEMM
    each. The mutant (the flat
    buffer finding no stacked view) makes three."""
    from boostmpi.config import config_from_dict
    from boostmpi.gpu import blas
    from boostmpi.model.params import FlatBuffer
    from boostmpi.parallel.engine import Engine

    cfg = config_from_dict({"model": {"arch": "cola", "d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1,
                                      "d_ff": 64, "rank": 8, "vocab_size": 64, "seq_len": 8},
                            "parallel": {"grouped": True},
                            "train": {"device": "gpu", "dtype": "float32", "micro_batch_size": 2}})
    eng = Engine(cfg)
    P, tp_layers = eng.cparams, eng.tp_layers
    names = ["layers/0/q", "layers/0/k", "layers/0/v"]
    widths = [P[f"{nm}/A"].shape[1] for nm in names]
    Zs = cp.asarray(np.random.default_rng(3).standard_normal((16, sum(widths))).astype(np.float32))
    sl = [slice(sum(widths[:j]), sum(widths[:j + 1])) for j in range(3)]
    want = [cp.asnumpy(Zs)[:, s] @ cp.asnumpy(P[f"{nm}/B"]) for s, nm in zip(sl, names)]

    def products():
        calls = []
        real = blas.matmul
        with monkeypatch.context() as m:
            m.setattr(blas, "matmul", lambda *a, **k: (calls.append(a[0].ndim), real(*a, **k))[1])
            m.setattr(cp, "stack", None)  # no stacked copies
            got = tp_layers._b_products(Zs, sl, names, P)
        return calls, got

    calls, got = products()
    assert calls == [2, 3]  # q alone, k and v batched
    for g, w in zip(got, want):
        np.testing.assert_allclose(cp.asnumpy(g), w, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(FlatBuffer, "stacked", lambda self, names: None)
    assert products()[0] != [2, 3]
