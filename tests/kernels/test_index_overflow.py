"""32-bit index arithmetic in the kernels, at tensors of more than 2^32 elements.

The paper's largest shapes: logits of a 128,256-token vocabulary over 16,384 tokens per rank are
2,101,346,304 elements, 97.9% of 2^31, so `int` row x row-length arithmetic passes there and breaks
at 2.2% more tokens; d_ff 53,248 x 16,384 tokens is 0.87 x 10^9 elements. The check therefore
launches every kernel at the paper's row lengths (vocabulary 128,256, d_model 16,384, rank 4,096)
with enough rows that rows x row length passes 2^32, the elementwise kernels over 2^32 + 7
elements, and attention and RoPE with q [B, T, H, Dh] past 2^32 elements at the largest model's
heads, beyond what 32-bit arithmetic, signed or unsigned, can index.

How, without 17 GB per tensor: the harness (testing/cudaemu) runs only the blocks that reach the
largest indices (`blocks=[...]`) over allocations of the full logical size (reserved address
space, backed only where the block touches it), and
  - an `int` product or sum that overflows is an IntegerOverflowError naming the source line
    (the harness compiles the text with GCC's -fsanitize=signed-integer-overflow);
  - a 32-bit unsigned product that wraps silently reads and writes another row: the outputs of the
    last row (the last elements) are compared with the NumPy layers, so that fails too.
The row kernels run one block per row, as the loader launches them; rmsnorm_backward runs its
column tiles over chunks of one row (the loader's chunks hold ~N / (8 x SMs / tiles) rows; one-row
chunks reach the same row offsets, and dw partial offsets past 2^32, without running a block over
10^3 rows). Mutation tests at the end put each kind of overflow in.
"""

import numpy as np
import pytest

from testing import cudaemu
from boostmpi.gpu import kernels as loader
from boostmpi.gpu import launch_plan
from boostmpi.model import layers

pytestmark = pytest.mark.gpu

ml_dtypes = pytest.importorskip("ml_dtypes")
DTYPES = {"f32": np.dtype(np.float32), "bf16": np.dtype(ml_dtypes.bfloat16)}
WARPS = cudaemu.WARP_SIZE_OPTIONS
LIMIT = 2 ** 32
VOCAB, D_MODEL, RANK = 128256, 16384, 4096  # the paper's largest model (see test_kernel_resources.PAPER)
ELEMENTS = LIMIT + 7  # elementwise kernels: a scalar tail after the 16-byte vectors
EPS = 1e-6


def rows_for(width):
    """Rows enough that rows x width passes 2^32."""
    return LIMIT // width + 1


# attention and RoPE at the largest model's heads (128 query heads, 8 key/value heads of 128 dims,
# Llama-3-405B's) and a short sequence that no tile divides, with a batch enough that q's
# B x T x H x Dh passes 2^32 (the last batch straddles it)
ATTN_T, ATTN_H, ATTN_HKV, ATTN_DH = 40, 128, 8, 128
ATTN_B = LIMIT // (ATTN_T * ATTN_H * ATTN_DH) + 1
LARGEST = max(rows_for(w) * w for w in (VOCAB, D_MODEL, RANK))
LARGEST = max(LARGEST, ELEMENTS, ATTN_B * ATTN_T * ATTN_H * ATTN_DH)


class Tensor:
    """A kernel argument over one of the pool's buffers, as the harness takes it (.data.ptr, .dtype)."""

    def __init__(self, buf, shape, dtype):
        self.data, self.shape, self.dtype = buf, shape, np.dtype(dtype)
        assert int(np.prod(shape)) * self.dtype.itemsize <= buf.nbytes

    def flat(self, start, stop):
        """Elements [start, stop) as a writable NumPy view."""
        size = self.dtype.itemsize
        return self.data.host[start * size:stop * size].view(self.dtype)

    def row(self, i):
        return self.flat(i * self.shape[1], (i + 1) * self.shape[1])


@pytest.fixture(scope="module")
def pool():
    """Five buffers of 4-byte elements enough for the largest tensor (17 GB each, of address
    space), shared by the tests of this module and freed after them."""
    buffers = [cudaemu.alloc(LARGEST * 4) for _ in range(5)]
    yield buffers
    for b in buffers:
        b.free()


@pytest.fixture(scope="module")
def small():
    """Small device arrays made by the tests, freed after them."""
    made = []

    def make(host):
        arr = cudaemu.DeviceArray(np.ascontiguousarray(host))
        made.append(arr)
        return arr

    yield make
    for arr in made:
        arr.buf.free()


