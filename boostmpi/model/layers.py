"""The model's layers as forward/backward pairs, written for one device (no communication).

Letters: B batch, T time, C channels (d_model), H query heads, Hkv key/value heads, Dh head
dim, G = H/Hkv query heads per kv head, F d_ff, R rank, V vocabulary, N = B*T rows.
Every `*_backward` *accumulates* into the gradient arrays it is given (`+=`) and returns the
gradient of its input. Arrays may be NumPy or CuPy: `xp = get_array_module(x)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple, cast

import numpy as np
import numpy.typing as npt

from boostmpi.arrays import Alloc, Array
from boostmpi.backend import get_array_module
from boostmpi.precision import statistic_dtype

if TYPE_CHECKING:
    from boostmpi.gpu.attention import AttentionContext


def kernel_inputs(*arrays: Array) -> tuple[ModuleType | None, tuple[Array, ...]]:
    """(the fused CUDA kernels of boostmpi.gpu.kernels, the arrays C-contiguous) when the arrays are
    CuPy arrays of float32 or bfloat16, all of one dtype; else (None, the arrays): the NumPy code
    below is then the path, and it is the specification each kernel is tested against
    (tests/kernels/test_kernels.py). A strided input (a column block of a grouped GEMM's output) is copied
    once: cheaper on a GPU than the unfused operations."""
    xp = get_array_module(arrays[0])
    dtype = arrays[0].dtype
    if xp is np or not (dtype == np.float32 or dtype.name == "bfloat16") or any(a.dtype != dtype for a in arrays):
        return None, arrays
    from boostmpi.gpu import kernels

    return kernels, tuple(xp.ascontiguousarray(a) for a in arrays)


# ---------------------------------------------------------------- grouped GEMMs
# The linears that read one input (q/k/v, gate/up) form a group: their factors can run as one GEMM
# on the concatenated weights, or pairwise as one batched GEMM.
def col_slices(widths: Sequence[int]) -> list[slice]:
    """Column slices of consecutive blocks of the given widths."""
    out, start = [], 0
    for w in widths:
        out.append(slice(start, start + w))
        start += w
    return out


def concat_cols(mats: Sequence[Array]) -> Array:
    xp = get_array_module(mats[0])
    return mats[0] if len(mats) == 1 else xp.concatenate(mats, axis=1)


def matmul(a: Array, b: Array, out: Array | None = None, accumulate: bool = False, dtype: npt.DTypeLike | None = None,
           ) -> Array:
    """a @ b (2-D, or over leading batch dimensions): the one way the layers multiply matrices.
    `out` receives the product, or with `accumulate` has it added (a weight gradient: `out += a @ b`);
    `dtype` is the result's dtype when there is no `out` (float32 from bfloat16 operands: the GEMM's
    float32 accumulator, never rounded to bfloat16). NumPy's matmul on the CPU (the specification);
    on a GPU one cuBLAS GEMM with float32 compute (boostmpi.gpu.blas) for every product, 2-D ones
    included: bfloat16 operands run bf16-in/fp32-accumulate on tensor cores, a float32 gradient
    accumulates in the GEMM itself, column blocks are read in place, and ROCm works (CuPy 14.2's own
    matmul sends batched bfloat16 operands to an integer GEMM kernel that refuses them, and its
    hipBLAS layer has no bfloat16). Operands of two dtypes are refused on a GPU: a mixed product
    would run in float32, off the tensor cores."""
    if get_array_module(a) is np:
        if accumulate:
            out += a @ b
            return out
        r = np.matmul(a, b) if out is None else np.matmul(a, b, out=out)
        return r if dtype is None else r.astype(dtype, copy=False)
    from boostmpi.gpu import blas

    if out is None and dtype is not None and np.dtype(dtype) != a.dtype:
        xp = get_array_module(a)
        out = xp.empty(tuple(np.broadcast_shapes(a.shape[:-2], b.shape[:-2])) + (a.shape[-2], b.shape[-1]), dtype=dtype)
    return blas.matmul(a, b, out, accumulate)


def batched_matmul(a: Array, b: Array) -> Array:
    """a @ b over leading batch dimensions (see `matmul`)."""
    return matmul(a, b)


def grouped_matmul(lefts: Sequence[Array], rights: Sequence[Array], outs: Sequence[Array] | None = None,
                   accumulate: bool = False) -> list[Array]:
    """[l @ r for l, r in pairs], one GEMM each. With `outs` each product is written to its out (a
    column block of a wider matrix is fine), or with `accumulate` added to it (weight gradients):
    no temporary, no copy into the block and no addition kernel. (Pairs whose operands lie side by
    side, btp's k/v and gate/up B factors, run as one strided-batched GEMM in
    `BottleneckTP._b_products`, without stacked copies.)"""
    if outs is not None:
        return [matmul(l, r, out=o, accumulate=accumulate) for l, r, o in zip(lefts, rights, outs)]
    return [matmul(l, r) for l, r in zip(lefts, rights)]


# ---------------------------------------------------------------- RMSNorm
# x [N, C], w [C] -> y [N, C]; rstd [N, 1] = 1/sqrt(mean(x^2) + eps)
def rmsnorm_forward(x: Array, w: Array, eps: float) -> tuple[Array, Array]:
    k, (xc, wc) = kernel_inputs(x, w)
    if k is not None and x.ndim == 2:
        y, rstd = k.rmsnorm_forward(xc, wc, eps)
        return y, rstd[:, None]
    xp = get_array_module(x)
    rstd = 1.0 / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + eps)
    return (x * rstd * w).astype(x.dtype, copy=False), rstd  # a float32 rstd does not widen bf16 x


def _accumulable(dw: Array) -> Array | None:
    """dw itself when a kernel can add the norm weight's gradient into it (float32, contiguous), else None."""
    return dw if dw.dtype == np.float32 and dw.flags.c_contiguous else None


