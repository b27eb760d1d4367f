"""Recompute: what a layer keeps between its forward and its backward, and how it gets the rest back.

`[train] recompute` picks one policy (`POLICIES`):
  none      the layer's whole cache is kept.
  layer     only the layer's input is kept; the backward runs the layer's forward again first,
            collectives included.
  selective everything but the attention core's own cache is kept: the core's inputs q, k, v (after
            RoPE) instead of its scaled and transposed copies and its softmax statistics per
            head and token (two on the CPU path, the GPU kernels' one log-sum-exp on the GPU
            path); the backward runs the core's forward again first (no collective, no
            projection: only the scores, softmax and probabilities @ v of each layer).
  lowrank   the layer's input and a `Tape` are kept: what each of the layer's collectives produced
            (the post-all-reduce rank-R activations, with the RMSNorm statistic that rode along)
            and the attention's softmax statistics per head and token (the CPU path's maximum and
            sum; on a GPU the attention backend's float32 log-sum-exp: `FusedAttentionCache` of the
            own kernels, `CudnnContext.stats` of cuDNN, both as `row_max`). The recompute replays
            the tape instead of computing the A GEMMs and communicating again, and instead of
            reducing the attention scores again. The first layer of the first stage keeps no input
            when the embedding lookup is local: it is looked up again from the token ids.

A forward learns what is asked of it from the `Tape` it is handed (its `mode`):
  "forward"  a plain forward: keeps nothing extra.
  "record"   lowrank's forward: `keep` appends each collective's result.
  "replay"   lowrank's recompute: `take` hands them back in order.
  "rerun"    layer's recompute: everything computed again.
  "selective" a plain forward whose cache holds the attention core's inputs (`keeps_core_inputs`).
In "replay" and "rerun" the backward follows at once (`backward_follows`): the forward's cache may then
also hold what the backward would otherwise compute again (the SiLUs' sigmoids, the attention's
probability tiles) and the layer's output, which nothing reads, is not produced.

`RecomputePolicy` declares what a policy offers the engine; the four classes of `POLICIES` implement
it, and the type check holds them to it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar, cast

import numpy as np

from boostmpi.arrays import Alloc, Array
from boostmpi.backend import get_array_module
from boostmpi.model import layers

if TYPE_CHECKING:
    from boostmpi.model.transformer import Block, BlockCache

Kept = tuple[Array, ...]  # what a forward keeps on a tape: arrays (None for an absent statistic)
K = TypeVar("K", bound=Kept)


class Tape:
    def __init__(self, mode: str = "forward") -> None:
        self.mode = mode
        self.items: list[Kept] = []  # tuples of arrays (None for an absent statistic), in forward order
        self._next = 0
        self._alloc: Alloc | None = None  # while recording on a GPU: what a kept array is allocated with

    def start_recording(self, alloc: Alloc | None = None) -> Tape:
        self.mode, self.items, self._next, self._alloc = "record", [], 0, alloc
        return self

    def stop_allocating(self) -> None:
        """The recording forward is over: nothing more is allocated with the recording's `alloc`."""
        self._alloc = None

    @property
    def alloc(self) -> Alloc | None:
        """`alloc(shape, dtype)` for an array this forward keeps (on a GPU: from the kept pool,
        boostmpi.gpu.pools), or None: the caller allocates as it would anyway."""
        return self._alloc if self.mode == "record" else None

    def start_replaying(self) -> Tape:
        self.mode, self._next = "replay", 0
        return self

    @property
    def replaying(self) -> bool:
        return self.mode == "replay"

    @property
    def backward_follows(self) -> bool:
        return self.mode in ("replay", "rerun")

    @property
    def keeps_core_inputs(self) -> bool:
        return self.mode == "selective"

    def keep(self, item: K) -> K:
        """Record `item` when recording; returns it either way."""
        if self.mode == "record":
            self.items.append(item)
        return item

    def take(self) -> Kept:
        """The next recorded item (replaying)."""
        item = self.items[self._next]
        self._next += 1
        return item


def own_buffer(a: Array) -> Array:
    """`a`, or a copy of it when it is a view into a larger buffer (v as a column block of a grouped
    projection's output): what is kept must not keep the rest of that buffer alive."""
    base = a
    while getattr(base, "base", None) is not None:
        base = base.base
    return a.copy() if base.size > a.size else a


NO_TAPE = Tape()  # a plain forward
RERUN = Tape("rerun")  # the recompute of a layer that kept only its input
SELECTIVE = Tape("selective")  # a forward that keeps the attention core's inputs, not its cache