def function(file, entry, code=None, warp=32):
    return cudaemu.Module(code if code is not None else loader.kernel_source(file),
                          loader.compile_options(file, warp)).get_function(entry)


def random(shape, dtype, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


def assert_close(got, want, dtype, what):
    got, want = np.asarray(got, np.float64), np.asarray(np.asarray(want).astype(dtype), np.float64)
    rtol = 1e-4 if dtype == np.float32 else 2 ** -7
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max(), err_msg=what)


# ------------------------------------------------------------------------------ the row kernels


def run_softmax_xent(pool, small, suffix, code=None, warp=32):
    dtype_name, target_name = suffix.split("_")
    dtype, target_dtype = DTYPES[dtype_name], np.dtype(np.int32 if target_name == "i32" else np.int64)
    N, V = rows_for(VOCAB), VOCAB
    logits = Tensor(pool[0], (N, V), dtype)
    targets, loss = Tensor(pool[1], (N,), target_dtype), Tensor(pool[2], (N,), np.float32)
    row = random(V, dtype, 1, 4.0)
    logits.row(N - 1)[:] = row
    targets.flat(N - 1, N)[:] = V - 3
    scale = 0.5
    function("softmax_xent", f"softmax_xent_{suffix}", code, warp)(
        N, loader._row_block(V, dtype.itemsize, warp), (logits, targets, loss, logits, np.int32(1), np.int32(V),
                                                      np.float32(scale)), blocks=[N - 1])
    x = row.astype(np.float64)
    logsumexp = x.max() + np.log(np.exp(x - x.max()).sum())
    grad = np.exp(x - logsumexp)
    grad[V - 3] -= 1.0
    assert_close(loss.flat(N - 1, N), [logsumexp - x[V - 3]], np.float32, "loss of the last row")
    assert_close(logits.row(N - 1), grad * scale, dtype, "dlogits of the last row (in place)")


@pytest.mark.parametrize("warp", WARPS)
@pytest.mark.parametrize("suffix", ["f32_i32", "f32_i64", "bf16_i32", "bf16_i64"])
def test_softmax_xent_indexes_more_than_2_32_logits(pool, small, suffix, warp):
    run_softmax_xent(pool, small, suffix, warp=warp)


