"""The CUDA execution harness (testing/cudaemu): the exact kernels/*.cu text on the CPU.

(a) every entry point, launched directly on the harness (no CuPy) as boostmpi.gpu.kernels
    launches it, at warp 32 and 64, float32 and bfloat16, against the NumPy code of
    boostmpi/model/layers.py in float64 (the CuPy-level kernel suite is tests/kernels/test_kernels.py);
(b) the harness can fail: each error class is raised by the real kernels with one change
    (a barrier removed, an early return, a lane left out, a wrong scalar type, a buffer one
    element short...) and by small synthetic kernels;
(c) the randomised schedule: seeds change the interleaving, never the results of these
    deterministic kernels, and never whether an error is found.
"""

import functools
import re
from pathlib import Path

import numpy as np
import pytest

from testing import cudaemu
from boostmpi.gpu import kernels as loader
from boostmpi.model import layers

pytestmark = pytest.mark.gpu

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
EPS = 1e-6
WARPS = cudaemu.WARP_SIZE_OPTIONS
DTYPES = {"f32": np.dtype(np.float32), "bf16": BF16}
SM_COUNT = 2  # a small grid: the elementwise loop then strides


@functools.lru_cache(maxsize=None)
def _module(code, warp, file=None):
    """`code` on the harness at `warp` lanes, with the loader's options for kernels/<file>.cu (its launch
    plan's sizes) when it is (a variant of) that file."""
    options = loader.compile_options(file, warp) if file else loader.COMPILE_OPTIONS + (f"-DWARP_SIZE={warp}",)
    return cudaemu.Module(code, options)


def kernel(file, entry, warp=32, code=None):
    return _module(code if code is not None else loader.kernel_source(file), warp, file).get_function(entry)


def mutated(file, old, new, count=1):
    """The loader's text for `file` with `old` replaced by `new` (which must occur)."""
    code = loader.kernel_source(file)
    assert code.count(old) >= count, f"the mutation target {old!r} is not in {file}.cu any more"
    return code.replace(old, new, count)


def f64(a):
    return np.asarray(a, dtype=np.float64)


def stored(a, dtype):
    """a rounded to the storage dtype, as float64 (what the kernel's output can at best be)."""
    return f64(np.asarray(a).astype(dtype))


def _ordered_bf16(values):
    """bfloat16 bit patterns as integers ordered like the values (ulp distance = difference)."""
    bits = np.asarray(values, np.float64).astype(BF16).view(np.uint16).astype(np.int64)
    return np.where(bits < 0x8000, bits, 0x8000 - bits)


def assert_close(got, want, dtype, what):
    """fp32 outputs: within accumulation-order differences of the float64 reference. bf16
    outputs: the fp32 result rounded once to nearest even, so nearly every element is the
    reference's own rounding and none is more than one bf16 ulp from it (away from values that
    cancel to near zero, where fp32 error shows)."""
    got, want = f64(got), f64(want)
    if dtype == np.float32:
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6, err_msg=what)
        return
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-6, err_msg=what)
    large = np.abs(want) >= 1e-3 * np.abs(want).max()
    ulps = np.abs(_ordered_bf16(got) - _ordered_bf16(want))[large]
    assert ulps.max(initial=0) <= 1 and np.mean(ulps != 0) <= 0.03, (
        f"{what}: bf16 results {ulps.max(initial=0)} ulps from the rounded reference, {np.mean(ulps != 0):.1%} not equal")


