"""Megatron-LM tensor parallelism for the full-rank model.

  attention: [RMSNorm, replicated] -> copy_to_tp_region -> q/k/v column-parallel (local heads) ->
             attention on the local heads -> o row-parallel -> reduce_from_tp_region
  MLP:       [RMSNorm, replicated] -> copy_to_tp_region -> gate/up column-parallel (F/p) ->
             gated product -> down row-parallel -> reduce_from_tp_region
The residual and the norms are replicated; embedding and head are vocabulary-parallel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, cast

import numpy as np

from boostmpi.arrays import Array
from boostmpi.backend import get_array_module
from boostmpi.model import layers
from boostmpi.model.layers import col_slices, matmul
from boostmpi.model.params import FlatBuffer
from boostmpi.model.recompute import NO_TAPE, Tape
from boostmpi.model.transformer import ProjectionCache
from boostmpi.parallel.mappings import copy_to_tp_region, reduce_from_tp_region, reduce_from_tp_region_backward
from boostmpi.parallel.tensor_parallel.base import NormCache, ReplicatedResidual, column_parallel_input_grad

if TYPE_CHECKING:
    from boostmpi.config import Config
    from boostmpi.parallel.grid import ProcessGrid


class LinearCache(NamedTuple):
    x: Array  # [N, in/p] the row-parallel linear's input
    name: str


class MegatronTP(ReplicatedResidual):
    def __init__(self, cfg: Config, grid: ProcessGrid) -> None:
        super().__init__(cfg, grid)
        self.n_heads = cfg.model.n_heads // self.p
        self.n_kv_heads = cfg.model.n_kv_heads // self.p

    def in_proj_forward(self, x: Array, norm_name: str, names: list[str], P: FlatBuffer, tape: Tape = NO_TAPE,
                        ) -> tuple[list[Array], ProjectionCache]:
        n, rstd = layers.rmsnorm_forward(x, P[norm_name], self.eps)
        n = copy_to_tp_region(n, self.tp)
        W_names = [f"{nm}/W" for nm in names]
        widths = [P[w].shape[1] for w in W_names]
        if self.grouped and get_array_module(n) is not np and len(W_names) > 1 and len(set(widths)) == 1:
            # on a GPU matrices of one width (gate and up; q, k and v without GQA) as one strided-batched
            # GEMM over their column blocks where they lie: each output is an array of whole rows for
            # the kernels that read it (RoPE, attention, the gate), with no copy to make it so
            W = P.columns(W_names)
            outs = list(matmul(n, W.reshape(W.shape[0], len(W_names), widths[0]).transpose(1, 0, 2)))
        elif self.grouped:
            y = matmul(n, P.columns(W_names))  # the matrices stored side by side: one GEMM
            outs = [y[:, s] for s in col_slices(widths)]
        else:
            outs = [matmul(n, P[w]) for w in W_names]
        return outs, NormCache(x, norm_name, rstd, (n, names))

    def in_proj_backward(self, douts: list[Array], cache: ProjectionCache, P: FlatBuffer, grads: FlatBuffer,
                         residual: Array | None = None) -> Array:
        cache = cast(NormCache, cache)  # its own forward's
        n, names = cast(tuple[Array, list[str]], cache.inner)
        parts, req = column_parallel_input_grad(douts, P, [f"{nm}/W" for nm in names], self.grouped, self.tp)
        for nm, dy in zip(names, douts):  # weight gradients while the input gradient travels
            matmul(n.T, dy, out=grads[f"{nm}/W"], accumulate=True)
        req.wait()
        dn = sum(parts[1:], parts[0])
        dx = layers.rmsnorm_backward(dn, cache.x, P[cache.norm_name], cache.rstd, grads[cache.norm_name])
        return dx if residual is None else residual + dx

    def out_proj_forward(self, x: Array, name: str, P: FlatBuffer, tape: Tape = NO_TAPE,
                         accumulate_into: Array | None = None) -> tuple[Array, ProjectionCache]:
        y = reduce_from_tp_region(matmul(x, P[f"{name}/W"]), self.tp)
        if accumulate_into is not None:  # all-reduced first: the add stays
            accumulate_into += y
            return accumulate_into, LinearCache(x, name)
        return y, LinearCache(x, name)

    def out_proj_backward(self, dy: Array, cache: ProjectionCache, P: FlatBuffer, grads: FlatBuffer) -> Array:
        x, name = cast(LinearCache, cache)  # its own forward's
        dy = reduce_from_tp_region_backward(dy, self.tp)
        matmul(x.T, dy, out=grads[f"{name}/W"], accumulate=True)
        return matmul(dy, P[f"{name}/W"].T)