def rmsnorm_backward(dy: Array, x: Array, w: Array, rstd: Array, dw: Array) -> Array:
    k, (dyc, xc, wc) = kernel_inputs(dy, x, w)
    if k is not None and x.ndim == 2:
        into = _accumulable(dw)
        dx, dw_part = k.rmsnorm_backward(dyc, xc, wc, get_array_module(x).ascontiguousarray(rstd.reshape(-1)), into)
        if into is None:
            dw += dw_part
        return dx
    dyw = dy * w
    dw += (dy * x * rstd).sum(axis=0)
    proj = (dyw * x).mean(axis=-1, keepdims=True) * (rstd * rstd)
    return (rstd * (dyw - x * proj)).astype(x.dtype, copy=False)


# ---------------------------------------------------------------- online RMSNorm (bottleneck-aware TP)
# rmsnorm(x, w) @ A from channel shards x_s, w_s, A_s: each rank computes x_s * w_s and the sum of
# squares of its shard, multiplies x_s * w_s by A_s, and one all-reduce sums both over the shards;
# then rescale_rows(P, ss_total, C, eps) = rsqrt(ss_total / C + eps) * P = rmsnorm(x, w) @ A.


def rmsnorm_online_stats(x: Array, w: Array) -> tuple[Array, Array]:
    """x [N, Cs], w [Cs] (this rank's shard) -> xw = x * w [N, Cs], ss = sum of x^2 per row [N]
    (in the accumulation dtype)."""
    k, (xc, wc) = kernel_inputs(x, w)
    if k is not None and x.ndim == 2:
        return k.rmsnorm_online_stats(xc, wc)
    return x * w, (x * x).sum(axis=-1, dtype=statistic_dtype(x.dtype))


