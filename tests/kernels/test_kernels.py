"""The CUDA kernels (kernels/*.cu) through their CuPy wrappers (boostmpi.gpu.kernels), and the loader.

(a) every kernel source compiles offline with nvcc, for sm_80 and sm_90, to PTX and cubin, and
    for a 64-wide wavefront (-DWARP_SIZE=64) from the self-contained text the loader hands NVRTC;
(b) the online RMSNorm identity that bottleneck-aware tensor parallelism relies on, for the NumPy
    code of boostmpi/model/layers.py, against the PyTorch oracle;
(c) every kernel, launched by its wrapper on the device, against the NumPy code of
    boostmpi/model/ that the CPU path runs (its one specification), in float32 and bfloat16, with
    vectorised rows, scalar tails, odd sizes, rows longer than one block covers in one pass, and
    more rows than the backward's blocks. On a real GPU where CuPy reaches one, else on the CuPy
    stand-in, whose launches run the kernel source through the CUDA execution harness (the pytest
    header says which); the harness-level checks (races, bounds, warp 64) are tests/emulators/cudaemu/test_cudaemu.py.
"""

import functools
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from boostmpi.backend import to_numpy
from tests.support.gpu_compilers import require
from boostmpi.gpu import kernels, launch_plan, tensor_cores
from boostmpi.model import layers

EPS = 1e-6
KERNEL_FILES = sorted(kernels.kernels_dir().glob("*.cu"))

# every entry point a wrapper in boostmpi.gpu.kernels launches, by source file
ENTRY_POINTS = {
    "rmsnorm.cu": [f"{k}_{t}" for k in ("rmsnorm_forward", "rmsnorm_projection", "rmsnorm_backward",
                                        "rmsnorm_online_stats", "residual_online_stats", "rescale_rows")
                   for t in ("f32", "bf16")] + ["dw_accumulate_f32"],
    "lowrank.cu": [f"{k}_{t}" for k in ("silu_forward", "silu_backward", "gate_forward", "gate_backward")
                   for t in ("f32", "bf16")],
    "softmax_xent.cu": [f"softmax_xent_{t}_{i}" for t in ("f32", "bf16") for i in ("i32", "i64")],
    "attention.cu": [f"{k}_{hd}{t}" for k in ("attention_forward", "attention_backward_dq", "attention_backward")
                     for hd in ("", "hd64_") for t in ("f32", "bf16")],
    "rope.cu": [f"{k}_{t}" for k in ("rope_forward", "rope_backward") for t in ("f32", "bf16")],
    "btp.cu": [f"{k}_{t}" for k in ("btp_rescale_silu", "btp_backward_pre", "btp_backward_post") for t in ("f32", "bf16")],
    "adamw.cu": ["adamw_step_f32", "adamw_step_device_f32", "sum_squares_ranges_f32"],
}

# ---------------------------------------------------------------------------- (a) offline compiles

NVCC = shutil.which("nvcc")


def test_every_kernel_file_is_covered():
    assert sorted(p.name for p in KERNEL_FILES) == sorted(ENTRY_POINTS)


def _nvcc(args):
    result = subprocess.run([NVCC, "-std=c++14", "-Werror", "all-warnings", *args], capture_output=True, text=True)
    return args, result.returncode, result.stderr