def random(shape, dtype, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


def row_block(width, dtype, warp):
    return loader._row_block(width, dtype.itemsize, warp)


# ------------------------------------------------------------------------------ (a) parity

# row lengths: whole 16-byte vectors, a scalar tail, and one longer than the block covers in one pass
WIDTHS = (64, 37, 200)


@pytest.mark.parametrize("warp", WARPS)
@pytest.mark.parametrize("suffix", DTYPES)
def test_rmsnorm_forward_backward_match_layers(warp, suffix):
    dtype = DTYPES[suffix]
    for C in WIDTHS:
        N = 3
        x, w, dy = random((N, C), dtype, 1), random(C, dtype, 2), random((N, C), dtype, 3)
        X, W, DY = cudaemu.DeviceArray(x), cudaemu.DeviceArray(w), cudaemu.DeviceArray(dy)
        Y, R = cudaemu.DeviceArray(shape=(N, C), dtype=dtype), cudaemu.DeviceArray(shape=N, dtype=np.float32)
        # the loader's block, and one warp (several passes over the row)
        for block in (row_block(C, dtype, warp), warp):
            kernel("rmsnorm", f"rmsnorm_forward_{suffix}", warp)(N, block, (X, W, Y, R, np.int32(C), np.float32(EPS)))
            y_ref, rstd_ref = layers.rmsnorm_forward(f64(x), f64(w), EPS)
            assert_close(Y.get(), stored(y_ref, dtype), dtype, f"y C={C} block={block}")
            assert_close(R.get(), rstd_ref[:, 0], np.float32, f"rstd C={C} block={block}")
        # backward: the projection per row, then column tiles over chunks of 2, 2 and 1 rows
        N = 5
        x, dy = random((N, C), dtype, 4), random((N, C), dtype, 5)
        rstd = layers.rmsnorm_forward(f64(x), f64(w), EPS)[1]
        X, DY, R = cudaemu.DeviceArray(x), cudaemu.DeviceArray(dy), cudaemu.DeviceArray(rstd[:, 0].astype(np.float32))
        PROJ = cudaemu.DeviceArray(shape=N, dtype=np.float32)
        kernel("rmsnorm", f"rmsnorm_projection_{suffix}", warp)(N, row_block(C, dtype, warp), (DY, X, W, R, PROJ, np.int32(C)))
        DX, P = cudaemu.DeviceArray(shape=(N, C), dtype=dtype), cudaemu.DeviceArray(shape=(3, C), dtype=np.float32)
        threads, tiles, _, _ = loader.rmsnorm_backward_launch(N, C, dtype.itemsize, warp, SM_COUNT)
        kernel("rmsnorm", f"rmsnorm_backward_{suffix}", warp)(
            tiles * 3, threads, (DY, X, W, R, PROJ, DX, P, np.int32(N), np.int32(C), np.int32(2)))
        dw_ref = np.zeros(C)
        dx_ref = layers.rmsnorm_backward(f64(dy), f64(x), f64(w), f64(R.get())[:, None], dw_ref)
        assert_close(DX.get(), stored(dx_ref, dtype), dtype, f"dx C={C}")
        assert_close(P.get().sum(axis=0), dw_ref, np.float32, f"dw C={C}")


@pytest.mark.parametrize("warp", WARPS)
def test_dw_accumulate_adds_the_sum_of_the_partial_rows(warp):
    """dw += the column sums of [chunks, C] partials: fewer and more chunks than a block's row groups,
    and C not a multiple of a block's columns (the last block's columns past C do nothing)."""
    suffix = "f32"
    for chunks, C in ((3, 37), (41, 70), (1, 200)):
        partial, dw = random((chunks, C), np.float32, 40), random(C, np.float32, 41)
        DW = cudaemu.DeviceArray(dw)
        blocks, threads = loader.dw_accumulate_launch(C)
        kernel("rmsnorm", f"dw_accumulate_{suffix}", warp)(blocks, threads, (cudaemu.DeviceArray(partial), DW,
                                                                              np.int32(chunks), np.int32(C)))
        assert_close(DW.get(), f64(dw) + f64(partial).sum(axis=0), np.float32, f"dw chunks={chunks} C={C}")


@pytest.mark.parametrize("warp", WARPS)
@pytest.mark.parametrize("suffix", DTYPES)
def test_residual_online_stats_is_the_add_then_the_stats(warp, suffix):
    """h + y stored, then x * w and the sum of squares of the stored sum (layers.residual_online_stats)."""
    dtype = DTYPES[suffix]
    N = 3
    for C in (72, 37):  # vectors, and a scalar tail
        h, y, w = random((N, C), dtype, 8), random((N, C), dtype, 9), random(C, dtype, 10)
        S, XW = cudaemu.DeviceArray(shape=(N, C), dtype=dtype), cudaemu.DeviceArray(shape=(N, C), dtype=dtype)
        SS = cudaemu.DeviceArray(shape=N, dtype=np.float32)
        S2 = cudaemu.DeviceArray(shape=(N, C), dtype=dtype)  # the second copy of the sum
        kernel("rmsnorm", f"residual_online_stats_{suffix}", warp)(
            N, row_block(C, dtype, warp), (cudaemu.DeviceArray(h), cudaemu.DeviceArray(y), cudaemu.DeviceArray(w), S, S2,
                                           XW, SS, np.int32(C)))
        s_ref = f64(stored(f64(h) + f64(y), dtype))
        assert_close(S.get(), s_ref, dtype, f"s C={C}")
        np.testing.assert_array_equal(S2.get().view(np.uint8), S.get().view(np.uint8), err_msg=f"second copy C={C}")
        assert_close(XW.get(), stored(s_ref * f64(w), dtype), dtype, f"xw C={C}")
        assert_close(SS.get(), (s_ref ** 2).sum(axis=1), np.float32, f"ss C={C}")


@pytest.mark.parametrize("warp", WARPS)
@pytest.mark.parametrize("suffix", DTYPES)
def test_online_rmsnorm_halves_make_rmsnorm(warp, suffix):
    """stats then rescale of x*w over the whole row is rmsnorm(x, w); over two shards, the
    summed statistics give the same rescale (bottleneck-aware tensor parallelism)."""
    dtype = DTYPES[suffix]
    N, C = 3, 72
    x, w = random((N, C), dtype, 6), random(C, dtype, 7)
    xw_parts, ss_total = [], np.zeros(N, np.float32)
    for lo, hi in ((0, 40), (40, C)):  # two shards
        X, W = cudaemu.DeviceArray(x[:, lo:hi]), cudaemu.DeviceArray(w[lo:hi])
        XW, SS = cudaemu.DeviceArray(shape=(N, hi - lo), dtype=dtype), cudaemu.DeviceArray(shape=N, dtype=np.float32)
        kernel("rmsnorm", f"rmsnorm_online_stats_{suffix}", warp)(
            N, row_block(hi - lo, dtype, warp), (X, W, XW, SS, np.int32(hi - lo)))
        assert_close(XW.get(), stored(f64(x[:, lo:hi]) * f64(w[lo:hi]), dtype), dtype, "xw")
        assert_close(SS.get(), (f64(x[:, lo:hi]) ** 2).sum(axis=1), np.float32, "ss")
        xw_parts.append(XW.get())
        ss_total += SS.get()
    P, S = cudaemu.DeviceArray(np.concatenate(xw_parts, axis=1)), cudaemu.DeviceArray(ss_total)
    out = cudaemu.DeviceArray(shape=(N, C), dtype=dtype)
    kernel("rmsnorm", f"rescale_rows_{suffix}", warp)(
        N, row_block(C, dtype, warp), (P, S, out, np.int32(C), np.int32(C), np.float32(EPS)))
    # P was rounded to the storage type once before the rescale: compare at two roundings
    y_ref = layers.rmsnorm_forward(f64(x), f64(w), EPS)[0]
    tol = dict(rtol=2e-5, atol=1e-6) if dtype == np.float32 else dict(rtol=2 ** -6, atol=1e-6)
    np.testing.assert_allclose(f64(out.get()), y_ref, **tol)


@pytest.mark.parametrize("warp", WARPS)
@pytest.mark.parametrize("suffix", DTYPES)
def test_lowrank_elementwise_match_layers(warp, suffix):
    dtype = DTYPES[suffix]
    for n in (3000, 1027):  # vectorised + strided grid, and a scalar tail
        g, u, dy = random(n, dtype, 8, 3.0), random(n, dtype, 9), random(n, dtype, 10)
        G, U, DY = cudaemu.DeviceArray(g), cudaemu.DeviceArray(u), cudaemu.DeviceArray(dy)
        grid = loader._elementwise_grid(n, dtype.itemsize, SM_COUNT)
        block = loader.ELEMENTWISE_BLOCK_THREADS
        out, out2 = cudaemu.DeviceArray(shape=n, dtype=dtype), cudaemu.DeviceArray(shape=n, dtype=dtype)
        G64, U64, DY64 = f64(g), f64(u), f64(dy)

        kernel("lowrank", f"silu_forward_{suffix}", warp)(grid, block, (G, out, np.int64(n)))
        assert_close(out.get(), stored(layers.silu_forward(G64), dtype), dtype, f"silu n={n}")
        kernel("lowrank", f"silu_backward_{suffix}", warp)(grid, block, (G, DY, out, np.int64(n)))
        assert_close(out.get(), stored(layers.silu_backward(DY64, G64), dtype), dtype, f"silu' n={n}")
        for act in (True, False):
            kernel("lowrank", f"gate_forward_{suffix}", warp)(grid, block, (G, U, out, np.int64(n), np.int32(act)))
            assert_close(out.get(), stored(layers.gate_forward(G64, U64, act), dtype), dtype, f"gate act={act}")
            kernel("lowrank", f"gate_backward_{suffix}", warp)(grid, block, (G, U, DY, out, out2, np.int64(n),
                                                                             np.int32(act)))
            dg, du = layers.gate_backward(DY64, G64, U64, act)
            assert_close(out.get(), stored(dg, dtype), dtype, f"dg act={act}")
            assert_close(out2.get(), stored(du, dtype), dtype, f"du act={act}")


@pytest.mark.parametrize("warp", WARPS)
@pytest.mark.parametrize("suffix", DTYPES)
def test_btp_backward_kernels_match_layers(warp, suffix):
    """btp's backward around the GEMM dxw = dP . A^T (layers.btp_norm_backward_pre/post in float64)."""
    dtype = DTYPES[suffix]
    N = 5
    for width in WIDTHS:
        dzs, z = random((N, width), dtype, 21, 2.0), random((N, width), dtype, 22, 2.0)
        rstd = np.abs(random(N, np.float32, 23)) + 0.5
        DZS, Z, R = cudaemu.DeviceArray(dzs), cudaemu.DeviceArray(z), cudaemu.DeviceArray(rstd)
        DP, DS = cudaemu.DeviceArray(shape=N * width, dtype=dtype), cudaemu.DeviceArray(shape=N, dtype=np.float32)
        for act in (True, False):
            for block in (row_block(width, dtype, warp), warp):
                kernel("btp", f"btp_backward_pre_{suffix}", warp)(
                    N, block, (DZS, Z, R, DP, DS, np.int32(width), np.int32(4 * width), np.int32(act)))
                dP_ref, dS_ref = layers.btp_norm_backward_pre(f64(dzs), f64(z), f64(rstd)[:, None], 4 * width, act)
                assert_close(DP.get().reshape(N, width), stored(dP_ref, dtype), dtype, f"dP C={width} act={act}")
                assert_close(DS.get(), dS_ref[:, 0], np.float32, f"dS C={width} act={act}")

        ss = np.abs(random(N, np.float32, 28, 50.0))
        ZK, ZS = cudaemu.DeviceArray(shape=N * width, dtype=dtype), cudaemu.DeviceArray(shape=N * width, dtype=dtype)
        RS = cudaemu.DeviceArray(shape=N, dtype=np.float32)
        kernel("btp", f"btp_rescale_silu_{suffix}", warp)(
            N, row_block(width, dtype, warp), (DZS, cudaemu.DeviceArray(ss), ZK, ZS, RS, np.int32(width),
                                               np.int32(4 * width), np.float32(EPS)))
        z_ref = layers.rescale_rows(f64(dzs), f64(ss), 4 * width, EPS)
        assert_close(RS.get(), layers.online_rstd(f64(ss), 4 * width, EPS), np.float32, f"rescale rstd C={width}")
        assert_close(ZK.get().reshape(N, width), stored(z_ref, dtype), dtype, f"rescale Z C={width}")
        assert_close(ZS.get().reshape(N, width), stored(layers.silu_forward(f64(ZK.get().reshape(N, width))), dtype),
                     dtype, f"silu(Z) C={width}")

        dxw = random((N, width), np.float32, 24)
        x, w, ds = random((N, width), dtype, 25), random(width, dtype, 26), random(N, np.float32, 27, 0.1)
        # column tiles over 3 chunks of 2 rows (the last one short), as rmsnorm_backward
        DX, P = cudaemu.DeviceArray(shape=N * width, dtype=dtype), cudaemu.DeviceArray(shape=3 * width, dtype=np.float32)
        threads, tiles, _, _ = loader.rmsnorm_backward_launch(N, width, dtype.itemsize, warp, SM_COUNT)
        kernel("btp", f"btp_backward_post_{suffix}", warp)(
            tiles * 3, threads, (cudaemu.DeviceArray(dxw), cudaemu.DeviceArray(x), cudaemu.DeviceArray(w),
                                 cudaemu.DeviceArray(ds), DX, DX, P, np.int32(N), np.int32(width), np.int32(2),
                                 np.int32(0)))
        dw_ref = np.zeros(width)
        dx_ref = layers.btp_norm_backward_post(f64(dxw), f64(x), f64(w), f64(ds)[:, None], dw_ref)
        assert_close(DX.get().reshape(N, width), stored(dx_ref, dtype), dtype, f"dx C={width}")
        assert_close(P.get().reshape(3, width).sum(axis=0), dw_ref, np.float32, f"dw C={width}")


@pytest.mark.parametrize("warp", WARPS)
@pytest.mark.parametrize("device_scalars", [False, True], ids=["by-value", "read-from-device"])
def test_adamw_step_matches_the_update(warp, device_scalars):
    """AdamW over a flat slice, in float64 from the same inputs (boostmpi/train/optim.py's formulas):
    the per-step numbers passed by value, or read from device memory with the clipping scale computed
    there from the squared gradient norm (the entry point a CUDA graph replays)."""
    suffix = "f32"
    for n in (3000, 1027):  # vectorised + strided grid, and a scalar tail
        p, g = random(n, np.float32, 31), random(n, np.float32, 32)
        m, v = random(n, np.float32, 33, 0.1), np.abs(random(n, np.float32, 34, 0.1))
        bounds = np.array([5, 700, 1000, 1020], np.int64)
        P, M, V = cudaemu.DeviceArray(p), cudaemu.DeviceArray(m), cudaemu.DeviceArray(v)
        lr, b1, b2, eps, wd, t = 1e-2, 0.9, 0.95, 1e-8, 0.1, 3
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        common = (P, cudaemu.DeviceArray(g), M, V, np.int64(n), cudaemu.DeviceArray(bounds), np.int32(4),
                  np.float32(b1), np.float32(1 - b1), np.float32(b2), np.float32(1 - b2), np.float32(eps))
        grid = (loader._elementwise_grid(n, 4, SM_COUNT), loader.ELEMENTWISE_BLOCK_THREADS)
        if device_scalars:  # |g| = 3 clipped to 1: the scale 1 / (3 + 1e-6)
            scale = 1.0 / (3.0 + 1e-6)
            scalars = np.array([lr * wd, lr / bc1, np.sqrt(bc2)], np.float32)
            kernel("adamw", f"adamw_step_device_{suffix}", warp)(*grid, common + (
                cudaemu.DeviceArray(scalars), cudaemu.DeviceArray(np.array([9.0])), np.float64(1.0)))
        else:
            scale = 0.5
            kernel("adamw", f"adamw_step_{suffix}", warp)(*grid, common + (
                np.float32(lr * wd), np.float32(scale), np.float32(lr / bc1), np.float32(np.sqrt(bc2))))
        gs = f64(g) * scale
        m_ref, v_ref = b1 * f64(m) + (1 - b1) * gs, b2 * f64(v) + (1 - b2) * gs * gs
        decay = np.zeros(n, bool)
        decay[5:700] = decay[1000:1020] = True
        p_ref = f64(p) - np.where(decay, lr * wd * f64(p), 0.0)
        p_ref -= m_ref / (np.sqrt(v_ref) / np.sqrt(bc2) + eps) * (lr / bc1)
        assert_close(M.get(), m_ref, np.float32, f"m n={n}")
        assert_close(V.get(), v_ref, np.float32, f"v n={n}")
        assert_close(P.get(), p_ref, np.float32, f"p n={n}")


@pytest.mark.parametrize("warp", WARPS)
def test_sum_squares_ranges_matches_the_norm(warp):
    """The gradient norm's sum of squares over ranges of a flat slice, per block, in float64 from the
    same inputs; ranges off vector boundaries, an empty one, one ending at the slice's end."""
    suffix = "f32"
    for n, grid in ((3000, 3), (1027, 1)):  # blocks striding over several ranges, and one block
        g = random(n, np.float32, 35)
        ranges = [(5, 700), (700, 700), (1000, 1020), (n - 7, n)]
        P = cudaemu.DeviceArray(shape=grid, dtype=np.float32)
        kernel("adamw", f"sum_squares_ranges_{suffix}", warp)(
            grid, loader.ELEMENTWISE_BLOCK_THREADS,
            (cudaemu.DeviceArray(g), cudaemu.DeviceArray(np.array(ranges, np.int64).reshape(-1)), np.int32(len(ranges)), P))
        threads = grid * loader.ELEMENTWISE_BLOCK_THREADS
        want = np.zeros(grid)
        for a, b in ranges:
            for i in range(a, b):
                want[(i - a) % threads // loader.ELEMENTWISE_BLOCK_THREADS] += f64(g[i]) ** 2
        assert_close(P.get(), want, np.float32, f"partials n={n}")


def _xent_reference(logits, targets, scale):
    lf = f64(logits)
    m = lf.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(lf - m).sum(axis=1, keepdims=True)))[:, 0]
    valid = (targets >= 0) & (targets < lf.shape[1])
    rows = np.arange(len(targets))
    loss = np.where(valid, lse - lf[rows, np.where(valid, targets, 0)], np.nan)
    grad = np.exp(lf - lse[:, None])
    grad[rows[valid], targets[valid]] -= 1.0
    return loss, grad * scale


