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

from boostmpi.model.params import tp_strategy
from boostmpi.parallel.tensor_parallel.btp import BottleneckTP
from boostmpi.parallel.tensor_parallel.megatron import MegatronTP
from boostmpi.parallel.tensor_parallel.vanilla import VanillaLowRankTP

STRATEGIES = {"btp": BottleneckTP, "vanilla": VanillaLowRankTP, "megatron": MegatronTP}

__all__ = ["BottleneckTP", "MegatronTP", "VanillaLowRankTP", "STRATEGIES", "make_strategy"]


def make_strategy(cfg, grid):
    return STRATEGIES[tp_strategy(cfg)](cfg, grid)