@pytest.mark.parametrize("cu_file", KERNEL_FILES, ids=lambda p: p.name)
def test_kernel_compiles_for_sm80_sm90_and_wavefront64(cu_file, tmp_path):
    require("nvcc")  # skips without it, fails under CI=true
    include = f"-I{kernels.kernels_dir()}"
    plan = list(launch_plan.defines(cu_file.stem))  # the tile sizes the loader passes
    jobs = []
    for arch in ("sm_80", "sm_90"):  # to cubin; --keep leaves the PTX it went through (one compile, not two)
        (tmp_path / arch).mkdir()
        jobs.append([f"-arch={arch}", "-cubin", "--keep", "--keep-dir", str(tmp_path / arch), include, *plan,
                     "-o", str(tmp_path / f"{arch}.cubin"), str(cu_file)])
    # what the loader gives NVRTC/hipRTC: one text, no include path; here for a 64-wide wavefront
    standalone = tmp_path / f"standalone_{cu_file.name}"
    standalone.write_text(kernels.kernel_source(cu_file.stem))
    jobs.append(["-arch=sm_90", "--ptx", *kernels.compile_options(cu_file.stem, 64), "-o", str(tmp_path / "wave64.ptx"),
                 str(standalone)])

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        results = list(pool.map(_nvcc, jobs))
    failures = [f"nvcc {' '.join(args)}\n{stderr}" for args, rc, stderr in results if rc != 0]
    assert not failures, "\n".join(failures)

    for ptx in (f"sm_90/{cu_file.stem}.ptx", "wave64.ptx"):
        entries = set(re.findall(r"\.entry\s+(\w+)\(", (tmp_path / ptx).read_text()))
        assert set(ENTRY_POINTS[cu_file.name]) <= entries, f"{ptx} lacks {set(ENTRY_POINTS[cu_file.name]) - entries}"


# ---------------------------------------------------------------------------- loader, without a GPU


def test_loader_pastes_local_includes_into_one_text():
    source = kernels.kernel_source("rmsnorm")
    assert not re.search(r'^#include "', source, re.MULTILINE)
    assert "float block_reduce(" in source and "RMSNORM_ENTRY_POINTS(float, f32)" in source


def test_the_plans_block_limit_is_the_kernels():
    """launch_plan.MAX_BLOCK_THREADS (what the launch shapes are cut to) is common.cuh's MAX_BLOCK_THREADS
    (what the kernels' shared arrays and reductions are sized for): one number, written twice."""
    text = (kernels.kernels_dir() / "common.cuh").read_text()
    assert re.findall(r"^#define MAX_BLOCK_THREADS (\d+)$", text, re.MULTILINE) == [str(launch_plan.MAX_BLOCK_THREADS)]


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


@pytest.mark.parametrize("itemsize", [4, 2])
@pytest.mark.parametrize("warp", [32, 64])
def test_rmsnorm_backward_launch_covers_every_column_and_row_once(itemsize, warp):
    vector = 16 // itemsize
    for N, C, sms in [(1, 1, 1), (5, 37, 2), (5, 4100, 2), (16384, 16384, 108), (16384, 16384, 110), (3, 70000, 132)]:
        threads, tiles, rows_per_chunk, chunks = kernels.rmsnorm_backward_launch(N, C, itemsize, warp, sms)
        assert threads % warp == 0 and threads <= launch_plan.RMSNORM.backward_block_threads
        assert (tiles - 1) * threads * vector < C <= tiles * threads * vector
        assert (chunks - 1) * rows_per_chunk < N <= chunks * rows_per_chunk  # no chunk is empty
        assert tiles * chunks <= max(launch_plan.RMSNORM.backward_blocks_per_sm * sms, tiles)
    # the paper's shape on an A100: 8 blocks per SM
    assert kernels.rmsnorm_backward_launch(16384, 16384, 2, 32, 108) == (256, 8, 152, 108)


# ---------------------------------------------------------------------------- (b) online RMSNorm vs the oracle

try:
    import torch
    from tests.support.torch_llama import rms_norm as torch_rms_norm
except ImportError as exc:  # the compile and loader tests above still run
    torch, TORCH_MISSING = None, f"the PyTorch oracle is not importable ({exc})"
else:
    TORCH_MISSING = None
needs_torch = pytest.mark.skipif(TORCH_MISSING is not None, reason=str(TORCH_MISSING))