@pytest.mark.parametrize("warp", WARPS)
@pytest.mark.parametrize("suffix", DTYPES)
def test_softmax_xent(warp, suffix):
    dtype = DTYPES[suffix]
    for V in (96, 45):
        N = 4
        logits = random((N, V), dtype, 11, 4.0)
        for itype, isuffix in ((np.int32, "i32"), (np.int64, "i64")):
            targets = np.array([0, V - 1, 7, -1], itype)  # -1: bad data, NaN loss
            loss_ref, grad_ref = _xent_reference(logits, targets, 0.25)
            fn = kernel("softmax_xent", f"softmax_xent_{suffix}_{isuffix}", warp)
            L, T = cudaemu.DeviceArray(shape=N, dtype=np.float32), cudaemu.DeviceArray(targets)
            # into a second buffer, then in place
            X, D = cudaemu.DeviceArray(logits), cudaemu.DeviceArray(shape=(N, V), dtype=dtype)
            for out in (D, X):
                fn(N, row_block(V, dtype, warp), (X, T, L, out, np.int32(1), np.int32(V), np.float32(0.25)))
                np.testing.assert_allclose(L.get(), loss_ref, rtol=2e-5, atol=1e-5, err_msg=f"loss V={V}")
                assert_close(out.get(), stored(grad_ref, dtype), dtype, f"dlogits V={V}")
            # loss only: dlogits untouched
            X = cudaemu.DeviceArray(logits)
            fn(N, row_block(V, dtype, warp), (X, T, L, X, np.int32(0), np.int32(V), np.float32(0.0)))
            np.testing.assert_array_equal(X.get().view(np.uint8), logits.view(np.uint8))
            np.testing.assert_allclose(L.get(), loss_ref, rtol=2e-5, atol=1e-5)