def residual_online_stats(h: Array, y: Array, w: Array, copy: Array | None = None) -> tuple[Array, Array, Array]:
    """The residual add before a norm and `rmsnorm_online_stats` of its result: h, y [N, Cs], w [Cs]
    -> (s = h + y, s * w, sum of s^2 per row), one kernel on a GPU; s is also written to `copy`
    (a second buffer of s's shape and dtype) when given."""
    k, (hc, yc, wc) = kernel_inputs(h, y, w)
    if k is not None and h.ndim == 2 and (copy is None or (copy.dtype == h.dtype and copy.flags.c_contiguous)):
        return k.residual_online_stats(hc, yc, wc, copy)
    s = h + y
    if copy is not None:
        copy[...] = s
    return (s, *rmsnorm_online_stats(s, w))


def online_rstd(ss_total: Array, C: int, eps: float) -> Array:
    """rstd [N] = 1/sqrt(ss_total / C + eps) from the sum of squares over all C channels."""
    return 1.0 / get_array_module(ss_total).sqrt(ss_total / C + eps)


def rescale_rows(P: Array, ss_total: Array, C: int, eps: float, alloc: Alloc | None = None) -> Array:
    """P [N, R], ss_total [N] -> P * online_rstd(ss_total) row by row [N, R], in P's dtype. `alloc`
    (GPU kernels): allocates the result (recompute.Tape.alloc)."""
    k, (Pc,) = kernel_inputs(P)
    if k is not None and P.ndim == 2 and ss_total.dtype == np.float32:
        return k.rescale_rows(Pc, get_array_module(P).ascontiguousarray(ss_total), C, eps, alloc)
    return (P * online_rstd(ss_total, C, eps)[:, None]).astype(P.dtype, copy=False)


def rescale_rows_silu(P: Array, ss_total: Array, C: int, eps: float, keep: bool, alloc: Alloc | None = None,
                      ) -> tuple[Array, Array, Array | None, Array]:
    """(Z = rescale_rows(P, ss_total, C, eps), silu(Z), sigmoid(Z) as `silu_and_sigmoid` keeps it,
    rstd = online_rstd(ss_total, C, eps) [N]): online RMSNorm's second half, cola's SiLU and the
    row statistic the backward reads, one kernel on a GPU. `alloc` (GPU kernels): allocates Z and
    rstd, what lowrank keeps (recompute.Tape.alloc)."""
    k, (Pc,) = kernel_inputs(P)
    if k is not None and P.ndim == 2 and ss_total.dtype == np.float32:
        Z, Zs, rstd = k.btp_rescale_silu(Pc, get_array_module(P).ascontiguousarray(ss_total), C, eps, alloc)
        return Z, Zs, None, rstd
    Z = rescale_rows(P, ss_total, C, eps)
    return (Z, *silu_and_sigmoid(Z, keep), online_rstd(ss_total, C, eps))


# ---------------------------------------------------------------- btp's backward through a normed group
# Z = rstd(S) * P with P = sum over shards of xw_s . A_s and S the sum of squares over all shards;
# dZ and Z are replicated over the tp group, so the statistic's gradient dS is local. Around the
# GEMM dxw = dP . A^T: `btp_norm_backward_pre` gives (dP, dS) from the gradient of silu(Z) (or of
# Z), `btp_norm_backward_post` the input gradient and the norm weight's (one kernel each on a GPU).
def btp_norm_backward_pre(dZs: Array, Z: Array, rstd: Array, C: int, act: bool, sig: Array | None = None,
                          ) -> tuple[Array, Array]:
    """dZs (the gradient of silu(Z) with `act`, else of Z), Z [N, R], rstd [N, 1] -> (dP [N, R] =
    dZ * rstd in Z's dtype, dS [N, 1] = -0.5 / C * rowsum(dZ * Z) * rstd^2 in rstd's dtype)."""
    k, (dzc, zc) = kernel_inputs(dZs, Z)
    if k is not None and Z.ndim == 2 and rstd.dtype == np.float32:
        dP, dS = k.btp_backward_pre(dzc, zc, get_array_module(Z).ascontiguousarray(rstd.reshape(-1)), C, act)
        return dP, dS[:, None]
    dZ = silu_backward(dZs, Z, sig) if act else dZs
    dP = (dZ * rstd).astype(Z.dtype, copy=False)  # a GEMM operand: in the dtype of A and xw
    dS = (-0.5 / C) * (dZ * Z).sum(axis=-1, keepdims=True) * (rstd * rstd)
    return dP, dS


