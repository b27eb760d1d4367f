"""The CUDA kernels (kernels/*.cu), their NumPy twins (boostmpi.gpu.twins) and the loader.

(a) every kernel source compiles offline with nvcc, for sm_80 and sm_90, to PTX and cubin, and
    for a 64-wide wavefront (-DWARP_SIZE=64) from the self-contained text the loader hands NVRTC;
(b) the twins match the PyTorch oracle (autograd for the backward passes), incl. the online
    RMSNorm identity that bottleneck-aware tensor parallelism relies on;
(c) on a GPU, every kernel matches its twin in float32 and bfloat16.
"""

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from boostmpi.backend import gpu_unavailable_reason, to_numpy
from boostmpi.gpu import kernels, twins

EPS = 1e-6
KERNEL_FILES = sorted(kernels.kernels_dir().glob("*.cu"))

# every entry point a wrapper in boostmpi.gpu.kernels launches, by source file
ENTRY_POINTS = {
    "rmsnorm.cu": [f"{k}_{t}" for k in ("rmsnorm_forward", "rmsnorm_backward", "rmsnorm_online_stats", "rescale_rows")
                   for t in ("f32", "bf16")],
    "lowrank.cu": [f"{k}_{t}" for k in ("silu_forward", "silu_backward", "gate_forward", "gate_backward")
                   for t in ("f32", "bf16")],
    "softmax_xent.cu": [f"softmax_xent_{t}_{i}" for t in ("f32", "bf16") for i in ("i32", "i64")],
}

# ---------------------------------------------------------------------------- (a) offline compiles

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH (install the CUDA toolkit to compile the kernels offline)")


def test_every_kernel_file_is_covered():
    assert sorted(p.name for p in KERNEL_FILES) == sorted(ENTRY_POINTS)


def _nvcc(args):
    result = subprocess.run([NVCC, "-std=c++14", "-Werror", "all-warnings", *args], capture_output=True, text=True)
    return args, result.returncode, result.stderr


@needs_nvcc
@pytest.mark.parametrize("cu_file", KERNEL_FILES, ids=lambda p: p.name)
def test_kernel_compiles_for_sm80_sm90_and_wavefront64(cu_file, tmp_path):
    include = f"-I{kernels.kernels_dir()}"
    jobs = []
    for arch in ("sm_80", "sm_90"):
        jobs.append([f"-arch={arch}", "-cubin", include, "-o", str(tmp_path / f"{arch}.cubin"), str(cu_file)])
        jobs.append([f"-arch={arch}", "--ptx", include, "-o", str(tmp_path / f"{arch}.ptx"), str(cu_file)])
    # what the loader gives NVRTC/hipRTC: one text, no include path; here for a 64-wide wavefront
    standalone = tmp_path / f"standalone_{cu_file.name}"
    standalone.write_text(kernels.kernel_source(cu_file.stem))
    jobs.append(["-arch=sm_90", "--ptx", "-DWARP_SIZE=64", "-o", str(tmp_path / "wave64.ptx"), str(standalone)])

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        results = list(pool.map(_nvcc, jobs))
    failures = [f"nvcc {' '.join(args)}\n{stderr}" for args, rc, stderr in results if rc != 0]
    assert not failures, "\n".join(failures)

    for ptx in ("sm_90.ptx", "wave64.ptx"):
        entries = set(re.findall(r"\.entry\s+(\w+)\(", (tmp_path / ptx).read_text()))
        assert set(ENTRY_POINTS[cu_file.name]) <= entries, f"{ptx} lacks {set(ENTRY_POINTS[cu_file.name]) - entries}"


# ---------------------------------------------------------------------------- loader, without a GPU


def test_loader_pastes_local_includes_into_one_text():
    source = kernels.kernel_source("rmsnorm")
    assert not re.search(r'^#include "', source, re.MULTILINE)
    assert "float block_reduce(" in source and "RMSNORM_ENTRY_POINTS(float, f32)" in source


def test_loader_honours_kernels_dir_env(tmp_path, monkeypatch):
    (tmp_path / "part.cuh").write_text("#define ANSWER 42\n")
    (tmp_path / "demo.cu").write_text('#include "part.cuh"\nint x = ANSWER;\n')
    monkeypatch.setenv(kernels.KERNELS_DIR_ENV, str(tmp_path))
    assert kernels.kernels_dir() == tmp_path
    assert kernels.kernel_source("demo") == "#define ANSWER 42\n\nint x = ANSWER;\n"

    monkeypatch.setenv(kernels.KERNELS_DIR_ENV, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match=kernels.KERNELS_DIR_ENV):
        kernels.kernels_dir()