@dataclass
class Saved:
    """What one layer keeps between its forward and its backward."""
    cache: BlockCache | None = None  # the whole cache (none)
    h: Array | None = None  # the layer's input (layer, lowrank; None where it is looked up again)
    tape: Tape | None = None  # lowrank


class RecomputePolicy(Protocol):
    """What a layer keeps between its forward and its backward, and how its backward gets its cache
    back. `lean_head`: the head keeps only what came out of collectives (its backward recomputes the
    logits)."""

    lean_head: bool

    def forward(self, block: Block, h: Array, input_is_lookup: bool) -> tuple[Array, Saved]:
        """The layer's forward on h: (its output, what this policy keeps). `input_is_lookup`: h is the
        embedding's lookup, which can be made again from the token ids without communication."""
        ...

    def cache(self, block: Block, saved: Saved, look_up: Callable[[], Array]) -> BlockCache:
        """The layer's BlockCache for its backward, from what `forward` kept (`look_up()` makes the
        layer's input again where it was not kept)."""
        ...


def _kept_alloc(h: Array) -> Alloc | None:
    """What a recompute policy allocates the arrays it keeps with: on a GPU the kept pool's
    `kept_empty`, on the CPU None (NumPy allocates as it would anyway)."""
    if get_array_module(h) is np:
        return None
    from boostmpi.gpu.pools import kept_empty

    return kept_empty


class NoRecompute:
    lean_head = False

    def forward(self, block: Block, h: Array, input_is_lookup: bool) -> tuple[Array, Saved]:
        h_out, cache = block.forward(h)
        return h_out, Saved(cache=cache)

    def cache(self, block: Block, saved: Saved, look_up: Callable[[], Array]) -> BlockCache:
        assert saved.cache is not None  # kept by forward
        return saved.cache


class LayerRecompute:
    lean_head = False

    def forward(self, block: Block, h: Array, input_is_lookup: bool) -> tuple[Array, Saved]:
        """The layer keeps its input; on a GPU its output, the next layer's kept input, is allocated
        from the kept pool (boostmpi.gpu.pools: why)."""
        h_out, _ = block.forward(h, out_alloc=_kept_alloc(h))
        return h_out, Saved(h=h)

    def cache(self, block: Block, saved: Saved, look_up: Callable[[], Array]) -> BlockCache:
        return block.recompute(saved.h, RERUN)  # re-issues the layer's forward collectives


class LowRankRecompute:
    lean_head = True  # the head keeps the gathered residual and the softmax statistics, not the logits

    def forward(self, block: Block, h: Array, input_is_lookup: bool) -> tuple[Array, Saved]:
        """On a GPU what the layer keeps (with its output, the next layer's input) is allocated from
        the kept pool (boostmpi.gpu.pools: why)."""
        alloc = _kept_alloc(h)
        tape = Tape().start_recording(alloc)
        h_out, _ = block.forward(h, tape, out_alloc=alloc)
        tape.stop_allocating()
        return h_out, Saved(h=None if input_is_lookup else h, tape=tape)

    def cache(self, block: Block, saved: Saved, look_up: Callable[[], Array]) -> BlockCache:
        h = look_up() if saved.h is None else saved.h
        assert saved.tape is not None  # kept by forward
        return block.recompute(h, saved.tape.start_replaying())  # no communication


class SelectiveRecompute:
    """Attention's core recomputed in the backward, everything else kept (Korthikanti et al. 2022,
    "selective activation recomputation"). The engine's core never keeps the T x T probabilities (its
    backward recomputes them tile by tile), so what this saves is the core's softmax statistics; the
    core's forward runs again, and its backward then reads the probability tiles that forward kept
    instead of computing them (docs/MEMORY.md). The same bits as `none`: the scores come from the same
    q, k, v by the same operations."""
    lean_head = False

    def forward(self, block: Block, h: Array, input_is_lookup: bool) -> tuple[Array, Saved]:
        h_out, cache = block.forward(h, SELECTIVE)
        return h_out, Saved(cache=cache)

    def cache(self, block: Block, saved: Saved, look_up: Callable[[], Array]) -> BlockCache:
        cache = saved.cache
        assert cache is not None  # kept by forward
        q, k, v = cast(tuple[Array, Array, Array], cache.attn)  # the core's inputs (Block: keeps_core_inputs)
        cache.attn = layers.attention_forward(q, k, v, keep_probs=True)[1]
        return cache


POLICIES: dict[str, type[RecomputePolicy]] = {"none": NoRecompute, "layer": LayerRecompute,
                                              "lowrank": LowRankRecompute, "selective": SelectiveRecompute}