def run_rmsnorm(pool, small, suffix, code=None, warp=32):
    dtype = DTYPES[suffix]
    N, C = rows_for(D_MODEL), D_MODEL
    block = loader._row_block(C, dtype.itemsize, warp)
    x, y = Tensor(pool[0], (N, C), dtype), Tensor(pool[1], (N, C), dtype)
    rstd = Tensor(pool[2], (N,), np.float32)
    xr, w = random(C, dtype, 2, 2.0), random(C, dtype, 3)
    x.row(N - 1)[:] = xr
    w_dev = small(w)
    xf, wf = xr.astype(np.float32)[None], w.astype(np.float32)
    y_ref, rstd_ref = layers.rmsnorm_forward(xf, wf, EPS)
    function("rmsnorm", f"rmsnorm_forward_{suffix}", code, warp)(N, block, (x, w_dev, y, rstd, np.int32(C), np.float32(EPS)),
                                                           blocks=[N - 1])
    assert_close(y.row(N - 1), y_ref[0], dtype, "rmsnorm y of the last row")
    assert_close(rstd.flat(N - 1, N), rstd_ref[:, 0], np.float32, "rstd of the last row")

    ss = Tensor(pool[2], (N,), np.float32)
    function("rmsnorm", f"rmsnorm_online_stats_{suffix}", code, warp)(N, block, (x, w_dev, y, ss, np.int32(C)), blocks=[N - 1])
    xw_ref, ss_ref = layers.rmsnorm_online_stats(xf, wf)
    assert_close(y.row(N - 1), xw_ref[0], dtype, "online stats xw of the last row")
    assert_close(ss.flat(N - 1, N), ss_ref, np.float32, "online stats ss of the last row")

    branch, s = Tensor(pool[3], (N, C), dtype), Tensor(pool[4], (N, C), dtype)
    br = random(C, dtype, 11)
    branch.row(N - 1)[:] = br
    function("rmsnorm", f"residual_online_stats_{suffix}", code, warp)(
        N, block, (x, branch, w_dev, s, s, y, ss, np.int32(C)), blocks=[N - 1])
    sr = (xf + br.astype(np.float32)[None]).astype(dtype).astype(np.float32)
    xw_ref, ss_ref = layers.rmsnorm_online_stats(sr, wf)
    assert_close(s.row(N - 1), sr[0], dtype, "residual sum of the last row")
    assert_close(y.row(N - 1), xw_ref[0], dtype, "residual xw of the last row")
    assert_close(ss.flat(N - 1, N), ss_ref, np.float32, "residual ss of the last row")

    dy, dx, dw = Tensor(pool[3], (N, C), dtype), y, Tensor(pool[4], (N, C), np.float32)
    dyr = random(C, dtype, 4)
    dy.row(N - 1)[:] = dyr
    rstd.flat(N - 1, N)[:] = rstd_ref[:, 0]
    proj = small(np.zeros(N, np.float32))
    function("rmsnorm", f"rmsnorm_projection_{suffix}", code, warp)(N, block, (dy, x, w_dev, rstd, proj, np.int32(C)),
                                                              blocks=[N - 1])
    # chunks of one row (the loader's chunks are longer): the last chunk's dw partial row starts
    # past 2^32 elements too; all column tiles of that chunk run
    threads, tiles, _, _ = loader.rmsnorm_backward_launch(N, C, dtype.itemsize, warp, 108)
    function("rmsnorm", f"rmsnorm_backward_{suffix}", code, warp)(
        tiles * N, threads, (dy, x, w_dev, rstd, proj, dx, dw, np.int32(N), np.int32(C), np.int32(1)),
        blocks=[(N - 1) * tiles + t for t in range(tiles)])
    dw_ref = np.zeros(C, np.float32)
    dx_ref = layers.rmsnorm_backward(dyr.astype(np.float32)[None], xf, wf, rstd_ref, dw_ref)
    assert_close(dx.row(N - 1), dx_ref[0], dtype, "rmsnorm dx of the last row")
    assert_close(dw.row(N - 1), dw_ref, np.float32, "dw partial of the last chunk")

    R = RANK
    N = rows_for(R)
    P, out = Tensor(pool[0], (N, R), dtype), Tensor(pool[1], (N, R), dtype)
    ss_total = Tensor(pool[2], (N,), np.float32)
    pr = random(R, dtype, 5)
    P.row(N - 1)[:] = pr
    ss_total.flat(N - 1, N)[:] = 3.0 * C
    function("rmsnorm", f"rescale_rows_{suffix}", code, warp)(
        N, loader._row_block(R, dtype.itemsize, warp), (P, ss_total, out, np.int32(R), np.int32(C), np.float32(EPS)),
        blocks=[N - 1])
    want = layers.rescale_rows(pr.astype(np.float32)[None], np.array([3.0 * C], np.float32), C, EPS)
    assert_close(out.row(N - 1), want[0], dtype, "rescale_rows of the last row")


@pytest.mark.parametrize("warp", WARPS)
@pytest.mark.parametrize("suffix", DTYPES)
def test_rmsnorm_kernels_index_more_than_2_32_elements(pool, small, suffix, warp):
    run_rmsnorm(pool, small, suffix, warp=warp)