def btp_norm_backward_post(dxw: Array, x: Array, w: Array, dS: Array, dw: Array, residual: Array | None = None,
                           ) -> Array:
    """dxw [N, Cs] (in the accumulation dtype), x [N, Cs], w [Cs], dS [N, 1] -> dx = dxw * w + 2 x dS
    in x's dtype, plus `residual` [N, Cs] (x's dtype) when given: the residual's gradient from above,
    which meets dx at the group's input. Accumulates sum over rows of dxw * x into dw. On a GPU the
    kernel adds the residual before its one rounding (no addition kernel; the NumPy path rounds dx,
    then adds)."""
    k, (xc, wc) = kernel_inputs(x, w)
    if (k is not None and x.ndim == 2 and dxw.dtype == np.float32 and dS.dtype == np.float32
            and (residual is None or residual.dtype == x.dtype)):
        xp = get_array_module(x)
        into = _accumulable(dw)
        dx, dw_part = k.btp_backward_post(xp.ascontiguousarray(dxw), xc, wc, xp.ascontiguousarray(dS.reshape(-1)),
                                          None if residual is None else xp.ascontiguousarray(residual), into)
        if into is None:
            dw += dw_part
        return dx
    dw += (dxw * x).sum(axis=0)
    dx = (dxw * w + 2.0 * x * dS).astype(x.dtype, copy=False)  # float32 statistics, bf16 x
    return dx if residual is None else residual + dx


# ---------------------------------------------------------------- SiLU and the gated product
# The NumPy paths work in place on one fresh array: these run on [N, F] and [N, R] tensors every
# layer, forward, backward and recompute, and temporaries would dominate their cost.
def sigmoid(a: Array) -> Array:
    xp = get_array_module(a)
    s = xp.negative(a)
    xp.exp(s, out=s)
    s += 1.0
    return xp.reciprocal(s, out=s)


def _silu_grad_times(s: Array, a: Array, dz: Array) -> Array:
    """dz * silu'(a) = dz * s * (1 + a * (1 - s)), computed in the buffer `s` = sigmoid(a)."""
    xp = get_array_module(s)
    t = xp.subtract(s.dtype.type(1.0), s)  # a Python 1.0 would widen a bfloat16 s to float32 (CuPy's rules)
    t *= a
    t += 1.0
    t *= s
    t *= dz
    return t


def silu_forward(a: Array) -> Array:
    return silu_and_sigmoid(a, keep=False)[0]


def silu_and_sigmoid(a: Array, keep: bool) -> tuple[Array, Array | None]:
    """(silu(a), s): with `keep` (a recompute for an immediate backward) s = sigmoid(a) for
    `silu_backward` to reuse; None without it, and on the fused-kernel path."""
    k, (ac,) = kernel_inputs(a)
    if k is not None:
        return k.silu_forward(ac), None
    s = sigmoid(a)
    if keep:
        return a * s, s
    s *= a
    return s, None


def silu_backward(dz: Array, a: Array, s: Array | None = None) -> Array:
    """dz * silu'(a); `s` = sigmoid(a) when the forward kept it (the same bits either way)."""
    k, (dzc, ac) = kernel_inputs(dz, a)
    if k is not None:
        return k.silu_backward(ac, dzc)
    return _silu_grad_times(sigmoid(a) if s is None else s, a, dz)