def test_wrappers_check_dtype_shape_and_contiguity_before_launching():
    x = np.ones((4, 8), np.float32)
    with pytest.raises(TypeError, match="x has dtype float64"):
        kernels.rmsnorm_forward(x.astype(np.float64), np.ones(8), EPS)
    with pytest.raises(ValueError, match=r"w has shape \(7,\)"):
        kernels.rmsnorm_forward(x, np.ones(7, np.float32), EPS)
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.rmsnorm_forward(np.ones((8, 4), np.float32).T, np.ones(8, np.float32), EPS)
    with pytest.raises(TypeError, match="rstd has dtype float64"):
        kernels.rmsnorm_backward(x, x, np.ones(8, np.float32), np.ones(4))
    with pytest.raises(ValueError, match=r"u has shape"):
        kernels.gate_forward(x, x[:2], act=True)
    with pytest.raises(TypeError, match="int32 or int64"):
        kernels.softmax_xent(x, np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="grad_scale"):
        kernels.softmax_xent(x, np.zeros(4, np.int32), out=x)


# ---------------------------------------------------------------------------- (b) twins vs the oracle

try:
    import torch
    from torch_llama import rms_norm as torch_rms_norm
except ImportError as exc:  # the compile and loader tests above still run
    torch, TORCH_MISSING = None, f"the PyTorch oracle is not importable ({exc})"
else:
    TORCH_MISSING = None
needs_torch = pytest.mark.skipif(TORCH_MISSING is not None, reason=str(TORCH_MISSING))

# twin in `dtype` against a float64 oracle
TWIN_TOLERANCE = {np.float64: dict(rtol=1e-12, atol=1e-12), np.float32: dict(rtol=2e-5, atol=2e-5)}
FLOAT_DTYPES = [np.float64, np.float32]