def run_btp(pool, small, suffix, code=None, warp=32):
    """btp's backward kernels at rows x rank and rows x (d_model / 4) past 2^32 (tp = 4, the paper's)."""
    dtype = DTYPES[suffix]
    R, N = RANK, rows_for(RANK)
    dZs, Z, dP = (Tensor(pool[i], (N, R), dtype) for i in range(3))
    rstd, dS = Tensor(pool[3], (N,), np.float32), Tensor(pool[4], (N,), np.float32)
    dzr, zr = random(R, dtype, 6, 2.0), random(R, dtype, 7, 2.0)
    dZs.row(N - 1)[:], Z.row(N - 1)[:], rstd.flat(N - 1, N)[:] = dzr, zr, 0.75
    rstd.flat(N - 1, N)[:] = 3.0 * D_MODEL  # first as the sum of squares the rescale reads
    function("btp", f"btp_rescale_silu_{suffix}", code, warp)(
        N, loader._row_block(R, dtype.itemsize, warp), (dZs, rstd, Z, dP, dS, np.int32(R), np.int32(D_MODEL),
                                                        np.float32(EPS)), blocks=[N - 1])
    assert_close(dS.flat(N - 1, N), layers.online_rstd(np.array([3.0 * D_MODEL]), D_MODEL, EPS), np.float32,
                 "btp rescale rstd of the last row")
    z_ref = layers.rescale_rows(dzr.astype(np.float32)[None], np.array([3.0 * D_MODEL], np.float32), D_MODEL, EPS)
    assert_close(Z.row(N - 1), z_ref[0], dtype, "btp rescale Z of the last row")
    assert_close(dP.row(N - 1), layers.silu_forward(Z.row(N - 1).astype(np.float32)), dtype, "btp silu(Z), last row")
    Z.row(N - 1)[:], rstd.flat(N - 1, N)[:] = zr, 0.75
    for act in (True, False):
        function("btp", f"btp_backward_pre_{suffix}", code, warp)(
            N, loader._row_block(R, dtype.itemsize, warp), (dZs, Z, rstd, dP, dS, np.int32(R), np.int32(D_MODEL),
                                                            np.int32(act)), blocks=[N - 1])
        dP_ref, dS_ref = layers.btp_norm_backward_pre(dzr.astype(np.float32)[None], zr.astype(np.float32)[None],
                                                      np.array([[0.75]], np.float32), D_MODEL, act)
        assert_close(dP.row(N - 1), dP_ref[0], dtype, f"btp dP of the last row, act={act}")
        assert_close(dS.flat(N - 1, N), dS_ref[:, 0], np.float32, f"btp dS of the last row, act={act}")

    Cs = D_MODEL // 4
    N = rows_for(Cs)
    dxw, x, dx, dw = (Tensor(pool[0], (N, Cs), np.float32), Tensor(pool[1], (N, Cs), dtype),
                      Tensor(pool[2], (N, Cs), dtype), Tensor(pool[3], (N, Cs), np.float32))
    dS = Tensor(pool[4], (N,), np.float32)
    gr, xr, w = random(Cs, np.float32, 8), random(Cs, dtype, 9), random(Cs, dtype, 10)
    dxw.row(N - 1)[:], x.row(N - 1)[:], dS.flat(N - 1, N)[:] = gr, xr, -0.25
    kernel = function("btp", f"btp_backward_post_{suffix}", code, warp)
    threads, tiles, _, _ = loader.rmsnorm_backward_launch(N, Cs, dtype.itemsize, warp, 108)
    kernel(tiles * N, threads, (dxw, x, small(w), dS, x, dx, dw, np.int32(N), np.int32(Cs), np.int32(1), np.int32(0)),
           blocks=[(N - 1) * tiles + t for t in range(tiles)])  # one-row chunks: the last row's chunk
    dw_ref = np.zeros(Cs, np.float32)
    dx_ref = layers.btp_norm_backward_post(gr[None], xr.astype(np.float32)[None], w.astype(np.float32),
                                           np.array([[-0.25]], np.float32), dw_ref)
    assert_close(dx.row(N - 1), dx_ref[0], dtype, "btp dx of the last row")
    assert_close(dw.row(N - 1), dw_ref, np.float32, "btp dw partial of the last chunk")


@pytest.mark.parametrize("warp", WARPS)
@pytest.mark.parametrize("suffix", DTYPES)
def test_btp_kernels_index_more_than_2_32_elements(pool, small, suffix, warp):
    run_btp(pool, small, suffix, warp=warp)


def run_dw_accumulate(pool, code=None, warp=32):
    """dw_accumulate over 3 chunk rows of C columns, 3 x C past 2^32 partials: the last block's columns."""
    chunks = 3
    C = LIMIT // chunks + 1
    partial, dw = Tensor(pool[0], (chunks, C), np.float32), Tensor(pool[1], (C,), np.float32)
    blocks, threads = loader.dw_accumulate_launch(C)
    first = (blocks - 1) * launch_plan.RMSNORM.dw_columns  # the last block's first column
    rows = [random(C - first, np.float32, 50 + c) for c in range(chunks)]
    for c, row in enumerate(rows):
        partial.flat(c * C + first, (c + 1) * C)[:] = row
    dw.flat(first, C)[:] = 1.5
    function("rmsnorm", "dw_accumulate_f32", code, warp)(blocks, threads, (partial, dw, np.int32(chunks), np.int32(C)),
                                                       blocks=[blocks - 1])
    assert_close(dw.flat(first, C), 1.5 + sum(r.astype(np.float64) for r in rows), np.float32,
                 "dw_accumulate's last columns")


@pytest.mark.parametrize("warp", WARPS)
def test_dw_accumulate_indexes_more_than_2_32_partials(pool, warp):
    run_dw_accumulate(pool, warp=warp)


# ------------------------------------------------------------------------------ the elementwise kernels


