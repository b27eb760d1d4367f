"""Vanilla low-rank tensor parallelism: Megatron's recipe applied to each factor of a low-rank linear.

  [RMSNorm, replicated] -> copy_to_tp_region -> A column-parallel [in, R/p] -> SiLU (cola) on the
  local R/p slice -> B row-parallel [R/p, out] -> reduce_from_tp_region (the full [N, out] output).
The residual, the norms and the attention are replicated; embedding and head are vocabulary-parallel.
"""

from __future__ import annotations

from typing import NamedTuple, cast

import numpy as np

from boostmpi.arrays import Array
from boostmpi.backend import get_array_module
from boostmpi.model import layers
from boostmpi.model.layers import col_slices, matmul
from boostmpi.model.params import FlatBuffer
from boostmpi.model.recompute import NO_TAPE, Tape
from boostmpi.model.transformer import ProjectionCache
from boostmpi.parallel.mappings import (copy_to_tp_region, reduce_from_tp_region, reduce_from_tp_region_backward,
                                        reduce_from_tp_region_many)
from boostmpi.parallel.tensor_parallel.base import NormCache, ReplicatedResidual, activate, column_parallel_input_grad


class FactorCache(NamedTuple):
    x: Array  # [N, in] the group's input (replicated)
    Z: Array  # [N, R/p] x · A, this rank's columns
    Zs: Array  # silu(Z) (cola), else Z
    names: list[str]  # the group's linears
    sl: list[slice]  # their column slices of Z
    sig: Array | None  # sigmoid(Z) when kept for the backward, else None


class VanillaLowRankTP(ReplicatedResidual):
    def in_proj_forward(self, x: Array, norm_name: str, names: list[str], P: FlatBuffer, tape: Tape = NO_TAPE,
                        ) -> tuple[list[Array], ProjectionCache]:
        n, rstd = layers.rmsnorm_forward(x, P[norm_name], self.eps)
        outs, cache = self._factor_forward(n, names, P, tape)
        return outs, NormCache(x, norm_name, rstd, cache)

    def in_proj_backward(self, douts: list[Array], cache: ProjectionCache, P: FlatBuffer, grads: FlatBuffer,
                         residual: Array | None = None) -> Array:
        cache = cast(NormCache, cache)  # its own forward's
        dn = self._factor_backward(douts, cast(FactorCache, cache.inner), P, grads)
        dx = layers.rmsnorm_backward(dn, cache.x, P[cache.norm_name], cache.rstd, grads[cache.norm_name])
        return dx if residual is None else residual + dx

    def out_proj_forward(self, x: Array, name: str, P: FlatBuffer, tape: Tape = NO_TAPE,
                         accumulate_into: Array | None = None) -> tuple[Array, ProjectionCache]:
        # a recompute produces the output too: its all-reduce is part of the forward's collectives
        outs, cache = self._factor_forward(x, [name], P, tape)
        if accumulate_into is not None:  # all-reduced first: the add stays
            accumulate_into += outs[0]
            return accumulate_into, cache
        return outs[0], cache

    def out_proj_backward(self, dy: Array, cache: ProjectionCache, P: FlatBuffer, grads: FlatBuffer) -> Array:
        return self._factor_backward([dy], cast(FactorCache, cache), P, grads)  # its own forward's

    def _factor_forward(self, x: Array, names: list[str], P: FlatBuffer, tape: Tape) -> tuple[list[Array], FactorCache]:
        xp = get_array_module(x)
        x = copy_to_tp_region(x, self.tp)
        A_names = [f"{nm}/A" for nm in names]
        sl = col_slices([P[n].shape[1] for n in A_names])
        if tape.replaying:
            (Z,) = tape.take()
        elif self.grouped:
            Z = tape.keep((matmul(x, P.columns(A_names)),))[0]  # the factors stored side by side: one GEMM
        else:  # one GEMM per factor, each writing its column block of Z in place
            Z = xp.empty((x.shape[0], sl[-1].stop), dtype=x.dtype)
            for s, n in zip(sl, A_names):
                matmul(x, P[n], out=Z[:, s])
            Z = tape.keep((Z,))[0]
        Zs, sig = activate(Z, self.act, tape)
        if self.grouped and len(names) > 1 and self.p > 1:  # one collective for the whole group
            ys = [matmul(Zs[:, s], P[f"{nm}/B"]) for s, nm in zip(sl, names)]
            if xp is np:  # the products side by side in one buffer, one all-reduce
                cols = col_slices([y.shape[1] for y in ys])
                buf = reduce_from_tp_region(xp.concatenate(ys, axis=1), self.tp)
                ys = [buf[:, c] for c in cols]
            else:  # on a GPU each product stays its own array, whole rows for the fused kernels that read
                # it (RoPE, attention, the gate), and the all-reduces are one NCCL group
                ys = reduce_from_tp_region_many(ys, self.tp)
        else:
            ys = [matmul(Zs[:, s], P[f"{nm}/B"]) for s, nm in zip(sl, names)]
            ys = [reduce_from_tp_region(y, self.tp) for y in ys]
        return ys, FactorCache(x, Z, Zs, names, sl, sig)

    def _factor_backward(self, douts: list[Array], cache: FactorCache, P: FlatBuffer, grads: FlatBuffer) -> Array:
        x, Z, Zs, names, sl, sig = cache
        xp = get_array_module(x)
        dZs = xp.empty_like(Z)
        douts = [reduce_from_tp_region_backward(dy, self.tp) for dy in douts]
        for s, nm, dy in zip(sl, names, douts):
            matmul(dy, P[f"{nm}/B"].T, out=dZs[:, s])  # written in place, a column block of dZs
            matmul(Zs[:, s].T, dy, out=grads[f"{nm}/B"], accumulate=True)
        dZ = layers.silu_backward(dZs, Z, sig) if self.act else dZs
        parts, req = column_parallel_input_grad([dZ[:, s] for s in sl], P, [f"{nm}/A" for nm in names],
                                                self.grouped, self.tp, side_by_side=dZ)
        for s, nm in zip(sl, names):  # weight gradients while the input gradient travels
            matmul(x.T, dZ[:, s], out=grads[f"{nm}/A"], accumulate=True)
        req.wait()
        return sum(parts[1:], parts[0])