# y = act(g) * u, act = silu when `act`, identity otherwise. g, u [N, F]
def gate_forward(g: Array, u: Array, act: bool) -> Array:
    return gate_and_sigmoid(g, u, act, keep=False)[0]


def gate_and_sigmoid(g: Array, u: Array, act: bool, keep: bool) -> tuple[Array, Array | None]:
    """(act(g) * u, s) with s as `silu_and_sigmoid` returns it (None without act)."""
    k, (gc, uc) = kernel_inputs(g, u)
    if k is not None:
        return k.gate_forward(gc, uc, act), None
    if not act:
        return g * u, None
    y, s = silu_and_sigmoid(g, keep)
    y *= u
    return y, s


def gate_backward(dy: Array, g: Array, u: Array, act: bool, s: Array | None = None) -> tuple[Array, Array]:
    k, (dyc, gc, uc) = kernel_inputs(dy, g, u)
    if k is not None:
        return k.gate_backward(gc, uc, dyc, act)
    if act:
        s = sigmoid(g) if s is None else s
        du = g * s
        du *= dy
        return _silu_grad_times(s, g, dy * u), du
    return dy * u, dy * g


# ---------------------------------------------------------------- embedding
# table [V, C], ids [N] -> out [N, C]
def embedding_forward(table: Array, ids: Array) -> Array:
    return table[ids]


def embedding_backward(dtable: Array, ids: Array, dout: Array) -> None:
    xp = get_array_module(dout)
    if xp is np:
        np.add.at(dtable, ids, dout)
    else:
        xp.add.at(dtable, ids, dout)


# ---------------------------------------------------------------- RoPE (rotate-half convention)
def rope_tables(T: int, Dh: int, theta: float, dtype: npt.DTypeLike, xp: ModuleType = np) -> tuple[Array, Array]:
    """cos, sin [T, 1, Dh] for positions 0..T-1 (computed in float64, then cast)."""
    inv_freq = theta ** (-np.arange(0, Dh, 2, dtype=np.float64) / Dh)
    angle = np.arange(T, dtype=np.float64)[:, None] * inv_freq[None, :]
    angle = np.concatenate([angle, angle], axis=-1)[:, None, :]
    return xp.asarray(np.cos(angle), dtype=dtype), xp.asarray(np.sin(angle), dtype=dtype)


# x [B, T, nh, Dh]
def _rope_kernels(x: Array, cos: Array, sin: Array) -> tuple[ModuleType | None, tuple[Array, ...]]:
    """(the kernels, the arrays C-contiguous) when the fused RoPE kernels take x with these tables, else (None, ())."""
    kern, arrays = kernel_inputs(x, cos, sin)
    if kern is None or x.ndim != 4 or x.shape[-1] % 2 or cos.shape[0] != x.shape[1] or cos.size != x.shape[1] * x.shape[3]:
        return None, ()
    return kern, arrays


def rope_forward(x: Array, cos: Array, sin: Array, in_place: bool = False) -> Array:
    """RoPE on x [B, T, nh, Dh]. `in_place` (GPU kernels): rotate x itself when it is contiguous, for an
    x nothing else reads (a projection's fresh output), so a cache that keeps the result keeps no
    second array."""
    kern, fused = _rope_kernels(x, cos, sin)
    if kern is not None:
        return kern.rope_forward(*fused, out=fused[0] if in_place and fused[0] is x else None)
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half] -= x[..., half:] * sin[..., :half]  # + cat([-x2, x1]) * sin
    out[..., half:] += x[..., :half] * sin[..., half:]
    return out


def rope_backward(dy: Array, cos: Array, sin: Array) -> Array:
    kern, fused = _rope_kernels(dy, cos, sin)
    if kern is not None:
        return kern.rope_backward(*fused)
    half = dy.shape[-1] // 2
    dx = dy * cos
    dx[..., :half] += dy[..., half:] * sin[..., half:]  # + R^T (dy * sin), R^T y = cat([y2, -y1])
    dx[..., half:] -= dy[..., :half] * sin[..., :half]
    return dx