def test_bf16_parity_sees_truncation_instead_of_rounding():
    """The bf16 checks are tight enough to tell round-to-nearest-even from truncation."""
    code = mutated("rmsnorm", "    u += 0x7fffu + ((u >> 16) & 1u);\n", "")
    N, C = 4, 64
    x, w = random((N, C), BF16, 30), random(C, BF16, 31)
    X, W, Y, R = cudaemu.DeviceArray(x), cudaemu.DeviceArray(w), cudaemu.DeviceArray(shape=(N, C), dtype=BF16), \
        cudaemu.DeviceArray(shape=N, dtype=np.float32)
    y_ref = layers.rmsnorm_forward(f64(x), f64(w), EPS)[0]
    kernel("rmsnorm", "rmsnorm_forward_bf16")(N, 32, (X, W, Y, R, np.int32(C), np.float32(EPS)))
    assert_close(Y.get(), y_ref, BF16, "rounded")
    kernel("rmsnorm", "rmsnorm_forward_bf16", code=code)(N, 32, (X, W, Y, R, np.int32(C), np.float32(EPS)))
    with pytest.raises(AssertionError, match="not equal"):
        assert_close(Y.get(), y_ref, BF16, "truncated")


def test_every_entry_point_is_exercised():
    """Every extern "C" entry point of kernels/*.cu is launched by a test above."""
    source = open(__file__).read()
    source += (Path(__file__).resolve().parents[2] / "kernels" / "attention" / "test_attention_kernel.py").read_text()  # attention: at warp 32 and 64 there
    # attention's names carry {hd}: "hd64_" for the entry points of head dims up to 64, launched there too,
    # and {tc}: "tc_" where the tensor-core variant runs instead (test_attention_tensor_cores.py checks those)
    launched = set(re.findall(r'"(\w+)_(?:\{tc\})?(?:\{hd\})?\{suffix\}', source)) | {"softmax_xent"}
    for path in sorted(loader.kernels_dir().glob("*.cu")):
        for name in _module(loader.kernel_source(path.stem), 32, path.stem).entry_points:
            base = re.sub(r"(_hd64)?_(f32|bf16)(_i32|_i64)?$", "", name)
            assert base in launched, f"{path.name}: {name} is not launched by test_cudaemu.py"


