"""Bottleneck-aware tensor parallelism ('btp'): the residual stays sharded along C and the only
communication of a low-rank group is at rank R.

A group (q/k/v, gate/up, or o, down alone) runs
  [RMSNorm] -> A row-parallel [C/p, R] -> reduce_from_tp_region (the rank-R activation, with the
  online RMSNorm's sum of squares, in float32 at least, in the same collective) -> SiLU (cola) on the replicated
  R-vector -> copy_to_tp_region -> B column-parallel [R, out/p].
The embedding is sharded along C (no communication); the head gathers the residual from the region.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, cast

import numpy as np

from boostmpi.arrays import Alloc, Array
from boostmpi.backend import get_array_module
from boostmpi.model import layers
from boostmpi.model.layers import col_slices, grouped_matmul, matmul
from boostmpi.model.params import FlatBuffer, split_range
from boostmpi.model.recompute import NO_TAPE, Tape
from boostmpi.model.transformer import ProjectionCache
from boostmpi.parallel.mappings import (copy_to_tp_region, copy_to_tp_region_backward_async, gather_from_tp_region,
                                        gather_from_tp_region_backward, reduce_from_tp_region,
                                        reduce_from_tp_region_backward, reduce_from_tp_region_many)
from boostmpi.parallel.tensor_parallel.base import Strategy, activate
from boostmpi.precision import statistic_dtype

if TYPE_CHECKING:
    from boostmpi.config import Config
    from boostmpi.parallel.grid import ProcessGrid


class BottleneckCache(NamedTuple):
    x: Array  # [N, C/p] the group's input (the residual shard)
    xw: Array  # x * norm weight (x without a norm)
    norm_name: str | None  # the RMSNorm's parameter name, None for o and down
    Z: Array  # [N, R] the reduced bottleneck activation, normalised
    Zs: Array  # silu(Z) (cola), else Z
    rstd: Array | None  # [N, 1] the RMSNorm statistic, None without a norm
    names: list[str]  # the group's linears
    sl: list[slice]  # their column slices of Z
    sig: Array | None  # sigmoid(Z) when kept for the backward, else None


class BottleneckTP(Strategy):
    def __init__(self, cfg: Config, grid: ProcessGrid) -> None:
        super().__init__(cfg, grid)
        m = cfg.model
        self.res_cols = split_range(self.C, self.p, self.t)
        self.n_heads = m.n_heads // self.p
        self.n_kv_heads = m.n_kv_heads // self.p
        self.online = cfg.parallel.norm == "online"

    # -- embedding sharded along C: no communication either way
    embedding_is_local = True

    def embed_forward(self, ids: Array, P: FlatBuffer) -> Array:
        return layers.embedding_forward(P["embed"], ids)

    def embed_backward(self, ids: Array, dh: Array, grads: FlatBuffer) -> None:
        layers.embedding_backward(grads["embed"], ids, dh)

    # -- the head reads the whole residual
    def _gather_residual(self, h: Array) -> Array:
        return gather_from_tp_region(h, self.tp)

    def _gather_residual_backward(self, dh: Array) -> Array:
        return gather_from_tp_region_backward(dh, self.tp)

    # -- a low-rank group
    def in_proj_forward(self, x: Array, norm_name: str, names: list[str], P: FlatBuffer, tape: Tape = NO_TAPE,
                        ) -> tuple[list[Array], ProjectionCache]:
        return self._bottleneck_forward(x, norm_name, names, P, tape)

    def residual_in_proj_forward(self, h: Array, y: Array, norm_name: str, names: list[str], P: FlatBuffer, tape: Tape,
                                 copy: Array | None = None) -> tuple[Array, list[Array], ProjectionCache]:
        """h + y (also written to `copy` when given), its x * w and sum of squares in one pass (one
        kernel on a GPU), then the group."""
        h, xw, ss = layers.residual_online_stats(h, y, P[norm_name], copy)
        return (h, *self._bottleneck_forward(h, norm_name, names, P, tape, stats=(xw, ss)))

    def in_proj_backward(self, douts: list[Array], cache: ProjectionCache, P: FlatBuffer, grads: FlatBuffer,
                         residual: Array | None = None) -> Array:
        """`residual` is added in the norm's backward kernel (btp_backward_post) on a GPU."""
        return self._bottleneck_backward(douts, cast(BottleneckCache, cache), P, grads, residual)  # its own forward's

    def out_proj_forward(self, x: Array, name: str, P: FlatBuffer, tape: Tape = NO_TAPE,
                         accumulate_into: Array | None = None) -> tuple[Array, ProjectionCache]:
        """With `accumulate_into` (a residual shard) the B GEMM, column-parallel (its output local, no
        collective after it), adds its product into it: cuBLAS beta = 1, rounded once."""
        outs, cache = self._bottleneck_forward(x, None, [name], P, tape, into=accumulate_into)
        return outs[0], cache

    def output_accumulates(self, h: Array) -> bool:
        """On a GPU (the fused kernels' path): the B factors are column-parallel, so the output is this
        rank's own residual columns and its GEMM can accumulate into the residual."""
        return layers.kernel_inputs(h)[0] is not None and h.ndim == 2

    def out_proj_cache(self, x: Array, name: str, P: FlatBuffer, tape: Tape) -> ProjectionCache:
        """Without the output: the B GEMM is skipped (local work only, never a collective)."""
        return self._bottleneck_forward(x, None, [name], P, tape, output=False)[1]

    def out_proj_backward(self, dy: Array, cache: ProjectionCache, P: FlatBuffer, grads: FlatBuffer) -> Array:
        return self._bottleneck_backward([dy], cast(BottleneckCache, cache), P, grads)  # its own forward's

    def _bottleneck_forward(self, x: Array, norm_name: str | None, names: list[str], P: FlatBuffer, tape: Tape,
                            output: bool = True, stats: tuple[Array, Array] | None = None,
                            into: Array | None = None) -> tuple[list[Array], BottleneckCache]:
        sl = col_slices([P[f"{nm}/A"].shape[1] for nm in names])
        # online RMSNorm's first half: x * w and this shard's sum of squares, in one pass (`stats`:
        # already made with the residual add that gave x)
        if stats is not None:
            xw, ss = stats
        else:
            xw, ss = layers.rmsnorm_online_stats(x, P[norm_name]) if norm_name else (x, None)
        activated = None
        if tape.replaying:
            Z, rstd = tape.take()
        else:
            A = P.columns([f"{nm}/A" for nm in names])  # [A_1 | A_2 | ...], stored side by side
            Z, rstd, activated = self._reduce_bottleneck(xw, ss, A, sl, tape)
            tape.keep((Z, rstd))
        # Z is copied to the tp region (the identity forward), then activated, unless the rescale did it
        Zs, sig = activated or activate(copy_to_tp_region(Z, self.tp), self.act, tape)
        if into is not None:  # one linear (o, down): its product added into the residual `into`
            outs = [matmul(Zs, P[f"{names[0]}/B"], out=into, accumulate=True)]
        else:
            outs = self._b_products(Zs, sl, names, P) if output else []
        return outs, BottleneckCache(x, xw, norm_name, Z, Zs, rstd, names, sl, sig)

    def _b_products(self, Zs: Array, sl: list[slice], names: list[str], P: FlatBuffer) -> list[Array]:
        """[Zs[:, s_j] @ B_j]: on a GPU, when grouped, factors of one shape stored one after another
        (k and v, gate and up) as one strided-batched GEMM that reads their column blocks of Zs and
        their B factors where they lie (no stacked copies); the rest one GEMM each."""
        lefts, rights = [Zs[:, s] for s in sl], [P[f"{nm}/B"] for nm in names]
        if get_array_module(Zs) is np or not self.grouped:
            return grouped_matmul(lefts, rights)
        outs, j = [], 0
        while j < len(names):
            run = 1
            while (j + run < len(names) and rights[j + run].shape == rights[j].shape
                   and sl[j + run].start == sl[j + run - 1].stop):
                run += 1
            B = P.stacked([f"{nm}/B" for nm in names[j:j + run]]) if run > 1 else None
            if B is None:
                outs.append(matmul(lefts[j], rights[j]))
                j += 1
                continue
            width = sl[j].stop - sl[j].start
            Zb = Zs[:, sl[j].start:sl[j + run - 1].stop].reshape(Zs.shape[0], run, width).transpose(1, 0, 2)
            outs += list(matmul(Zb, B))
            j += run
        return outs

    def _reduce_bottleneck(self, xw: Array, ss: Array | None, A: Array, sl: list[slice], tape: Tape,
                           ) -> tuple[Array, Array | None, tuple[Array, Array | None] | None]:
        """The only forward communication of a btp group: Z = rmsnorm(x)·A exactly, from shards.
        Returns (Z, rstd [N, 1], activated); rstd is None without a norm; activated is (silu(Z),
        its sigmoid or None) when the online rescale computed the SiLU too (cola), else None. Z and
        rstd, which lowrank keeps, are made by `tape.alloc` when it has one (on a GPU: the kept pool)."""
        alloc = tape.alloc
        if ss is None:
            return self._reduce_products(xw, A, sl, alloc=alloc), None, None
        if self.online:
            # the sum of squares travels in the same collective as the unnormalised A-product (in
            # float32 at least), then online RMSNorm's second half rescales the rows (cola: and
            # applies the SiLU in the same pass)
            prod, ss_total = self._reduce_products(xw, A, sl, ss)
            if self.act:  # one kernel on a GPU: Z, its SiLU and the statistic
                Z, Zs, sig, rstd = layers.rescale_rows_silu(prod, ss_total, self.C, self.eps, keep=tape.backward_follows,
                                                            alloc=alloc)
                return Z, rstd[:, None], (Zs, sig)
            rstd = layers.online_rstd(ss_total, self.C, self.eps)[:, None]
            return layers.rescale_rows(prod, ss_total, self.C, self.eps, alloc), rstd, None
        # sync: a separate all-reduce of the statistic first, then normalise and multiply
        reduce_from_tp_region(ss, self.tp)
        return self._reduce_products(layers.rescale_rows(xw, ss, self.C, self.eps), A, sl, alloc=alloc), \
            layers.online_rstd(ss, self.C, self.eps)[:, None], None

    def _reduce_products(self, x: Array, A: Array, sl: list[slice], extra: Array | None = None,
                         alloc: Alloc | None = None) -> Array | tuple[Array, Array]:
        """x·[A_1 | A_2 | ...] reduced from the tp region (A = [A_1 | A_2 | ...], A_j its column
        slices `sl`): one GEMM and one all-reduce when grouped, else one of each per factor. With
        `extra` [N] (the sum of squares, in the accumulation dtype), returns (products, extra
        summed) from the same collective: riding after the products [N, R] in one buffer when x's
        dtype holds it exactly (float32, float64), else (bfloat16) in a buffer of its own dtype,
        reduced with the products in one group call, so the statistic keeps float32's 24-bit
        mantissa instead of bfloat16's 8. `alloc(shape, dtype)`, when given, makes the products' buffer
        (kept by lowrank when nothing rescales it)."""
        xp = get_array_module(x)
        N, R = x.shape[0], A.shape[1]
        ride = extra is not None and extra.dtype == x.dtype
        size = N * R + (N if ride else 0)
        flat = alloc((size,), x.dtype) if alloc else xp.empty(size, dtype=x.dtype)
        prod = flat[:N * R].reshape(N, R)
        if ride:
            tail = flat[N * R:]
            tail[...] = extra
        elif extra is not None:
            tail = xp.ascontiguousarray(extra)  # this rank's own statistic: summed in place

        def reduce(buf: Array, j: int) -> Array:
            if j == 0 and extra is not None and not ride:
                return reduce_from_tp_region_many([buf, tail], self.tp)[0]
            return reduce_from_tp_region(buf, self.tp)

        if self.grouped:
            matmul(x, A, out=prod)
            reduce(flat, 0)
        else:
            for j, s in enumerate(sl):
                piece = matmul(x, A[:, s])
                if j == 0 and ride:
                    both = reduce_from_tp_region(xp.concatenate([piece.reshape(-1), tail]), self.tp)
                    prod[:, s], tail[...] = both[:N * piece.shape[1]].reshape(piece.shape), both[N * piece.shape[1]:]
                else:
                    prod[:, s] = reduce(piece, j)
        return (prod, tail) if extra is not None else prod

    def _a_grads(self, xw: Array, dP: Array, sl: list[slice], names: list[str], grads: FlatBuffer) -> None:
        """grads[A_j] += xw^T · dP[:, s_j] for each factor. On a GPU, grouped, with the gradients of the
        A factors stored side by side (as the factors are): one GEMM accumulating into all of them,
        each output column the same dot product over the rows (its float32 summation order cuBLAS's).
        On the CPU one GEMM per factor's column block, the specification."""
        whole = grads.side_by_side([f"{nm}/A" for nm in names]) if self.grouped and len(names) > 1 else None
        if whole is not None and get_array_module(dP) is not np:
            matmul(xw.T, dP, out=whole, accumulate=True)
            return
        for s, nm in zip(sl, names):
            matmul(xw.T, dP[:, s], out=grads[f"{nm}/A"], accumulate=True)

    def _bottleneck_backward(self, douts: list[Array], cache: BottleneckCache, P: FlatBuffer, grads: FlatBuffer,
                             residual: Array | None = None) -> Array:
        """d(x) of the group (plus `residual`, a gradient that meets it at x, when given)."""
        x, xw, norm_name, Z, Zs, rstd, names, sl, sig = cache
        xp = get_array_module(x)
        dZs = xp.empty_like(Z)
        # each factor's GEMM writes its column block of dZs in place
        grouped_matmul(douts, [P[f"{nm}/B"].T for nm in names], outs=[dZs[:, s] for s in sl])
        # copy_to_tp_region's backward sums the partial dZ of every rank, started before dB's GEMMs
        # (one all-reduce when grouped, else one per factor)
        pieces = [dZs] if self.grouped or len(sl) == 1 else [xp.ascontiguousarray(dZs[:, s]) for s in sl]
        req = copy_to_tp_region_backward_async(pieces, self.tp)
        grouped_matmul([Zs[:, s].T for s in sl], douts, outs=[grads[f"{nm}/B"] for nm in names], accumulate=True)
        req.wait()
        if len(pieces) > 1:
            for s, piece in zip(sl, pieces):
                dZs[:, s] = piece
        A = P.columns([f"{nm}/A" for nm in names])
        if norm_name is None:
            dZ = layers.silu_backward(dZs, Z, sig) if self.act else dZs
            dZ = reduce_from_tp_region_backward(dZ, self.tp)  # Z was reduced from the region
            dx = matmul(dZ, A.T)
            self._a_grads(xw, dZ, sl, names, grads)
            return dx if residual is None else residual + dx
        # exact backward of Z = (sum_i xw_i·A_i) * rstd(S), S = sum of squares over all shards
        # (layers.btp_norm_backward_pre/post: one kernel each on a GPU, around the GEMM)
        dP, dS = layers.btp_norm_backward_pre(dZs, Z, rstd, self.C, self.act, sig)
        dP = reduce_from_tp_region_backward(dP, self.tp)  # the product was reduced from the region
        dxw = matmul(dP, A.T, dtype=statistic_dtype(x.dtype))  # the float32 accumulator, not rounded
        self._a_grads(xw, dP, sl, names, grads)
        return layers.btp_norm_backward_post(dxw, x, P[norm_name], dS, grads[norm_name], residual)