# ---------------------------------------------------------------- causal attention with GQA
# Tiled over query blocks (the flash-attention recipe): block j of queries only meets keys
# 0..end_j, so the masked upper triangle is never computed, and only a [G*Bq, end_j] tile of
# scores exists at a time. The forward keeps each row's softmax maximum and sum; the backward
# recomputes each tile from them, with the same operations as the forward, so nothing of size
# T x T is kept between forward and backward (T = 4096 fits) and the probabilities it sees are
# bit for bit the forward's. A recompute for an immediate backward (`keep_probs`) may instead
# hand the tiles it just computed to the backward, when they fit in ATTENTION_KEEP_BYTES.
ATTENTION_BLOCK = 64
ATTENTION_KEEP_BYTES = 256 * 2 ** 20


def _blocks(T: int, block: int | None = None) -> list[tuple[int, int]]:
    block = block or ATTENTION_BLOCK
    return [(t0, min(T, t0 + block)) for t0 in range(0, T, block)]


_DIAGONAL_TILES: dict[tuple[int, int, str, str], Array] = {}


def _diagonal_tile(n: int, G: int, dtype: npt.DTypeLike, xp: ModuleType) -> Array:
    """Additive mask [G*n, n] for a query block against its own n keys (row i may see keys <= i).

    Keys before the block are all visible, so only this tile is ever masked; it is the same for
    every full block, made once per shape, dtype and array module."""
    key = (n, G, np.dtype(dtype).str, xp.__name__)
    if key not in _DIAGONAL_TILES:
        tri = np.triu(np.full((n, n), -np.inf), k=1)
        _DIAGONAL_TILES[key] = xp.asarray(np.tile(tri, (G, 1)), dtype=dtype)
    return _DIAGONAL_TILES[key]


def probability_tile_bytes(B: int, H: int, T: int, dtype: npt.DTypeLike) -> int:
    """Bytes of all causal probability tiles of one attention call (what `keep_probs` holds)."""
    return B * H * sum((t1 - t0) * t1 for t0, t1 in _blocks(T)) * np.dtype(statistic_dtype(dtype)).itemsize


def _scores(qb: Array, kb: Array, t0: int, t1: int, G: int, sdtype: npt.DTypeLike, xp: ModuleType) -> Array:
    """Scaled causal scores of one query block against keys 0..t1, in the softmax dtype."""
    s = batched_matmul(qb, kb.transpose(0, 1, 3, 2)).astype(sdtype, copy=False)
    s[..., t0:t1] += _diagonal_tile(t1 - t0, G, sdtype, xp)
    return s


class AttentionCache(NamedTuple):
    qs: Array  # [B, Hkv, G, T, Dh] queries, scaled by 1/sqrt(Dh)
    kh: Array  # [B, Hkv, T, Dh]
    vh: Array  # [B, Hkv, T, Dh]
    out: Array  # [B, T, Hkv, G, Dh] the output (token-major; o is a view of it)
    row_max: Array  # [B, Hkv, G, T] softmax statistics
    row_sum: Array
    tiles: list[Array] | None  # the probability tiles when kept (`keep_probs`), else None


class FusedAttentionCache(NamedTuple):
    """What the fused GPU kernels (kernels/attention.cu) keep for their backward: the inputs as
    given, the output and one statistic per row, the log-sum-exp of the scaled scores, from which
    the backward recomputes the probabilities tile by tile."""
    q: Array  # [B, T, H, Dh]
    k: Array  # [B, T, Hkv, Dh]
    v: Array
    out: Array  # [B, T, H, Dh]
    lse: Array  # [B, H, T] float32

    # the softmax statistics a recompute policy keeps (recompute = "lowrank"): here the one
    @property
    def row_max(self) -> Array:
        return self.lse

    @property
    def row_sum(self) -> None:
        return None