# ------------------------------------------------------------------------------ (b) it can fail

def _forward_args(N, C, dtype=np.float32, x_elems=None, y_elems=None):
    x = random(x_elems if x_elems is not None else N * C, dtype, 12)
    return (cudaemu.DeviceArray(x), cudaemu.DeviceArray(random(C, dtype, 13)), cudaemu.DeviceArray(shape=y_elems or N * C, dtype=dtype),
            cudaemu.DeviceArray(shape=N, dtype=np.float32), np.int32(C), np.float32(EPS))


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_removing_the_barrier_before_the_partials_are_read_is_a_race(seed):
    code = mutated("rmsnorm", "    __syncthreads();\n    float total = warp_partials[0];",
                   "    float total = warp_partials[0];")
    with cudaemu.schedule(seed), pytest.raises(cudaemu.RaceError, match=r"warp_partials.*no __syncthreads\(\) between"):
        kernel("rmsnorm", "rmsnorm_forward_f32", code=code)(2, 64, _forward_args(2, 64))
    # the unmodified text runs clean under the same launch
    kernel("rmsnorm", "rmsnorm_forward_f32")(2, 64, _forward_args(2, 64))


# block_sum called once per row of a block that strides over rows (no kernel of kernels/ does so
# now: each row kernel reduces one row per block, and block_max and block_sum, being separate
# instantiations, have separate buffers)
BLOCK_SUMS = r"""
extern "C" __global__ void block_sums(const float* x, float* out, int rows) {
    for (int row = 0; row < rows; ++row) {
        const float total = block_sum(x[row * blockDim.x + threadIdx.x]);
        if (threadIdx.x == 0) out[row] = total;
    }
}
"""


def test_removing_the_barrier_that_protects_reuse_is_a_race():
    """block_sum called once per row: without the second barrier, the next row's partials are
    written while slower threads still read this row's."""
    code = mutated("rmsnorm", "__syncthreads();  // warp_partials is reused", "// warp_partials is reused")
    rows, block = 3, 64
    x = random((rows, block), np.float32, 14)
    out = cudaemu.DeviceArray(shape=rows, dtype=np.float32)
    args = (cudaemu.DeviceArray(x), out, np.int32(rows))
    with pytest.raises(cudaemu.RaceError, match="warp_partials"):
        _module(code + BLOCK_SUMS, 32, "rmsnorm").get_function("block_sums")(1, block, args)
    _module(loader.kernel_source("rmsnorm") + BLOCK_SUMS, 32, "rmsnorm").get_function("block_sums")(1, block, args)
    np.testing.assert_allclose(out.get(), x.sum(axis=1), rtol=1e-5)


def test_reading_the_target_logit_after_the_in_place_gradient_starts_is_a_global_race():
    """softmax_xent reads row[target] before the reductions because, in place, other threads
    overwrite the row after them; reading it late races with those writes."""
    code = mutated("softmax_xent", "*loss_out = target_valid ? logsumexp - target_logit : nan;",
                   "*loss_out = target_valid ? logsumexp - to_float(logits[target]) : nan;")
    N, V = 2, 256
    logits = random((N, V), np.float32, 23)
    targets = cudaemu.DeviceArray(np.array([200, 3], np.int32))
    loss = cudaemu.DeviceArray(shape=N, dtype=np.float32)
    fn = kernel("softmax_xent", "softmax_xent_f32_i32", code=code)
    X, D = cudaemu.DeviceArray(logits), cudaemu.DeviceArray(shape=(N, V), dtype=np.float32)
    fn(N, 64, (X, targets, loss, D, np.int32(1), np.int32(V), np.float32(1.0)))  # out of place: no race
    with pytest.raises(cudaemu.RaceError, match=r"global-memory race .* with no __syncthreads\(\) between"):
        fn(N, 64, (X, targets, loss, X, np.int32(1), np.int32(V), np.float32(1.0)))