def _randn(rng, shape, dtype, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(dtype)


def _oracle_grads(fn, inputs, dout):
    """Gradients of sum(fn(*inputs) * dout) with respect to each input, by torch autograd in float64."""
    tensors = [torch.tensor(np.asarray(a, np.float64), requires_grad=True) for a in inputs]
    out = fn(*tensors)
    out.backward(torch.tensor(np.asarray(dout, np.float64)))
    return out.detach().numpy(), [t.grad.numpy() for t in tensors]


@needs_torch
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rmsnorm_twins_match_torch(dtype):
    rng = np.random.default_rng(0)
    N, C = 5, 24
    x, w, dy = _randn(rng, (N, C), dtype, 3.0), _randn(rng, C, dtype), _randn(rng, (N, C), dtype)
    y_ref, (dx_ref, dw_ref) = _oracle_grads(lambda x, w: torch_rms_norm(x, w, EPS), (x, w), dy)

    y, rstd = twins.rmsnorm_forward(x, w, EPS)
    dx, dw = twins.rmsnorm_backward(dy, x, w, rstd)
    tol = TWIN_TOLERANCE[dtype]
    assert y.dtype == dtype and dx.dtype == dtype and rstd.dtype == twins.accumulation_dtype(dtype)
    np.testing.assert_allclose(rstd, 1.0 / np.sqrt(np.mean(np.float64(x) ** 2, axis=1) + EPS), **tol)
    np.testing.assert_allclose(y, y_ref, **tol)
    np.testing.assert_allclose(dx, dx_ref, **tol)
    np.testing.assert_allclose(dw, dw_ref, **tol)


@needs_torch
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_online_rmsnorm_over_shards_equals_rmsnorm_then_matmul(dtype):
    """rescale_rows(sum_s (x_s * w_s) @ A_s, sum_s ss_s) == rmsnorm(x, w) @ A, uneven shards."""
    rng = np.random.default_rng(1)
    N, C, R = 6, 20, 4
    x, w, A = _randn(rng, (N, C), dtype, 2.0), _randn(rng, C, dtype), _randn(rng, (C, R), dtype)
    P = np.zeros((N, R), dtype)
    ss_total = np.zeros(N, twins.accumulation_dtype(dtype))
    for cols in (slice(0, 7), slice(7, 15), slice(15, C)):
        xw, ss = twins.rmsnorm_online_stats(x[:, cols], w[cols])
        np.testing.assert_allclose(xw, np.float64(x[:, cols]) * w[cols], **TWIN_TOLERANCE[dtype])
        P += xw @ A[cols]
        ss_total += ss
    online = twins.rescale_rows(P, ss_total, C, EPS)
    with torch.no_grad():
        reference = torch_rms_norm(torch.tensor(np.float64(x)), torch.tensor(np.float64(w)), EPS).numpy() @ np.float64(A)
    assert online.dtype == dtype
    np.testing.assert_allclose(online, reference, **TWIN_TOLERANCE[dtype])


@needs_torch
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_silu_twins_match_torch(dtype):
    rng = np.random.default_rng(2)
    a, dz = _randn(rng, (3, 17), dtype, 4.0), _randn(rng, (3, 17), dtype)
    z_ref, (da_ref,) = _oracle_grads(torch.nn.functional.silu, (a,), dz)
    np.testing.assert_allclose(twins.silu_forward(a), z_ref, **TWIN_TOLERANCE[dtype])
    np.testing.assert_allclose(twins.silu_backward(a, dz), da_ref, **TWIN_TOLERANCE[dtype])


@needs_torch
@pytest.mark.parametrize("act", [True, False])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_gate_twins_match_torch(dtype, act):
    rng = np.random.default_rng(3)
    g, u, dy = (_randn(rng, (4, 9), dtype, 3.0) for _ in range(3))

    def gate(g, u):
        return (torch.nn.functional.silu(g) if act else g) * u

    y_ref, (dg_ref, du_ref) = _oracle_grads(gate, (g, u), dy)
    dg, du = twins.gate_backward(g, u, dy, act)
    tol = TWIN_TOLERANCE[dtype]
    np.testing.assert_allclose(twins.gate_forward(g, u, act), y_ref, **tol)
    np.testing.assert_allclose(dg, dg_ref, **tol)
    np.testing.assert_allclose(du, du_ref, **tol)


@needs_torch
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_softmax_xent_twin_matches_torch(dtype):
    rng = np.random.default_rng(4)
    N, V, scale = 6, 13, 1.0 / 6
    logits = _randn(rng, (N, V), dtype, 5.0) + dtype(300.0)  # large logits: needs the max subtracted
    targets = rng.integers(0, V, N).astype(np.int64)
    tensor = torch.tensor(np.float64(logits), requires_grad=True)
    loss_ref = torch.nn.functional.cross_entropy(tensor, torch.tensor(targets), reduction="none")
    (loss_ref.sum() * scale).backward()

    loss, dlogits = twins.softmax_xent(logits, targets.astype(np.int32), grad_scale=scale)
    tol = TWIN_TOLERANCE[dtype]
    np.testing.assert_allclose(loss, loss_ref.detach().numpy(), rtol=tol["rtol"], atol=300 * tol["atol"])
    np.testing.assert_allclose(dlogits, tensor.grad.numpy(), **tol)
    assert twins.softmax_xent(logits, targets)[1] is None

    in_place = logits.copy()
    _, out = twins.softmax_xent(in_place, targets, grad_scale=scale, out=in_place)
    assert out is in_place
    np.testing.assert_array_equal(in_place, dlogits)


def test_softmax_xent_twin_flags_out_of_range_targets_with_nan():
    logits = np.zeros((3, 4), np.float32)
    loss, dlogits = twins.softmax_xent(logits, np.array([0, 4, -1]), grad_scale=1.0)
    assert np.isfinite(loss[0]) and np.isnan(loss[1]) and np.isnan(loss[2])
    np.testing.assert_allclose(dlogits[1:], 0.25)  # softmax only, no one-hot term


def test_bfloat16_twins_compute_in_float32_and_round_once():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(5)
    x, w = _randn(rng, (3, 16), bf16), _randn(rng, 16, bf16)
    y, rstd = twins.rmsnorm_forward(x, w, EPS)
    y32, rstd32 = twins.rmsnorm_forward(x.astype(np.float32), w.astype(np.float32), EPS)
    assert y.dtype == bf16 and rstd.dtype == np.float32
    np.testing.assert_array_equal(rstd, rstd32)
    np.testing.assert_array_equal(y, y32.astype(bf16))


# ---------------------------------------------------------------------------- (c) kernels vs twins on a GPU

GPU_REASON = gpu_unavailable_reason()
gpu = pytest.mark.skipif(GPU_REASON is not None, reason=f"no usable GPU: {GPU_REASON}")

# kernel against twin from the same inputs, by output dtype; atol is relative to the output's
# largest magnitude. bf16 outputs may differ by one rounding (2^-8 relative).
PARITY_TOLERANCE = {"float32": dict(rtol=1e-5, atol=1e-5), "bfloat16": dict(rtol=1.6e-2, atol=1e-3)}


def _assert_close_for_dtype(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = PARITY_TOLERANCE[want.dtype.name]
    want = want.astype(np.float32)
    largest = np.max(np.abs(want[np.isfinite(want)]), initial=1.0)
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=tol["rtol"], atol=tol["atol"] * largest)


def _storage_dtype(name):
    if name == "float32":
        return np.dtype(np.float32)
    ml_dtypes = pytest.importorskip("ml_dtypes")
    cupy = pytest.importorskip("cupy")
    try:
        cupy.asarray(np.zeros(2, ml_dtypes.bfloat16))
    except Exception as exc:  # noqa: BLE001 - older CuPy has no bfloat16
        pytest.skip(f"this CuPy cannot hold bfloat16 arrays ({exc})")
    return np.dtype(ml_dtypes.bfloat16)


def _assert_parity(module_call, host_inputs):
    """Runs module_call(kernels, GPU copies of the inputs) and module_call(twins, host inputs)
    and compares every output."""
    import cupy

    got = module_call(kernels, [cupy.asarray(a) for a in host_inputs])
    want = module_call(twins, host_inputs)
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        _assert_close_for_dtype(to_numpy(g), w)


# C: aligned (vector loads), odd (scalar path), wide (several chunks per thread)
ROW_WIDTHS = [1024, 1003, 9000]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("C", ROW_WIDTHS)
def test_rmsnorm_kernels_match_twins(dtype_name, C):
    dtype = _storage_dtype(dtype_name)
    rng = np.random.default_rng(6)
    N = 300  # more rows than backward blocks on one GPU: blocks stride over rows
    x, w, dy = _randn(rng, (N, C), dtype, 2.0), _randn(rng, C, dtype), _randn(rng, (N, C), dtype)
    rstd = twins.rmsnorm_forward(x, w, EPS)[1].astype(np.float32)
    _assert_parity(lambda m, a: m.rmsnorm_forward(a[0], a[1], EPS), [x, w])
    _assert_parity(lambda m, a: m.rmsnorm_backward(*a), [dy, x, w, rstd])
    _assert_parity(lambda m, a: m.rmsnorm_online_stats(*a), [x, w])
    ss_total = np.abs(_randn(rng, N, np.float32, 50.0))
    _assert_parity(lambda m, a: m.rescale_rows(a[0], a[1], 4 * C, EPS), [x, ss_total])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(64, 256), (7, 33)])  # vectorised and with a scalar tail