def run_lowrank(pool, small, suffix, code=None, warp=32):
    dtype = DTYPES[suffix]
    n = ELEMENTS
    vector = 16 // dtype.itemsize
    per_block = loader.ELEMENTWISE_BLOCK_THREADS * vector
    grid = -(-n // per_block)
    # the last block's vectors and the scalar tail after them (threads of block 0), block 0's vectors
    last = (grid - 1) * per_block
    spans = [(0, per_block), (last, n)]
    ins = [Tensor(pool[i], (n,), dtype) for i in range(3)]
    outs = [Tensor(pool[3 + i], (n,), dtype) for i in range(2)]
    for i, t in enumerate(ins):
        for k, (a, b) in enumerate(spans):
            t.flat(a, b)[:] = random(b - a, dtype, 10 * i + k, 3.0)

    def launch(entry, args):
        function("lowrank", f"{entry}_{suffix}", code, warp)(grid, loader.ELEMENTWISE_BLOCK_THREADS, args, blocks=[0, grid - 1])

    def values(t, a, b):
        return t.flat(a, b).astype(np.float32)

    launch("silu_forward", (ins[0], outs[0], np.int64(n)))
    for a, b in spans:
        assert_close(outs[0].flat(a, b), layers.silu_forward(values(ins[0], a, b)), dtype, f"silu [{a}, {b})")
    launch("silu_backward", (ins[0], ins[1], outs[0], np.int64(n)))
    for a, b in spans:
        want = layers.silu_backward(values(ins[1], a, b), values(ins[0], a, b))
        assert_close(outs[0].flat(a, b), want, dtype, f"silu' [{a}, {b})")
    for act in (True, False):
        launch("gate_forward", (ins[0], ins[1], outs[0], np.int64(n), np.int32(act)))
        for a, b in spans:
            want = layers.gate_forward(values(ins[0], a, b), values(ins[1], a, b), act)
            assert_close(outs[0].flat(a, b), want, dtype, f"gate act={act} [{a}, {b})")
        launch("gate_backward", (*ins, *outs, np.int64(n), np.int32(act)))
        for a, b in spans:
            dg, du = layers.gate_backward(values(ins[2], a, b), values(ins[0], a, b), values(ins[1], a, b), act)
            assert_close(outs[0].flat(a, b), dg, dtype, f"gate dg act={act} [{a}, {b})")
            assert_close(outs[1].flat(a, b), du, dtype, f"gate du act={act} [{a}, {b})")


@pytest.mark.parametrize("warp", WARPS)
@pytest.mark.parametrize("suffix", DTYPES)
def test_elementwise_kernels_index_more_than_2_32_elements(pool, small, suffix, warp):
    run_lowrank(pool, small, suffix, warp=warp)


@pytest.mark.parametrize("warp", WARPS)
@pytest.mark.parametrize("entry", ["adamw_step_f32", "adamw_step_device_f32"])
def test_adamw_indexes_more_than_2_32_elements(pool, small, warp, entry):
    run_adamw(pool, small, warp=warp, entry=entry)


def run_adamw(pool, small, code=None, warp=32, entry="adamw_step_f32"):
    """The fused AdamW over a flat slice of 2^32 + 7 floats, decay on a range past 2^32 (`entry`: its
    numbers by value, or read from device buffers, the norm under the clipping threshold)."""
    n = ELEMENTS
    per_block = loader.ELEMENTWISE_BLOCK_THREADS * 4
    grid = -(-n // per_block)
    spans = [(0, per_block), ((grid - 1) * per_block, n)]
    p, g, m, v = (Tensor(pool[i], (n,), np.float32) for i in range(4))
    for i, t in enumerate((p, g, m, v)):
        for k, (a, b) in enumerate(spans):
            t.flat(a, b)[:] = np.abs(random(b - a, np.float32, 20 + 10 * i + k)) if t is v else random(b - a, np.float32,
                                                                                                        20 + 10 * i + k)
    before = [[t.flat(a, b).astype(np.float64) for t in (p, g, m, v)] for a, b in spans]
    bounds = small(np.array([n - 3, n], np.int64))  # decay on the last 3 elements only
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.95, 1e-8, 0.1
    per_step = (np.float32(lr * wd), np.float32(1.0), np.float32(lr / (1 - b1)), np.float32(np.sqrt(1 - b2)))
    if entry == "adamw_step_device_f32":
        per_step = (small(np.array([lr * wd, lr / (1 - b1), np.sqrt(1 - b2)], np.float32)),
                    small(np.array([0.25])), np.float64(1.0))
    function("adamw", entry, code, warp)(
        grid, loader.ELEMENTWISE_BLOCK_THREADS,
        (p, g, m, v, np.int64(n), bounds, np.int32(2), np.float32(b1), np.float32(1 - b1), np.float32(b2),
         np.float32(1 - b2), np.float32(eps), *per_step), blocks=[0, grid - 1])
    for (a, b), (p0, g0, m0, v0) in zip(spans, before):
        m_ref, v_ref = b1 * m0 + (1 - b1) * g0, b2 * v0 + (1 - b2) * g0 * g0
        decay = np.arange(a, b) >= n - 3
        p_ref = p0 - np.where(decay, lr * wd * p0, 0.0) - m_ref / (np.sqrt(v_ref) / np.sqrt(1 - b2) + eps) * (lr / (1 - b1))
        assert_close(p.flat(a, b), p_ref, np.float32, f"adamw p [{a}, {b})")
        assert_close(m.flat(a, b), m_ref, np.float32, f"adamw m [{a}, {b})")


@pytest.mark.parametrize("warp", WARPS)
def test_sum_squares_indexes_more_than_2_32_elements(pool, small, warp):
    run_sum_squares(pool, small, warp=warp)


def run_sum_squares(pool, small, code=None, warp=32):
    """The gradient norm's sum of squares over a range at the start and one ending at 2^32 + 7, by a
    grid of two blocks (each thread's elements are range start + thread + k x 512)."""
    n, threads = ELEMENTS, 2 * loader.ELEMENTWISE_BLOCK_THREADS
    ranges = [(0, 5), (n - 1000, n)]
    g = Tensor(pool[0], (n,), np.float32)
    for k, (a, b) in enumerate(ranges):
        g.flat(a, b)[:] = random(b - a, np.float32, 60 + k)
    partial = small(np.zeros(2, np.float32))
    function("adamw", "sum_squares_ranges_f32", code, warp)(
        2, loader.ELEMENTWISE_BLOCK_THREADS, (g, small(np.array(ranges, np.int64).reshape(-1)), np.int32(2), partial),
        blocks=[0, 1])
    want = np.zeros(2)
    for a, b in ranges:
        values = g.flat(a, b).astype(np.float64) ** 2
        np.add.at(want, np.arange(b - a) % threads // loader.ELEMENTWISE_BLOCK_THREADS, values)
    assert_close(partial.get(), want, np.float32, "sum_squares partials")


# ------------------------------------------------------------------------------ attention and RoPE


def run_attention(pool, suffix, code=None, warp=32, head_dim=ATTN_DH):
    """The three attention passes at q, o, dO, dQ [B, T, H, Dh] of more than 2^32 elements (head_dim
    64: twice the heads, so the same elements, through the entry points whose tiles hold 64 dims), over
    the blocks of the last batch's last key/value head group (the largest indices): the forward and
    dQ blocks of its G query heads, the dK/dV blocks of its key/value head, against the model's
    NumPy attention on that group."""
    from tests.kernels.attention.test_attention_kernel import specification

    dtype = DTYPES[suffix]
    B, T, Dh = ATTN_B, ATTN_T, head_dim
    H, Hkv = ATTN_H * ATTN_DH // Dh, ATTN_HKV * ATTN_DH // Dh
    G = H // Hkv
    q, o, do, dq = (Tensor(pool[i], (B, T, H, Dh), dtype) for i in range(4))
    side = [cudaemu.alloc(B * T * Hkv * Dh * 4) for _ in range(4)] + [cudaemu.alloc(B * H * T * 4) for _ in range(2)]
    try:
        k, v, dk, dv = (Tensor(buf, (B, T, Hkv, Dh), dtype) for buf in side[:4])
        lse, delta = (Tensor(buf, (B, H, T), np.float32) for buf in side[4:])

        def last_batch(t, heads):  # [T, heads, Dh] of batch B - 1, a writable view
            return t.flat((B - 1) * T * heads * Dh, B * T * heads * Dh).reshape(T, heads, Dh)

        group = slice(H - G, H)
        inputs = []
        for seed, (t, heads, part) in enumerate(((q, H, group), (k, Hkv, slice(Hkv - 1, Hkv)),
                                                 (v, Hkv, slice(Hkv - 1, Hkv)), (do, H, group))):
            values = random((T, part.stop - part.start, Dh), dtype, 20 + seed)
            last_batch(t, heads)[:, part] = values
            inputs.append(values[None])
        scalars = loader._attention_scalars(T, H, Hkv, Dh)
        plan = launch_plan.ATTENTION

        def run(entry, tile, heads, first_slice, n_slices, args):
            tiles = -(-T // tile)
            blocks = [s * tiles + x for s in range(first_slice, first_slice + n_slices) for x in range(tiles)]
            function("attention", loader.attention_entry(entry, Dh, suffix), code, warp)(B * heads * tiles, plan.threads, args,
                                                                   blocks=blocks)

        last_group = (B - 1) * H + H - G  # the slice (b, h) of the group's first query head
        run("attention_forward", plan.query_tile, H, last_group, G, (q, k, v, o, lse, *scalars))
        run("attention_backward_dq", plan.query_tile, H, last_group, G,
            (q, k, v, o, do, lse, delta, dq, *scalars))
        run("attention_backward", plan.bwd_key_tile, Hkv, B * Hkv - 1, 1,
            (q, k, v, do, lse, delta, dk, dv, *scalars))

        want = specification(*inputs)
        got = (last_batch(o, H)[:, group], lse.flat(((B - 1) * H + H - G) * T, B * H * T).reshape(G, T),
               last_batch(dq, H)[:, group], last_batch(dk, Hkv)[:, -1:], last_batch(dv, Hkv)[:, -1:])
        for name, g, w in zip(("o", "lse", "dq", "dk", "dv"), got, want):
            assert_close(g, w.reshape(g.shape), np.float32 if name == "lse" else dtype, f"attention {name} of the last group")
    finally:
        for buf in side:
            buf.free()


@pytest.mark.parametrize("head_dim", [ATTN_DH, 64], ids=["hd128", "hd64"])
@pytest.mark.parametrize("warp", WARPS)
@pytest.mark.parametrize("suffix", DTYPES)
def test_attention_kernels_index_more_than_2_32_elements(pool, suffix, warp, head_dim):
    run_attention(pool, suffix, warp=warp, head_dim=head_dim)


def run_rope(pool, small, suffix, code=None, warp=32):
    """RoPE forward and backward on x [B, T, H, Dh] of more than 2^32 elements, one pair a thread
    (the loader's grid strides at most 16 blocks an SM over the same pair indices): the first and
    the last block, against the model's NumPy RoPE on the rows they rotate."""
    dtype = DTYPES[suffix]
    B, T, H, Dh = ATTN_B, ATTN_T, ATTN_H, ATTN_DH
    x, out = Tensor(pool[0], (B, T, H, Dh), dtype), Tensor(pool[1], (B, T, H, Dh), dtype)
    pairs = B * T * H * Dh // 2
    grid = -(-pairs // loader.ELEMENTWISE_BLOCK_THREADS)
    rows = loader.ELEMENTWISE_BLOCK_THREADS // (Dh // 2)  # rows of Dh a block rotates
    cos, sin = layers.rope_tables(T, Dh, 10000.0, dtype)
    spans = [(0, rows * Dh, 0), (B * T * H * Dh - rows * Dh, B * T * H * Dh, T - 1)]  # elements and their position
    for k, (a, b, _) in enumerate(spans):
        x.flat(a, b)[:] = random(b - a, dtype, 30 + k)
    tables = (small(cos), small(sin))
    for entry, reference in (("rope_forward", layers.rope_forward), ("rope_backward", layers.rope_backward)):
        function("rope", f"{entry}_{suffix}", code, warp)(
            grid, loader.ELEMENTWISE_BLOCK_THREADS, (x, *tables, out, np.int64(pairs), np.int32(T), np.int32(H), np.int32(Dh)),
            blocks=[0, grid - 1])
        for a, b, t in spans:
            want = reference(x.flat(a, b).astype(np.float32).reshape(rows, Dh), cos[t].astype(np.float32),
                             sin[t].astype(np.float32))
            assert_close(out.flat(a, b).reshape(rows, Dh), want, dtype, f"{entry} of elements [{a}, {b})")


@pytest.mark.parametrize("warp", WARPS)
@pytest.mark.parametrize("suffix", DTYPES)
def test_rope_kernels_index_more_than_2_32_elements(pool, small, suffix, warp):
    run_rope(pool, small, suffix, warp=warp)


# entry points the tests above run past 2^32 elements; a new kernel gets its test here
CHECKED = ("softmax_xent_", "rmsnorm_forward_", "rmsnorm_online_stats_", "residual_online_stats_", "rmsnorm_projection_", "rmsnorm_backward_",
           "rescale_rows_", "silu_forward_", "silu_backward_", "gate_forward_", "gate_backward_", "btp_backward_pre_",
           "btp_backward_post_", "btp_rescale_silu_", "adamw_step_", "sum_squares_ranges_", "attention_forward_", "attention_backward_dq_",
           "attention_backward_", "rope_forward_", "rope_backward_", "dw_accumulate_")


def test_every_entry_point_is_run_past_2_32_elements():
    for path in sorted(loader.kernels_dir().glob("*.cu")):
        module = cudaemu.Module(loader.kernel_source(path.stem), loader.compile_options(path.stem, 32))
        unchecked = [e for e in module.entry_points if not e.startswith(CHECKED)]
        assert not unchecked, f"{path.name}: {unchecked} are not run past 2^32 elements in {__name__}"


# ------------------------------------------------------------------------------ mutation tests


def mutated(file, old, new):
    code = loader.kernel_source(file)
    assert old in code, f"the mutation target {old!r} is not in {file}.cu any more"
    return code.replace(old, new, 1)


def test_an_int_row_offset_is_an_integer_overflow(pool, small):
    """softmax_xent's row offset as int x int: 128,256 x 33,487 overflows (line named)."""
    code = mutated("softmax_xent", "const long long offset = static_cast<long long>(row) * V;",
                   "const long long offset = row * V;")
    with pytest.raises(cudaemu.IntegerOverflowError, match=r"128256 \* 33487 does not fit 'int'.*offset = row \* V"):
        run_softmax_xent(pool, small, "f32_i32", code)


def test_an_unsigned_row_offset_that_wraps_reads_another_row(pool, small):
    """rmsnorm_forward's row offset as 32-bit unsigned arithmetic: no undefined behaviour, the
    offset wraps modulo 2^32 and the last row's output is not computed from the last row."""
    code = mutated("rmsnorm", "const long long offset = static_cast<long long>(row) * C;\n    const int V",
                   "const long long offset = blockIdx.x * C;\n    const int V")
    with pytest.raises(AssertionError, match="rmsnorm y of the last row"):
        run_rmsnorm(pool, small, "f32", code)


def test_an_int_element_index_is_an_integer_overflow(pool, small):
    code = mutated("lowrank", "const long long thread = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;",
                   "const int thread = blockIdx.x * blockDim.x + threadIdx.x;")
    with pytest.raises(cudaemu.IntegerOverflowError, match=r"\* 4 does not fit 'int'"):
        run_lowrank(pool, small, "f32", code)


def test_an_int_dw_partial_offset_is_an_integer_overflow(pool, small):
    """rmsnorm_backward's offset of its chunk's dw partial row as int x int: 16,384 x 262,144."""
    code = mutated("rmsnorm", "dw_partial + static_cast<long long>(tile.chunk) * C + tile.j,",
                   "dw_partial + tile.chunk * C + tile.j,")
    with pytest.raises(cudaemu.IntegerOverflowError, match=r"16384 \* 262144 does not fit 'int'.*dw_partial \+ tile.chunk \* C"):
        run_rmsnorm(pool, small, "f32", code)


def test_an_int_range_end_misses_the_elements_past_2_32(pool, small):
    """The gradient norm's range end narrowed to int (2^32 + 7 becomes 7): the range past 2^32 is
    not summed, and the partials say so."""
    code = mutated("adamw", "const long long hi = bounds[2 * r + 1];",
                   "const int hi = static_cast<int>(bounds[2 * r + 1]);")
    with pytest.raises(AssertionError, match="sum_squares partials"):
        run_sum_squares(pool, small, code)


def test_an_int_token_offset_is_an_integer_overflow(pool):
    """attention's [B, T, heads, Dh] offset in int: (6553 x 40 + t) x 128 x 128 overflows (line named)."""
    code = mutated("attention", "return ((static_cast<long long>(b) * tokens + t) * heads + head) * Dh;",
                   "return ((b * tokens + t) * heads + head) * Dh;")
    with pytest.raises(cudaemu.IntegerOverflowError, match=r"does not fit 'int'.*\* heads \+ head\) \* Dh"):
        run_attention(pool, "f32", code)


def test_an_int_rope_row_is_an_integer_overflow(pool, small):
    """RoPE's row (b T + t) heads + head fits an int; the row times Dh / 2 does not."""
    code = mutated("rope", "const long long row = p / half;", "const int row = static_cast<int>(p / half);")
    with pytest.raises(cudaemu.IntegerOverflowError, match=r"64 \* \d+ does not fit 'int'.*p - row \* half"):
        run_rope(pool, small, "f32", code)
