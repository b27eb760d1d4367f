"""The interface every tensor-parallel strategy implements (`TensorParallelStrategy`), and what they share.

  in_proj_forward(x, norm_name, names, P, tape) -> (outs, cache)   norm + the linears reading it
  residual_in_proj_forward(h, y, norm_name, names, P, tape) -> (h + y, outs, cache)   the same on h + y
  in_proj_backward(douts, cache, P, grads, residual=None) -> dx (+ residual)
  out_proj_forward(x, name, P, tape) -> (y, cache)                  o and down, into the residual
  out_proj_cache(x, name, P, tape) -> cache                         the same cache, y not needed
  out_proj_backward(dy, cache, P, grads) -> dx
  embed_forward(ids, P) -> h, embed_backward(ids, dh, grads)
  head_forward(h, targets, P, lean) -> (loss, HeadCache), head_backward(cache, scale, P, grads) -> dh
`P` and `grads` are the parameter and gradient views of this rank. The `tape`
(boostmpi/model/recompute.py) says what the forward is for: it records the post-communication
rank-R activations so that recompute = "lowrank" replays them instead of communicating again, and
when the backward follows at once the cache also holds the SiLU's sigmoid (NumPy path), which the
backward would otherwise compute again. The caches are each strategy's own NamedTuples, opaque to the
caller (`ProjectionCache`): what a strategy's forward made, only its backward reads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

from boostmpi.arrays import Array
from boostmpi.model import layers
from boostmpi.model.layers import concat_cols, matmul
from boostmpi.model.params import FlatBuffer, split_range
from boostmpi.model.recompute import NO_TAPE, Tape
from boostmpi.model.transformer import LinearGroups, ProjectionCache
from boostmpi.parallel import vocab_parallel
from boostmpi.parallel.comm import Communicator, Request
from boostmpi.parallel.mappings import copy_to_tp_region_backward_async

if TYPE_CHECKING:
    from boostmpi.config import Config
    from boostmpi.parallel.grid import ProcessGrid


class TensorParallelStrategy(LinearGroups, Protocol):
    """How a strategy splits and communicates each linear group, the embedding and the head: the
    block's linear groups (`LinearGroups`, what boostmpi/model/transformer.py calls) and the rest of the
    model that the engine calls. btp.BottleneckTP, vanilla.VanillaLowRankTP and megatron.MegatronTP
    implement it (`STRATEGIES`)."""

    tp: Communicator
    p: int  # the tensor-parallel size
    t: int  # this rank's tensor-parallel rank
    V: int
    v0: int  # this rank's vocabulary range [v0, v1)
    v1: int
    res_cols: tuple[int, int]  # this rank's residual columns [a, b)

    @property
    def embedding_is_local(self) -> bool:
        """Whether the embedding lookup needs no communication (a layer's input can be looked up again)."""
        ...

    def embed_forward(self, ids: Array, P: FlatBuffer) -> Array:
        """Token ids [N] -> this rank's residual h [N, C_local]."""
        ...

    def embed_backward(self, ids: Array, dh: Array, grads: FlatBuffer) -> None:
        """Accumulates the embedding's gradient from dh [N, C_local]."""
        ...

    def head_forward(self, h: Array, targets: Array, P: FlatBuffer,
                     lean: bool = False) -> tuple[float | Array, vocab_parallel.HeadCache]:
        """h [N, C_local], targets [N] -> (mean cross-entropy over N, cache)."""
        ...

    def head_backward(self, cache: vocab_parallel.HeadCache, scale: float, P: FlatBuffer, grads: FlatBuffer) -> Array:
        """d(loss)/d(h) [N, C_local] for loss = scale * the sum of per-token cross-entropies."""
        ...


class Strategy(ABC):
    """What every strategy shares: the layout's sizes and the head."""

    def __init__(self, cfg: Config, grid: ProcessGrid) -> None:
        m = cfg.model
        self.cfg = cfg
        self.tp = grid.tp
        self.p = grid.tp.size
        self.t = grid.tp.rank
        self.C = m.d_model
        self.eps = m.norm_eps
        self.act = m.arch == "cola"  # a SiLU between the factors
        self.grouped = cfg.parallel.grouped
        self.V = m.vocab_size
        self.v0, self.v1 = split_range(self.V, self.p, self.t)
        # local residual columns and local heads; a strategy that shards them sets its own
        self.res_cols = (0, self.C)
        self.n_heads = m.n_heads
        self.n_kv_heads = m.n_kv_heads

    @abstractmethod
    def in_proj_forward(self, x: Array, norm_name: str, names: list[str], P: FlatBuffer,
                        tape: Tape = NO_TAPE) -> tuple[list[Array], ProjectionCache]:
        """The group's norm and the linears `names` reading it: (their outputs, cache)."""

    @abstractmethod
    def out_proj_forward(self, x: Array, name: str, P: FlatBuffer, tape: Tape = NO_TAPE,
                         accumulate_into: Array | None = None) -> tuple[Array, ProjectionCache]:
        """The linear `name` (o, down) into the residual: (y, cache); with `accumulate_into`, y added to it."""

    def residual_in_proj_forward(self, h: Array, y: Array, norm_name: str, names: list[str], P: FlatBuffer,
                                 tape: Tape, copy: Array | None = None) -> tuple[Array, list[Array], ProjectionCache]:
        """The residual add h + y and in_proj_forward on its result: (h + y, outs, cache), h + y also
        written to `copy` when given. A strategy may fuse the add with its norm's first pass (btp)."""
        h = h + y
        if copy is not None:
            copy[...] = h
        return (h, *self.in_proj_forward(h, norm_name, names, P, tape))

    def output_accumulates(self, h: Array) -> bool:
        """Whether out_proj_forward's last GEMM adds into the residual itself (no addition kernel).
        Not where the output is all-reduced first (a row-parallel output): there the add stays."""
        return False

    def out_proj_cache(self, x: Array, name: str, P: FlatBuffer, tape: Tape) -> ProjectionCache:
        """out_proj_forward's cache, for a recompute that never reads the output."""
        return self.out_proj_forward(x, name, P, tape)[1]

    # -- the head: final norm on the whole residual, vocabulary-parallel logits and cross-entropy
    def _gather_residual(self, h: Array) -> Array:
        return h

    def _gather_residual_backward(self, dh: Array) -> Array:
        return dh

    def head_forward(self, h: Array, targets: Array, P: FlatBuffer,
                     lean: bool = False) -> tuple[float | Array, vocab_parallel.HeadCache]:
        """h [N, C_local], targets [N] -> (loss: mean CE over N, cache). `lean` (recompute =
        lowrank): keep only what came out of collectives; the backward recomputes the logits."""
        return vocab_parallel.head_forward(self._gather_residual(h), targets, P["final_norm"], P["lm_head"],
                                           self.eps, self.v0, self.tp, lean)

    def head_backward(self, cache: vocab_parallel.HeadCache, scale: float, P: FlatBuffer, grads: FlatBuffer) -> Array:
        """d(loss)/d(h) for loss = scale * sum of per-token CE; returns dh [N, C_local]."""
        dh = vocab_parallel.head_backward(cache, scale, P["final_norm"], P["lm_head"], grads["final_norm"],
                                          grads["lm_head"], self.tp)
        return self._gather_residual_backward(dh)


def activate(Z: Array, act: bool, tape: Tape) -> tuple[Array, Array | None]:
    """(silu(Z), its sigmoid when the backward follows at once, else None); (Z, None) without act."""
    return layers.silu_and_sigmoid(Z, keep=tape.backward_follows) if act else (Z, None)


class NormCache(NamedTuple):
    """The cache of a replicated RMSNorm and the linears that read its output."""
    x: Array  # [N, C] the norm's input
    norm_name: str
    rstd: Array  # [N, 1]
    inner: ProjectionCache  # the linears' cache


class ReplicatedResidual(Strategy):
    """What the Megatron-style strategies share: residual and norms replicated on every tp rank,
    and a vocabulary-parallel embedding."""

    @property
    def embedding_is_local(self) -> bool:
        return self.p == 1

    def embed_forward(self, ids: Array, P: FlatBuffer) -> Array:
        return vocab_parallel.embedding_forward(P["embed"], ids, self.v0, self.v1, self.tp)

    def embed_backward(self, ids: Array, dh: Array, grads: FlatBuffer) -> None:
        vocab_parallel.embedding_backward(grads["embed"], ids, dh, self.v0, self.v1)


def column_parallel_input_grad(douts: Sequence[Array], P: FlatBuffer, names: list[str], grouped: bool,
                               tp: Communicator, side_by_side: Array | None = None) -> tuple[list[Array], Request]:
    """d(input) of column-parallel matrices P[names] reading one input: sum_j d_j · M_j^T, then
    copy_to_tp_region's backward, started (one GEMM on the matrices side by side and one all-reduce
    when grouped, else one of each per matrix). `side_by_side`: the douts already are the column
    blocks of this one array, in order (no concatenation). Returns (parts, request): after
    request.wait() the gradient is sum(parts)."""
    if grouped:
        whole = concat_cols(douts) if side_by_side is None else side_by_side
        parts = [matmul(whole, P.columns(names).T)]
    else:
        parts = [matmul(d, P[n].T) for d, n in zip(douts, names)]
    return parts, copy_to_tp_region_backward_async(parts, tp)