def _randn(rng, shape, dtype, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(dtype)


@needs_torch
@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 2e-5)])
def test_online_rmsnorm_over_shards_equals_rmsnorm_then_matmul(dtype, tol):
    """rescale_rows(sum_s (x_s * w_s) @ A_s, sum_s ss_s) == rmsnorm(x, w) @ A, uneven shards."""
    rng = np.random.default_rng(1)
    N, C, R = 6, 20, 4
    x, w, A = _randn(rng, (N, C), dtype, 2.0), _randn(rng, C, dtype), _randn(rng, (C, R), dtype)
    P = np.zeros((N, R), dtype)
    ss_total = np.zeros(N, dtype)
    for cols in (slice(0, 7), slice(7, 15), slice(15, C)):
        xw, ss = layers.rmsnorm_online_stats(x[:, cols], w[cols])
        assert xw.dtype == dtype and ss.dtype == dtype
        P += xw @ A[cols]
        ss_total += ss
    online = layers.rescale_rows(P, ss_total, C, EPS)
    with torch.no_grad():
        reference = torch_rms_norm(torch.tensor(np.float64(x)), torch.tensor(np.float64(w)), EPS).numpy() @ np.float64(A)
    assert online.dtype == dtype
    np.testing.assert_allclose(online, reference, rtol=tol, atol=tol)


# ---------------------------------------------------------------------------- (c) kernels vs boostmpi/model on the device

ml_dtypes = pytest.importorskip("ml_dtypes")
STORAGE = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def _stored(a, dtype):
    """The reference's float32 result as the kernel stores it: rounded once to `dtype`."""
    return np.asarray(a).astype(dtype)


def _assert_close(got, want, what):
    """got (device) against want (host, already in the dtype the kernel stores): float32 to
    accumulation-order differences, bfloat16 to one rounding step (2^-8 relative)."""
    got = to_numpy(got)
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    rtol, atol = (2e-5, 2e-6) if want.dtype == np.float32 else (2 ** -7, 2 ** -7)
    want32 = want.astype(np.float32)
    scale = np.max(np.abs(want32[np.isfinite(want32)]), initial=1.0)
    np.testing.assert_allclose(got.astype(np.float32), want32, rtol=rtol, atol=atol * scale, err_msg=what)


def _device(*arrays):
    import cupy

    return [cupy.asarray(a) for a in arrays]


def _widened(*arrays):
    """The kernels' arithmetic is float32 whatever the storage: the reference runs on float32 copies."""
    return [np.asarray(a, dtype=np.float32) for a in arrays]


@pytest.fixture
def small_grid(monkeypatch):
    """A device of 2 SMs as the wrappers see it: rmsnorm_backward's row chunks then hold several
    rows and the elementwise grid-stride loop goes round, with the few rows a test can afford."""
    real = kernels._device_info

    def two_sms(device_id):
        return real(device_id)._replace(sm_count=2)

    monkeypatch.setattr(kernels, "_device_info", two_sms)
    monkeypatch.setattr(kernels, "_module", functools.lru_cache(maxsize=None)(kernels._module.__wrapped__))