def _fused_attention(q: Array, k: Array, v: Array) -> tuple[ModuleType | None, tuple[Array, ...]]:
    """(the kernels, the arrays C-contiguous) when the fused attention kernels take q, k, v (CuPy,
    float32 or bfloat16, head dim within the kernels' limit); else (None, ())."""
    kern, arrays = kernel_inputs(q, k, v)
    if kern is None or q.shape[-1] > kern.attention_head_dim_max():
        return None, ()
    return kern, arrays


# q [B, T, H, Dh], k, v [B, T, Hkv, Dh] -> o [B, T, H*Dh]
def attention_forward(q: Array, k: Array, v: Array, keep_probs: bool = False,
                      stats: tuple[Array, ...] | None = None, alloc: Alloc | None = None,
                      ) -> tuple[Array, AttentionCache | AttentionContext]:
    """`stats` = (row_max, row_sum) [B, Hkv, G, T] of an earlier forward on the same q, k: a
    recompute (recompute = "lowrank" keeps them) then skips both row reductions. The scores are the
    same bits as that forward's, so its statistics are exactly what the reductions would give.
    On a GPU the attention backend `train.attention` chose runs instead (boostmpi.gpu.attention: the
    fused kernels, cuDNN or PyTorch; each recomputes the statistic, and its backward recomputes the
    probabilities, so `stats` and `keep_probs` are not needed; `alloc` allocates the float32 statistic
    the backend's context keeps, which lowrank keeps: recompute.Tape.alloc)."""
    kern, fused = _fused_attention(q, k, v)
    if kern is not None:  # the backend train.attention chose (boostmpi.gpu.attention; own by default)
        from boostmpi.gpu import attention

        qc, kc, vc = fused
        o, ctx = attention.current().forward(qc, kc, vc, alloc=alloc)
        return o.reshape(*o.shape[:2], -1), ctx
    xp = get_array_module(q)
    B, T, H, Dh = q.shape
    Hkv = k.shape[2]
    G = H // Hkv
    sd = statistic_dtype(q.dtype)  # scores and softmax in at least fp32
    qs = xp.empty((B, Hkv, G, T, Dh), dtype=q.dtype)  # contiguous, so a block's rows are one GEMM operand
    xp.multiply(q.reshape(B, T, Hkv, G, Dh).transpose(0, 2, 3, 1, 4), q.dtype.type(1.0 / np.sqrt(Dh)), out=qs)
    kh = xp.ascontiguousarray(k.transpose(0, 2, 1, 3))  # [B, Hkv, T, Dh]
    vh = xp.ascontiguousarray(v.transpose(0, 2, 1, 3))
    # token-major, so that o is a view of it: the o projection reads (and keeps) the same buffer
    out = xp.empty((B, T, Hkv, G, Dh), dtype=q.dtype)
    if stats is None:
        row_max = xp.empty((B, Hkv, G, T), dtype=sd)
        row_sum = xp.empty((B, Hkv, G, T), dtype=sd)
    else:
        row_max, row_sum = stats
    keep_tiles = keep_probs and probability_tile_bytes(B, H, T, q.dtype) <= ATTENTION_KEEP_BYTES
    tiles: list[Array] | None = [] if keep_tiles else None
    for t0, t1 in _blocks(T):
        n = t1 - t0
        s = _scores(qs[:, :, :, t0:t1].reshape(B, Hkv, G * n, Dh), kh[:, :, :t1], t0, t1, G, sd, xp)
        if stats is None:
            m = s.max(axis=-1, keepdims=True)
        else:
            m = row_max[:, :, :, t0:t1].reshape(B, Hkv, G * n, 1)
        s -= m
        xp.exp(s, out=s)
        if stats is None:
            total = s.sum(axis=-1, keepdims=True)
            row_max[:, :, :, t0:t1] = m.reshape(B, Hkv, G, n)
            row_sum[:, :, :, t0:t1] = total.reshape(B, Hkv, G, n)
        else:
            total = row_sum[:, :, :, t0:t1].reshape(B, Hkv, G * n, 1)
        ob = batched_matmul(s.astype(q.dtype, copy=False), vh[:, :, :t1])  # unnormalised: divide the [G*n, Dh] result
        if ob.dtype == sd:
            ob /= total
        else:
            ob = (ob.astype(sd) / total).astype(q.dtype)
        out[:, t0:t1] = ob.reshape(B, Hkv, G, n, Dh).transpose(0, 3, 1, 2, 4)
        if tiles is not None:
            s /= total
            tiles.append(s)
    return out.reshape(B, T, H * Dh), AttentionCache(qs, kh, vh, out, row_max, row_sum, tiles)