def test_lowrank_kernels_match_twins(dtype_name, shape):
    dtype = _storage_dtype(dtype_name)
    rng = np.random.default_rng(7)
    g, u, dy = (_randn(rng, shape, dtype, 4.0) for _ in range(3))
    _assert_parity(lambda m, a: m.silu_forward(*a), [g])
    _assert_parity(lambda m, a: m.silu_backward(*a), [g, dy])
    for act in (True, False):
        _assert_parity(lambda m, a: m.gate_forward(*a, act), [g, u])
        _assert_parity(lambda m, a: m.gate_backward(*a, act), [g, u, dy])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("target_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("V", [4096, 5001])
def test_softmax_xent_kernel_matches_twin(dtype_name, target_dtype, V):
    import cupy

    dtype = _storage_dtype(dtype_name)
    rng = np.random.default_rng(8)
    N = 9
    logits = _randn(rng, (N, V), dtype, 4.0)
    targets = rng.integers(0, V, N).astype(target_dtype)
    targets[-1] = V  # out of range: NaN loss, no one-hot term
    scale = 2.0
    _assert_parity(lambda m, a: m.softmax_xent(*a)[0], [logits, targets])
    _assert_parity(lambda m, a: m.softmax_xent(*a, grad_scale=scale), [logits, targets])

    in_place = cupy.asarray(logits)
    loss, out = kernels.softmax_xent(in_place, cupy.asarray(targets), grad_scale=scale, out=in_place)
    assert out is in_place
    want_loss, want_grad = twins.softmax_xent(logits, targets, grad_scale=scale)
    _assert_close_for_dtype(to_numpy(loss), want_loss)
    _assert_close_for_dtype(to_numpy(out), want_grad)