# row widths: whole 16-byte vectors, a scalar tail, and (for float32) longer than a block of 1024
# threads covers in one pass (4096 floats)
ROW_WIDTHS = [64, 37, 4100]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", STORAGE)
@pytest.mark.parametrize("C", ROW_WIDTHS)
def test_rmsnorm_kernels_match_the_model(small_grid, dtype_name, C):
    dtype = STORAGE[dtype_name]
    rng = np.random.default_rng(6)
    N = 5  # more rows than the backward's 2 x 2 blocks: blocks stride over rows
    x, w, dy = _randn(rng, (N, C), dtype, 2.0), _randn(rng, C, dtype), _randn(rng, (N, C), dtype)
    xf, wf, dyf = _widened(x, w, dy)
    y_ref, rstd_ref = layers.rmsnorm_forward(xf, wf, EPS)
    y, rstd = kernels.rmsnorm_forward(*_device(x, w), EPS)
    _assert_close(y, _stored(y_ref, dtype), "rmsnorm y")
    _assert_close(rstd, rstd_ref[:, 0], "rmsnorm rstd")

    dw_ref = np.zeros(C, np.float32)
    dx_ref = layers.rmsnorm_backward(dyf, xf, wf, rstd_ref, dw_ref)
    dx, dw = kernels.rmsnorm_backward(*_device(dy, x, w, rstd_ref[:, 0]))
    _assert_close(dx, _stored(dx_ref, dtype), "rmsnorm dx")
    _assert_close(dw, dw_ref, "rmsnorm dw")
    # accumulated into a gradient that already holds something (dw_accumulate)
    before = _randn(rng, C, np.float32)
    (into,) = _device(before)
    dx, none = kernels.rmsnorm_backward(*_device(dy, x, w, rstd_ref[:, 0]), dw=into)
    assert none is None
    _assert_close(dx, _stored(dx_ref, dtype), "rmsnorm dx beside dw accumulated")
    _assert_close(into, before + dw_ref, "rmsnorm dw accumulated")

    xw_ref, ss_ref = layers.rmsnorm_online_stats(xf, wf)
    xw, ss = kernels.rmsnorm_online_stats(*_device(x, w))
    _assert_close(xw, _stored(xw_ref, dtype), "online stats xw")
    _assert_close(ss, ss_ref, "online stats ss")

    # the residual add before the norm in the same pass: the statistic is of the sum as stored
    sf = _widened(_stored(xf + dyf, dtype))[0]
    xw_ref, ss_ref = layers.rmsnorm_online_stats(sf, wf)
    s_dev, xw, ss = kernels.residual_online_stats(*_device(x, dy, w))
    _assert_close(s_dev, _stored(sf, dtype), "residual sum")
    _assert_close(xw, _stored(xw_ref, dtype), "residual xw")
    _assert_close(ss, ss_ref, "residual ss")

    ss_total = np.abs(_randn(rng, N, np.float32, 50.0))
    _assert_close(kernels.rescale_rows(*_device(x, ss_total), 4 * C, EPS),
                  _stored(layers.rescale_rows(xf, ss_total, 4 * C, EPS), dtype), "rescale_rows")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", STORAGE)
@pytest.mark.parametrize("shape", [(4, 64), (3, 11), (1, 1)])  # vectorised; a scalar tail; a single element
def test_lowrank_kernels_match_the_model(small_grid, dtype_name, shape):
    dtype = STORAGE[dtype_name]
    rng = np.random.default_rng(7)
    g, u, dy = (_randn(rng, shape, dtype, 4.0) for _ in range(3))
    gf, uf, dyf = _widened(g, u, dy)
    _assert_close(kernels.silu_forward(*_device(g)), _stored(layers.silu_forward(gf), dtype), "silu")
    _assert_close(kernels.silu_backward(*_device(g, dy)), _stored(layers.silu_backward(dyf, gf), dtype), "silu'")
    for act in (True, False):
        _assert_close(kernels.gate_forward(*_device(g, u), act), _stored(layers.gate_forward(gf, uf, act), dtype),
                      f"gate act={act}")
        dg, du = kernels.gate_backward(*_device(g, u, dy), act)
        dg_ref, du_ref = layers.gate_backward(dyf, gf, uf, act)
        _assert_close(dg, _stored(dg_ref, dtype), f"gate dg act={act}")
        _assert_close(du, _stored(du_ref, dtype), f"gate du act={act}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", STORAGE)
