"""Tensor parallelism: how each linear group, the embedding and the head are split and communicated.

Three strategies, one module each, share one interface (`base.Strategy`), so the transformer
block (boostmpi/model/transformer.py) is written once:
  btp.BottleneckTP           residual [N, C/p]; A row-parallel -> reduce from the tp region (the
                             rank-R activation, the online RMSNorm's statistic riding along) ->
                             B column-parallel.
  vanilla.VanillaLowRankTP   Megatron applied to each factor: A column-parallel along R, B
                             row-parallel along R, reduce from the tp region after every B.
  megatron.MegatronTP        full rank: q/k/v/gate/up column-parallel, o/down row-parallel.
The collectives are the region mappings of boostmpi/parallel/mappings.py, called by name; the head
and cross-entropy are boostmpi/parallel/vocab_parallel.py. With a tensor-parallel group of one,
every strategy is the plain single-device model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from boostmpi.model.params import tp_strategy
from boostmpi.parallel.tensor_parallel.btp import BottleneckTP
from boostmpi.parallel.tensor_parallel.megatron import MegatronTP
from boostmpi.parallel.tensor_parallel.base import TensorParallelStrategy
from boostmpi.parallel.tensor_parallel.vanilla import VanillaLowRankTP

if TYPE_CHECKING:
    from boostmpi.config import Config
    from boostmpi.parallel.grid import ProcessGrid

# the type check holds each to the protocol
STRATEGIES: dict[str, Callable[[Config, ProcessGrid], TensorParallelStrategy]] = {
    "btp": BottleneckTP, "vanilla": VanillaLowRankTP, "megatron": MegatronTP}

__all__ = ["BottleneckTP", "MegatronTP", "VanillaLowRankTP", "STRATEGIES", "TensorParallelStrategy", "make_strategy"]


def make_strategy(cfg: Config, grid: ProcessGrid) -> TensorParallelStrategy:
    return STRATEGIES[tp_strategy(cfg)](cfg, grid)