def _backward_args(N, C, chunks, seed):
    """rmsnorm_backward's arguments: random dy, x, w, rstd 1, proj 0.5; dw_partial of `chunks` rows."""
    return (cudaemu.DeviceArray(random((N, C), np.float32, seed)), cudaemu.DeviceArray(random((N, C), np.float32, seed + 1)),
            cudaemu.DeviceArray(random(C, np.float32, seed + 2)), cudaemu.DeviceArray(np.ones(N, np.float32)),
            cudaemu.DeviceArray(np.full(N, 0.5, np.float32)), cudaemu.DeviceArray(shape=(N, C), dtype=np.float32),
            cudaemu.DeviceArray(shape=(chunks, C), dtype=np.float32), np.int32(N), np.int32(C), np.int32(-(-N // chunks)))


def test_blocks_writing_one_partial_row_is_a_global_race():
    code = mutated("rmsnorm", "dw_partial + static_cast<long long>(tile.chunk) * C + tile.j,", "dw_partial + tile.j,")
    args = _backward_args(4, 64, 2, 24)
    kernel("rmsnorm", "rmsnorm_backward_f32")(2, 32, args)
    with pytest.raises(cudaemu.RaceError, match="in another block"):
        kernel("rmsnorm", "rmsnorm_backward_f32", code=code)(2, 32, args)


@pytest.mark.parametrize("bad, expected", [
    (64, r"argument 4 \(int C\) gets a Python int \(passed as long long\)"),
    (np.int64(64), r"argument 4 \(int C\) gets numpy.int64"),
    (np.uint32(64), r"argument 4 \(int C\) gets numpy.uint32"),
])
def test_a_scalar_of_the_wrong_c_type_is_refused(bad, expected):
    args = list(_forward_args(2, 64))
    args[4] = bad
    with pytest.raises(cudaemu.LaunchError, match=expected):
        kernel("rmsnorm", "rmsnorm_forward_f32")(2, 64, tuple(args))


def test_other_argument_mismatches_are_refused():
    fn = kernel("rmsnorm", "rmsnorm_forward_f32")
    good = _forward_args(2, 64)
    for index, bad, expected in [
        (5, 1e-6, r"argument 5 \(float eps\) gets a Python float \(passed as double\)"),
        (5, np.float64(1e-6), r"argument 5 \(float eps\) gets numpy.float64"),
        (0, cudaemu.DeviceArray(np.zeros(128, np.float64)), r"argument 0 \(const float\* x\) gets an array of float64"),
        (0, np.zeros(128, np.float32), r"argument 0 \(const float\* x\) needs a device array"),
        (0, 12345, r"argument 0 \(const float\* x\) needs a device array, got a Python int"),
    ]:
        args = list(good)
        args[index] = bad
        with pytest.raises(cudaemu.LaunchError, match=expected):
            fn(2, 64, tuple(args))
    with pytest.raises(cudaemu.LaunchError, match="5 arguments for 6 parameters"):
        fn(2, 64, good[:5])
    # bf16 storage passed float32 arrays: the element sizes differ
    with pytest.raises(cudaemu.LaunchError, match=r"the kernel reads bf16 \(2 bytes\)"):
        kernel("rmsnorm", "rmsnorm_forward_bf16")(2, 64, good)
    with pytest.raises(cudaemu.LaunchError, match="block"):
        fn(2, 2048, good)


def test_a_freed_buffer_is_refused_and_double_free_raises():
    args = _forward_args(2, 64)
    args[1].buf.free()
    with pytest.raises(cudaemu.LaunchError, match="not inside a live device allocation"):
        kernel("rmsnorm", "rmsnorm_forward_f32")(2, 64, args)
    with pytest.raises(cudaemu.AllocationError, match="freed twice"):
        args[1].buf.free()


@pytest.mark.parametrize("C", [64, 63])  # 16-byte vector loads and scalar loads
def test_reading_one_element_past_an_allocation_is_reported(C):
    args = _forward_args(2, C, x_elems=2 * C - 1)
    with pytest.raises(cudaemu.GlobalBoundsError, match=r"out-of-bounds global read .* past the end of the (500|508)-byte"):
        kernel("rmsnorm", "rmsnorm_forward_f32")(2, 32, args)


def test_writing_one_element_past_an_allocation_is_reported():
    args = _forward_args(2, 63, y_elems=2 * 63 - 1)
    with pytest.raises(cudaemu.GlobalBoundsError, match=r"out-of-bounds global write of 4 bytes.*past the end"):
        kernel("rmsnorm", "rmsnorm_forward_f32")(2, 32, args)


class _Offset:
    """A view `elements` into a device array, as a CuPy slice's .data.ptr is."""

    def __init__(self, array, elements):
        self.dtype, self.data = array.dtype, self
        self.ptr = array.data.ptr + elements * array.dtype.itemsize


def test_a_16_byte_load_from_a_misaligned_pointer_is_reported():
    """The row kernels fall back to scalar loads when a pointer is not 16-byte aligned; without
    that check a GPU faults on the misaligned vector load, and so does the harness."""
    args = list(_forward_args(2, 64, x_elems=2 * 64 + 1))
    args[0] = _Offset(args[0], 1)
    kernel("rmsnorm", "rmsnorm_forward_f32")(2, 32, tuple(args))  # scalar path
    code = mutated("rmsnorm", "vectorised = C % V == 0 && aligned16(x) && aligned16(w) && aligned16(y);",
                   "vectorised = C % V == 0;")
    with pytest.raises(cudaemu.GlobalBoundsError, match="misaligned 16-byte read"):
        kernel("rmsnorm", "rmsnorm_forward_f32", code=code)(2, 32, tuple(args))


def test_too_little_dynamic_shared_memory_is_a_shared_bounds_error():
    """No kernel of kernels/ takes dynamic shared memory; a synthetic one given a float too few."""
    module = _module('extern "C" __global__ void fill(float* out) {\n'
                     '    extern __shared__ float d[];\n    d[threadIdx.x] = 1.0f;\n    out[threadIdx.x] = d[threadIdx.x];\n}\n', 32)
    out = cudaemu.DeviceArray(shape=32, dtype=np.float32)
    module.get_function("fill")(1, 32, (out,), shared_mem=4 * 32)
    with pytest.raises(cudaemu.SharedBoundsError, match="past the end of `extern __shared__"):
        module.get_function("fill")(1, 32, (out,), shared_mem=4 * 32 - 4)


def test_an_early_return_before_the_reduction_is_a_deadlock():
    # the row held in registers (the forward's path for this row): threads past the row's end leave early
    code = mutated("rmsnorm", "    float sum_squares = 0.0f;\n#pragma unroll\n    for (int r = 0; r < R; ++r) {",
                   "    if (threadIdx.x * V >= C) return; float sum_squares = 0.0f;\n#pragma unroll\n"
                   "    for (int r = 0; r < R; ++r) {")
    with pytest.raises((cudaemu.DeadlockError, cudaemu.PartialWarpError), match="exited"):
        kernel("rmsnorm", "rmsnorm_forward_f32", code=code)(1, 64, _forward_args(1, 40))


@pytest.mark.parametrize("warp, block", [(32, 48), (64, 96), (64, 32)])
def test_a_block_of_partial_warps_is_a_partial_warp_shuffle(warp, block):
    with pytest.raises(cudaemu.PartialWarpError, match="partial warp"):
        kernel("rmsnorm", "rmsnorm_forward_f32", warp)(2, block, _forward_args(2, 64))


def test_a_warp_partial_not_written_is_an_uninitialised_shared_read():
    code = mutated("rmsnorm", "if (threadIdx.x % WARP_SIZE == 0) warp_partials[warp] = v;",
                   "if (threadIdx.x == 0) warp_partials[warp] = v;")
    with pytest.raises(cudaemu.UninitializedSharedRead, match=r"`warp_partials` \(byte 4\)"):
        kernel("rmsnorm", "rmsnorm_forward_f32", code=code)(1, 64, _forward_args(1, 64))


def test_error_messages_name_the_source_line():
    args = _forward_args(2, 63, x_elems=2 * 63 - 1)
    with pytest.raises(cudaemu.GlobalBoundsError) as info:
        kernel("rmsnorm", "rmsnorm_forward_f32")(2, 32, args)
    message = str(info.value)
    line = int(re.search(r"at line (\d+) of the kernel source", message).group(1))
    assert "p[0]" in loader.kernel_source("rmsnorm").splitlines()[line - 1]  # load_vec<1>'s element read
    assert "rmsnorm_forward_f32" in message and "thread" in message and "block (1,0,0)" in message


SYNTHETIC = r"""
extern "C" __global__ void write_neighbour(float* out, int sync) {
    __shared__ float s[64];
    s[threadIdx.x] = threadIdx.x;
    if (sync) __syncthreads();
    out[threadIdx.x] = s[(threadIdx.x + 1) % blockDim.x];
}
extern "C" __global__ void two_writers(float* out) {
    __shared__ float s[1];
    if (threadIdx.x < 2) s[0] = threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = s[0];
}
extern "C" __global__ void read_unwritten(float* out) {
    __shared__ float s[64];
    if (threadIdx.x > 0) s[threadIdx.x] = 1.0f;
    __syncthreads();
    out[threadIdx.x] = s[0];
}
extern "C" __global__ void index_shared(float* out, int offset) {
    __shared__ float s[32];
    s[threadIdx.x] = 1.0f;
    __syncthreads();
    out[threadIdx.x] = s[(int)threadIdx.x + offset];
}
extern "C" __global__ void half_at_barrier(float* out) {
    if (threadIdx.x < 16) return;
    __syncthreads();
    out[threadIdx.x] = 1.0f;
}
extern "C" __global__ void different_barriers(float* out) {
    if (threadIdx.x < 16)
        __syncthreads();
    else
        __syncthreads();
    out[threadIdx.x] = 1.0f;
}
extern "C" __global__ void swap_neighbours(float* out, unsigned int mask) {
    out[threadIdx.x] = __shfl_xor_sync(mask, (float)threadIdx.x, 1);
}
extern "C" __global__ void shuffle_after_exit(float* out) {
    if (threadIdx.x == 5) return;
    out[threadIdx.x] = __shfl_down_sync(0xffffffffu, (float)threadIdx.x, 1);
}
extern "C" __global__ void copy_shifted(const float* in, float* out, int shift) {
    out[threadIdx.x] = in[(int)threadIdx.x + shift];
}
"""


def synthetic(name, warp=32):
    return _module(SYNTHETIC, warp).get_function(name)


def test_synthetic_kernels_report_each_error_class():
    out = cudaemu.DeviceArray(shape=64, dtype=np.float32)
    synthetic("write_neighbour")(1, 64, (out, np.int32(1)))
    np.testing.assert_array_equal(out.get(), (np.arange(64) + 1) % 64)
    with pytest.raises(cudaemu.RaceError, match=r"thread \d+ (writes it, thread \d+ read it|reads it, thread \d+ wrote it)"):
        synthetic("write_neighbour")(1, 64, (out, np.int32(0)))
    with pytest.raises(cudaemu.RaceError, match=r"thread [01] writes it, thread [01] wrote it"):
        synthetic("two_writers")(1, 32, (out,))
    with pytest.raises(cudaemu.UninitializedSharedRead, match="`s` \\(byte 0\\)"):
        synthetic("read_unwritten")(1, 32, (out,))
    synthetic("index_shared")(1, 32, (out, np.int32(0)))
    with pytest.raises(cudaemu.SharedBoundsError, match="0 bytes past the end of `s`"):
        synthetic("index_shared")(1, 32, (out, np.int32(1)))
    with pytest.raises(cudaemu.SharedBoundsError, match="4 bytes before `s`"):
        synthetic("index_shared")(1, 32, (out, np.int32(-1)))
    with pytest.raises(cudaemu.DeadlockError, match=r"threads 16-31 wait at __syncthreads\(\).*threads 0-15 have exited"):
        synthetic("half_at_barrier")(1, 32, (out,))
    with pytest.raises(cudaemu.DeadlockError, match="different __syncthreads"):
        synthetic("different_barriers")(1, 32, (out,))
    synthetic("swap_neighbours")(1, 32, (out, np.uint32(0xFFFFFFFF)))
    np.testing.assert_array_equal(out.get()[:32], np.arange(32) ^ 1)
    with pytest.raises(cudaemu.PartialWarpError, match="partial warp"):
        synthetic("swap_neighbours")(1, 24, (out, np.uint32(0xFFFFFFFF)))
    with pytest.raises(cudaemu.PartialWarpError, match="leaves it out"):
        synthetic("swap_neighbours")(1, 32, (out, np.uint32(0x0000FFFF)))
    with pytest.raises(cudaemu.PartialWarpError, match="exited"):
        synthetic("shuffle_after_exit")(1, 32, (out,))
    src = cudaemu.DeviceArray(np.arange(32, dtype=np.float32))
    synthetic("copy_shifted")(1, 32, (src, out, np.int32(0)))
    with pytest.raises(cudaemu.GlobalBoundsError, match="4 bytes before"):
        synthetic("copy_shifted")(1, 32, (src, out, np.int32(-1)))
    src.buf.free()
    with pytest.raises(cudaemu.LaunchError, match="not inside a live device allocation"):
        synthetic("copy_shifted")(1, 32, (src, out, np.int32(0)))


def test_warp64_shuffles_span_the_wavefront():
    out = cudaemu.DeviceArray(shape=64, dtype=np.float32)
    code = SYNTHETIC + r"""
extern "C" __global__ void reduce_wavefront(float* out) {
    float v = threadIdx.x;
    for (int o = warpSize / 2; o > 0; o >>= 1) v += __shfl_xor(v, o);
    out[threadIdx.x] = v;
}
"""
    _module(code, 64).get_function("reduce_wavefront")(1, 64, (out,))
    np.testing.assert_array_equal(out.get(), np.full(64, sum(range(64))))


def test_unsupported_shared_declaration_is_a_clear_compile_error():
    with pytest.raises(cudaemu.CompileError, match="cannot instrument the __shared__ declaration on line 2"):
        cudaemu.Module('extern "C" __global__ void k(float* o) {\n  __shared__ float a[4], b[4];\n}\n')


def test_signatures_are_read_after_preprocessing():
    entries = cudaemu.entry_points(
        'extern "C" __global__ void a(const float* __restrict__ x, unsigned int, long long n, bf16* y) {}\n'
        'extern "C" __global__ void b(void) {}\n__global__ void not_extern_c(int k) {}\n')
    assert sorted(entries) == ["a", "b"] and entries["b"] == []
    x, count, n, y = entries["a"]
    assert (x.name, x.is_pointer, x.pointee_dtype) == ("x", True, "float32")
    assert (count.name, count.dtype) == ("", "uint32")
    assert (n.name, n.dtype) == ("n", "int64")
    assert (y.is_pointer, y.pointee, y.pointee_dtype) == (True, "bf16", None)


def test_file_scope_shared_memory_is_refused():
    with pytest.raises(cudaemu.CompileError, match="`__shared__ buffer` .* is at file scope"):
        cudaemu.Module('__shared__ float buffer[32];\nextern "C" __global__ void k(float* o) { o[0] = buffer[0]; }\n')


def test_unknown_function_and_bad_warp_size():
    mod = _module(SYNTHETIC, 32)
    with pytest.raises(KeyError, match="no extern \"C\" __global__ function 'nope'"):
        mod.get_function("nope")
    with pytest.raises(cudaemu.CompileError, match="WARP_SIZE=48"):
        cudaemu.Module(SYNTHETIC, ("-DWARP_SIZE=48",))


def test_allocations_guard_and_host_view():
    buf = cudaemu.alloc(10)
    assert buf.ptr % 256 == 0 and buf.nbytes == 10 and buf.host.shape == (10,)
    buf.host[:] = 7
    before = cudaemu.live_bytes()
    buf.free()
    assert cudaemu.live_bytes() == before - 10
    with pytest.raises(cudaemu.AllocationError, match="after it was freed"):
        buf.host


# ------------------------------------------------------------------------------ (c) schedules

def test_seeded_schedules_give_the_same_bits():
    N, C = 5, 72
    x, dy, w = random((N, C), np.float32, 20), random((N, C), np.float32, 21), random(C, np.float32, 22)
    results = []
    for seed in (None, 1, 2, 3):
        with cudaemu.schedule(seed):
            assert cudaemu.current_seed() == seed
            X, DY, W = cudaemu.DeviceArray(x), cudaemu.DeviceArray(dy), cudaemu.DeviceArray(w)
            R, PROJ = cudaemu.DeviceArray(np.ones(N, np.float32)), cudaemu.DeviceArray(shape=N, dtype=np.float32)
            kernel("rmsnorm", "rmsnorm_projection_f32")(N, 64, (DY, X, W, R, PROJ, np.int32(C)))
            DX, P = cudaemu.DeviceArray(shape=(N, C), dtype=np.float32), cudaemu.DeviceArray(shape=(2, C), dtype=np.float32)
            kernel("rmsnorm", "rmsnorm_backward_f32")(2, 32, (DY, X, W, R, PROJ, DX, P, np.int32(N), np.int32(C), np.int32(3)))
            L = cudaemu.DeviceArray(shape=N, dtype=np.float32)
            kernel("softmax_xent", "softmax_xent_f32_i32")(N, 64, (X, cudaemu.DeviceArray(np.arange(N, dtype=np.int32)), L, X,
                                                                   np.int32(1), np.int32(C), np.float32(1.0)))
            results.append((PROJ.get(), DX.get(), P.get(), L.get(), X.get()))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


def test_seed_from_environment(monkeypatch):
    monkeypatch.setenv(cudaemu.SEED_ENV, "17")
    assert cudaemu._seed_from_env() == 17
    monkeypatch.setenv(cudaemu.SEED_ENV, "random")
    assert isinstance(cudaemu._seed_from_env(), int)
    monkeypatch.setenv(cudaemu.SEED_ENV, "")
    assert cudaemu._seed_from_env() is None
    monkeypatch.setenv(cudaemu.SEED_ENV, "x1")
    with pytest.raises(ValueError, match="BOOSTMPI_CUDAEMU_SEED"):
        cudaemu._seed_from_env()
    with pytest.raises(TypeError):
        cudaemu.set_schedule("3")


# ------------------------------------------------------------------------------ what NVRTC would see

HOST_CONSTANT = ("softmax_xent", "return __uint_as_float(0xff800000u);", "return -INFINITY;")


def test_a_host_header_constant_does_not_compile_on_the_harness():
    """The text sees what NVRTC/hipRTC provide, not <cmath>: -INFINITY fails as it does there
    (tests/kernels/test_kernel_resources.py runs the same mutant through NVRTC and hipRTC)."""
    with pytest.raises(cudaemu.CompileError, match="INFINITY"):
        cudaemu.Module(mutated(*HOST_CONSTANT), loader.COMPILE_OPTIONS + ("-DWARP_SIZE=32",))
    with pytest.raises(cudaemu.CompileError, match="cmath"):
        cudaemu.Module('#include <cmath>\n' + loader.kernel_source("lowrank"), loader.COMPILE_OPTIONS)
    with pytest.raises(cudaemu.CompileError, match="uint32_t"):
        cudaemu.Module('extern "C" __global__ void k(float* o) { uint32_t i = threadIdx.x; o[i] = 0.0f; }')


# ------------------------------------------------------------------------------ read-modify-write of unwritten shared memory

ACCUMULATE = r"""
extern "C" __global__ void static_unwritten(float* out) {
    __shared__ float s[64];
    s[threadIdx.x] += 1.0f;
    __syncthreads();
    out[threadIdx.x] = s[threadIdx.x];
}
extern "C" __global__ void dynamic_unwritten(float* out) {
    extern __shared__ float d[];
    d[threadIdx.x] += 1.0f;
    out[threadIdx.x] = d[threadIdx.x];
}
extern "C" __global__ void static_written(float* out) {
    __shared__ float s[64];
    s[threadIdx.x] = 1.0f;
    s[threadIdx.x] += 1.0f;
    out[threadIdx.x] = s[threadIdx.x];
}
"""


@pytest.mark.parametrize("warp", WARPS)
def test_accumulating_onto_never_written_shared_memory_is_reported(warp):
    out = cudaemu.DeviceArray(shape=64, dtype=np.float32)
    module = _module(ACCUMULATE, warp)
    module.get_function("static_written")(1, 64, (out,))
    np.testing.assert_array_equal(out.get(), 2.0)
    with pytest.raises(cudaemu.UninitializedSharedRead, match=r"read of shared `s` \(byte 0\)"):
        module.get_function("static_unwritten")(1, 64, (out,))
    with pytest.raises(cudaemu.UninitializedSharedRead, match=r"extern __shared__ \(dynamic\)"):
        module.get_function("dynamic_unwritten")(1, 64, (out,), shared_mem=256)