# vectors; scalar tails; rows past one pass; the paper's largest residual at tp = 1 (d_model 16,384: once
# 64 KiB of shared memory per block, all of an MI250X CU's LDS; now column tiles without any)
@pytest.mark.parametrize("R,Cs", [(64, 64), (13, 37), (24, 4100), (8, 16384)])
def test_btp_backward_kernels_match_the_model(small_grid, dtype_name, R, Cs):
    """btp's backward around the GEMM dxw = dP . A^T (layers.btp_norm_backward_pre/post)."""
    dtype = STORAGE[dtype_name]
    rng = np.random.default_rng(9)
    N = 5  # rows in chunks of several rows of the post kernel's column tiles (small_grid: 2 SMs)
    dZs, Z = _randn(rng, (N, R), dtype, 2.0), _randn(rng, (N, R), dtype, 2.0)
    rstd = np.abs(_randn(rng, (N, 1), np.float32)) + 0.5
    dzf, zf = _widened(dZs, Z)
    ss_total = np.abs(_randn(rng, N, np.float32, 4.0 * Cs)) + Cs
    Z_ref, Zs_ref, _, rstd_ref = layers.rescale_rows_silu(dzf, ss_total, 4 * Cs, EPS, keep=False)
    Zk, Zsk, rstdk = kernels.btp_rescale_silu(*_device(dZs, ss_total), 4 * Cs, EPS)
    _assert_close(Zk, _stored(Z_ref, dtype), "btp rescale Z")
    _assert_close(rstdk, rstd_ref, "btp rescale rstd")
    _assert_close(Zsk, _stored(layers.silu_forward(to_numpy(Zk).astype(np.float32)), dtype), "btp rescale silu(Z)")
    for act in (True, False):
        dP_ref, dS_ref = layers.btp_norm_backward_pre(dzf, zf, rstd, 4 * Cs, act)
        dP, dS = kernels.btp_backward_pre(*_device(dZs, Z, rstd[:, 0]), 4 * Cs, act)
        _assert_close(dP, _stored(dP_ref, dtype), f"btp dP act={act}")
        _assert_close(dS, dS_ref[:, 0], f"btp dS act={act}")

    dxw = _randn(rng, (N, Cs), np.float32)
    x, w = _randn(rng, (N, Cs), dtype), _randn(rng, Cs, dtype)
    dS = _randn(rng, (N, 1), np.float32, 0.1)
    xf, wf = _widened(x, w)
    dw_ref = np.zeros(Cs, np.float32)
    dx_ref = layers.btp_norm_backward_post(dxw, xf, wf, dS, dw_ref)
    dx, dw = kernels.btp_backward_post(*_device(dxw, x, w, dS[:, 0]))
    _assert_close(dx, _stored(dx_ref, dtype), "btp dx")
    _assert_close(dw, dw_ref, "btp dw")
    # with the residual's gradient from above: added in float32 before the kernel's one rounding
    residual = _randn(rng, (N, Cs), dtype, 3.0)
    dx_ref = layers.btp_norm_backward_post(dxw, xf, wf, dS, np.zeros(Cs, np.float32), _widened(residual)[0])
    dx, dw = kernels.btp_backward_post(*_device(dxw, x, w, dS[:, 0], residual))
    _assert_close(dx, _stored(dx_ref, dtype), "btp dx + residual")
    _assert_close(dw, dw_ref, "btp dw beside the residual")
    before = _randn(rng, Cs, np.float32)
    (into,) = _device(before)
    assert kernels.btp_backward_post(*_device(dxw, x, w, dS[:, 0], residual), dw=into)[1] is None
    _assert_close(into, before + dw_ref, "btp dw accumulated")


@pytest.mark.gpu
def test_empty_inputs_launch_nothing():
    import cupy

    x = cupy.empty((0, 8), dtype=np.float32)
    y, rstd = kernels.rmsnorm_forward(x, cupy.ones(8, dtype=np.float32), EPS)
    assert y.shape == (0, 8) and rstd.shape == (0,)
    dx, dw = kernels.rmsnorm_backward(x, x, cupy.ones(8, dtype=np.float32), rstd)
    assert dx.shape == (0, 8) and (dw.get() == 0).all()
    rows_of_nothing = cupy.empty((3, 0), dtype=np.float32)
    dx, dw = kernels.rmsnorm_backward(rows_of_nothing, rows_of_nothing, cupy.ones(0, dtype=np.float32),
                                      cupy.ones(3, dtype=np.float32))
    assert dx.shape == (3, 0) and dw.shape == (0,)
    assert kernels.silu_forward(cupy.empty(0, dtype=np.float32)).shape == (0,)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", STORAGE)