def attention_backward(do: Array, cache: AttentionCache | AttentionContext) -> tuple[Array, Array, Array]:
    """do [B, T, H*Dh] -> dq [B, T, H, Dh], dk, dv [B, T, Hkv, Dh]."""
    if not isinstance(cache, AttentionCache) and hasattr(cache, "q"):  # a GPU backend's context: its `q` gives the shape
        from boostmpi.gpu import attention

        _, (doc,) = kernel_inputs(do.reshape(cache.q.shape))
        return attention.current().backward(doc, cache)
    xp = get_array_module(do)
    qs, kh, vh, out, row_max, row_sum, tiles = cast(AttentionCache, cache)
    B, Hkv, G, T, Dh = qs.shape
    sd = row_max.dtype
    scale = do.dtype.type(1.0 / np.sqrt(Dh))
    dot = do.reshape(B, T, Hkv, G, Dh)
    dog = dot.transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, T, Dh]
    delta = (dot * out).sum(axis=-1, dtype=sd).transpose(0, 2, 3, 1)  # rowsum(dO * O) = rowsum(P * dP)
    dq = xp.empty((B, Hkv, G, T, Dh), dtype=do.dtype)
    dk = xp.zeros((B, Hkv, T, Dh), dtype=do.dtype)
    dv = xp.zeros((B, Hkv, T, Dh), dtype=do.dtype)
    for j, (t0, t1) in enumerate(_blocks(T)):
        n = t1 - t0
        qb = qs[:, :, :, t0:t1].reshape(B, Hkv, G * n, Dh)
        dob = dog[:, :, :, t0:t1].reshape(B, Hkv, G * n, Dh)
        kb, vb = kh[:, :, :t1], vh[:, :, :t1]
        if tiles is not None:
            p = tiles[j]
        else:  # the forward's probabilities, recomputed by the forward's own operations
            p = _scores(qb, kb, t0, t1, G, sd, xp)
            p -= row_max[:, :, :, t0:t1].reshape(B, Hkv, G * n, 1)
            xp.exp(p, out=p)
            p /= row_sum[:, :, :, t0:t1].reshape(B, Hkv, G * n, 1)
        pc = p.astype(do.dtype, copy=False)
        dv[:, :, :t1] += batched_matmul(pc.transpose(0, 1, 3, 2), dob)  # summed over the G query heads
        ds = batched_matmul(dob, vb.transpose(0, 1, 3, 2)).astype(sd, copy=False)
        ds -= delta[:, :, :, t0:t1].reshape(B, Hkv, G * n, 1)
        ds *= p
        dsc = ds.astype(do.dtype, copy=False)
        dq[:, :, :, t0:t1] = (batched_matmul(dsc, kb) * scale).reshape(B, Hkv, G, n, Dh)
        dk[:, :, :t1] += batched_matmul(dsc.transpose(0, 1, 3, 2), qb)  # qb already carries the scale
    dq = dq.transpose(0, 3, 1, 2, 4).reshape(B, T, Hkv * G, Dh)
    return dq, dk.transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3)