@pytest.mark.parametrize("target_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("V", [64, 45, 4100])  # vectorised; a scalar tail; longer than one pass of a block
def test_softmax_xent_kernel_matches_the_head(dtype_name, target_dtype, V):
    """Against the head's cross-entropy (boostmpi/parallel/vocab_parallel.py) with a group of one."""
    import cupy

    from boostmpi.parallel.grid import ProcessGrid
    from boostmpi.parallel.vocab_parallel import cross_entropy_backward, cross_entropy_forward

    dtype = STORAGE[dtype_name]
    rng = np.random.default_rng(8)
    N, scale = 3, 0.5
    logits = _randn(rng, (N, V), dtype, 4.0)
    targets = rng.integers(0, V, N).astype(target_dtype)
    tp = ProcessGrid(None).tp
    loss_ref, probs, *_rest, local, tidx = cross_entropy_forward(*_widened(logits), targets, 0, tp)
    grad_ref = cross_entropy_backward(probs, local, tidx, scale)

    loss, none = kernels.softmax_xent(*_device(logits, targets))
    assert none is None
    _assert_close(loss, loss_ref, "loss only")
    loss, grad = kernels.softmax_xent(*_device(logits, targets), grad_scale=scale)
    _assert_close(loss, loss_ref, "loss")
    _assert_close(grad, _stored(grad_ref, dtype), "dlogits")

    in_place = cupy.asarray(logits)
    _, out = kernels.softmax_xent(in_place, cupy.asarray(targets), grad_scale=scale, out=in_place)
    assert out is in_place
    _assert_close(out, _stored(grad_ref, dtype), "dlogits in place")


@pytest.mark.gpu
def test_softmax_xent_kernel_gives_nan_for_a_target_outside_the_vocabulary():
    import cupy

    logits = cupy.zeros((3, 4), dtype=np.float32)
    loss, grad = kernels.softmax_xent(logits, cupy.asarray(np.array([0, 4, -1], np.int32)), grad_scale=1.0)
    loss, grad = loss.get(), grad.get()
    assert np.isfinite(loss[0]) and np.isnan(loss[1]) and np.isnan(loss[2])
    np.testing.assert_allclose(grad[1:], 0.25)  # softmax only, no one-hot term


@pytest.mark.gpu
def test_compile_all_compiles_every_kernel_file(monkeypatch, attention_gpu_default):
    """`compile_all` (what the batch scripts call before the ranks start) compiles each kernels/*.cu
    through the loader's own `_module`, for the device asked for. The mutant (a loader that skips the
    last file) is caught."""
    import functools

    seen = []
    real = kernels._module.__wrapped__

    def module(name, device_id, options):
        seen.append((name, device_id, options))
        return real(name, device_id, options)

    monkeypatch.setattr(kernels, "_module", functools.lru_cache(maxsize=None)(module))
    names = [p.stem for p in KERNEL_FILES]
    # with the real-GPU default (attention_gpu_default), where a bfloat16 run takes the tensor-core
    # attention (tensor_cores.use_wmma: an A100 or later, the stand-in's A100 included), that too
    device = kernels._device_info(0)
    wmma = ["attention+wmma"] if tensor_cores.use_wmma("bf16", device) else []
    warp = device.warp_size
    assert kernels.compile_all(0) == names + wmma and seen[:len(names)] == [(n, 0, kernels.compile_options(n, warp))
                                                                          for n in names]
    assert [s[0] for s in seen[len(names):]] == (["attention"] if wmma else [])
    if not wmma and device.warp_size == 32 and device.nvidia_major >= 8:  # the FMA default of a missing header
        monkeypatch.setenv(kernels.ATTENTION_TENSOR_CORES_ENV, "1")
        seen.clear()
        assert kernels.compile_all(0) == names + ["attention+wmma"]
        assert seen[-1][0] == "attention" and "-DBOOSTMPI_ATTENTION_WMMA" in seen[-1][2]
    seen.clear()
    monkeypatch.setattr(kernels, "kernels_dir", lambda real_dir=kernels.kernels_dir(): _SkipLast(real_dir))
    assert kernels.compile_all(0) != names


class _SkipLast:
    """A kernels folder whose glob misses the last file: the mutant of compile_all's input."""

    def __init__(self, real):
        self.real = real

    def glob(self, pattern):
        return sorted(self.real.glob(pattern))[:-1]
