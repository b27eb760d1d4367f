"""The transformer block, written once for every layout.

Tensor parallelism enters only through `tp_layers` (boostmpi/parallel/tensor_parallel/), which owns how
each linear group is split and communicated; with a group of one it is the single-device model.
Recompute enters only through the `Tape` a forward is handed (boostmpi/model/recompute.py).
Shapes: h [N, Cl] where N = B*T and Cl is the local residual width (C, or C/p under btp);
Hl, Hkvl are the local heads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, TypeAlias, overload

from boostmpi.arrays import Array
from boostmpi.backend import get_array_module
from boostmpi.model import layers
from boostmpi.model.params import FlatBuffer
from boostmpi.model.recompute import NO_TAPE, Tape, own_buffer

if TYPE_CHECKING:
    from boostmpi.config import Config
    from boostmpi.gpu.attention import AttentionContext
    from boostmpi.model.layers import AttentionCache

ProjectionCache: TypeAlias = object
"""A tensor-parallel strategy's cache of one linear group: its own NamedTuple, which only its backward reads."""


class LinearGroups(Protocol):
    """What the block asks of a tensor-parallel strategy (declared in full, with the embedding and the
    head, as boostmpi.parallel.tensor_parallel.base.TensorParallelStrategy): each linear group with its
    norm, split and communicated as the strategy does. `names` are parameter names of P; `tape` says
    what the forward is for (boostmpi/model/recompute.py)."""

    cfg: Config
    C: int  # d_model
    n_heads: int  # this rank's q heads
    n_kv_heads: int  # this rank's kv heads

    def in_proj_forward(self, x: Array, norm_name: str, names: list[str], P: FlatBuffer,
                        tape: Tape = NO_TAPE) -> tuple[list[Array], ProjectionCache]:
        """norm(x) and the linears `names` reading it: (their outputs, cache)."""
        ...

    def residual_in_proj_forward(self, h: Array, y: Array, norm_name: str, names: list[str], P: FlatBuffer,
                                 tape: Tape, copy: Array | None = None) -> tuple[Array, list[Array], ProjectionCache]:
        """The residual add h + y and in_proj_forward on it: (h + y, outputs, cache); h + y is also
        written to `copy` when given."""
        ...

    def output_accumulates(self, h: Array) -> bool:
        """Whether out_proj_forward adds its output into a residual buffer in its last GEMM (cuBLAS
        beta = 1: no addition kernel) for a residual like h."""
        ...

    def in_proj_backward(self, douts: list[Array], cache: ProjectionCache, P: FlatBuffer, grads: FlatBuffer,
                         residual: Array | None = None) -> Array:
        """Accumulates the group's gradients into grads; returns d(x), plus `residual` when given (the
        gradient that meets d(x) at the residual: a strategy may add it inside its norm's backward)."""
        ...

    def out_proj_forward(self, x: Array, name: str, P: FlatBuffer, tape: Tape = NO_TAPE,
                         accumulate_into: Array | None = None) -> tuple[Array, ProjectionCache]:
        """The linear `name` (o, down) into the residual: (y, cache); with `accumulate_into` (a residual)
        y is added to it and it is returned as y."""
        ...

    def out_proj_cache(self, x: Array, name: str, P: FlatBuffer, tape: Tape) -> ProjectionCache:
        """out_proj_forward's cache alone, for a recompute that never reads y."""
        ...

    def out_proj_backward(self, dy: Array, cache: ProjectionCache, P: FlatBuffer, grads: FlatBuffer) -> Array:
        """Accumulates the linear's gradients into grads; returns d(x)."""
        ...


@dataclass
class BlockCache:
    """What a block's backward reads. The backward takes each part out (`pop`) as it reads it,
    so the layer's activations leave memory while its backward runs."""
    qkv: ProjectionCache  # the strategy's cache of attn_norm and q/k/v
    attn: object  # layers.AttentionCache (under recompute = selective, until the backward: the core's q, k, v)
    o: ProjectionCache
    gate_up: ProjectionCache  # the strategy's cache of mlp_norm and gate/up
    gate: tuple[Array, Array, Array | None]  # (g, u, sigmoid(g) when kept, else None)
    down: ProjectionCache = None

    @overload
    def pop(self, part: Literal["gate"]) -> tuple[Array, Array, Array | None]: ...

    @overload
    def pop(self, part: Literal["attn"]) -> AttentionCache | AttentionContext: ...

    @overload
    def pop(self, part: str) -> object: ...

    def pop(self, part: str) -> object:
        value = getattr(self, part)
        setattr(self, part, None)
        return value


class Block:
    """Decoder layer i, bound to this rank's parameters P, strategy and rope tables, for
    micro-batches of shape (B, T): h + attn(norm(h)), then + mlp(norm(.))."""

    def __init__(self, i: int, P: FlatBuffer, tp_layers: LinearGroups, rope: tuple[Array, Array],
                 shape: tuple[int, int]) -> None:
        self.i, self.P, self.tp_layers, self.rope, self.shape = i, P, tp_layers, rope, shape
        self.pre = f"layers/{i}/"

    def forward(self, h: Array, tape: Tape = NO_TAPE,
                out_alloc: Callable[[tuple[int, ...], object], Array] | None = None) -> tuple[Array, BlockCache]:
        """-> (h_out, BlockCache). `out_alloc(shape, dtype)`, when given, allocates h_out: a recompute
        policy that keeps h_out as the next layer's input passes the allocator of what it keeps (on a
        GPU, the kept pool: boostmpi.gpu.pools)."""
        if self.tp_layers.output_accumulates(h):
            # the residual after attention is written twice (one kernel): the MLP's norm keeps one
            # copy, the down projection's last GEMM accumulates the layer's output into the other
            out = (out_alloc or (lambda shape, dtype: get_array_module(h).empty(shape, dtype=dtype)))(h.shape, h.dtype)
            h, a, cache = self._before_down_proj(h, tape, copy=out)
            out, cache.down = self.tp_layers.out_proj_forward(a, self.pre + "down", self.P, tape, accumulate_into=out)
            return out, cache
        h, a, cache = self._before_down_proj(h, tape)
        y, cache.down = self.tp_layers.out_proj_forward(a, self.pre + "down", self.P, tape)
        if out_alloc is None:
            return h + y, cache
        return get_array_module(h).add(h, y, out=out_alloc(h.shape, h.dtype)), cache

    def recompute(self, h: Array, tape: Tape) -> BlockCache:
        """The BlockCache of the forward again, for a backward that follows at once (`tape` replays
        or reruns): the layer's output is never read, so it is not produced."""
        h, a, cache = self._before_down_proj(h, tape)
        cache.down = self.tp_layers.out_proj_cache(a, self.pre + "down", self.P, tape)
        return cache

    def _before_down_proj(self, h: Array, tape: Tape, copy: Array | None = None) -> tuple[Array, Array, BlockCache]:
        """The layer up to the down projection: (the residual after attention, also written to `copy`
        when given, the down projection's input, the BlockCache without its `down` part)."""
        P, tp_layers, rope, pre = self.P, self.tp_layers, self.rope, self.pre
        B, T = self.shape
        Dh = tp_layers.C // tp_layers.cfg.model.n_heads
        (q, k, v), c_qkv = tp_layers.in_proj_forward(h, pre + "attn_norm", [pre + "q", pre + "k", pre + "v"], P, tape)
        # q and k are the projections' fresh outputs, read by nothing else: rotated in place on a GPU
        q = layers.rope_forward(q.reshape(B, T, tp_layers.n_heads, Dh), *rope, in_place=True)
        k = layers.rope_forward(k.reshape(B, T, tp_layers.n_kv_heads, Dh), *rope, in_place=True)
        stats = tape.take() if tape.replaying else None  # lowrank keeps the softmax statistics
        v = v.reshape(B, T, tp_layers.n_kv_heads, Dh)
        o, c_att = layers.attention_forward(q, k, v, keep_probs=tape.backward_follows, stats=stats, alloc=tape.alloc)
        tape.keep((c_att.row_max, c_att.row_sum))
        attn: object = c_att
        if tape.keeps_core_inputs:  # selective: the core's inputs instead of its cache (recompute.py)
            attn = (q, k, own_buffer(v))
        y, c_o = tp_layers.out_proj_forward(o.reshape(B * T, -1), pre + "o", P, tape)
        # the residual add and the MLP norm's first pass: one kernel under btp on a GPU
        h, (g, u), c_gu = tp_layers.residual_in_proj_forward(h, y, pre + "mlp_norm", [pre + "gate", pre + "up"], P, tape,
                                                             copy=copy)
        a, s_gate = layers.gate_and_sigmoid(g, u, tp_layers.cfg.model.mlp_gate_act, keep=tape.backward_follows)
        return h, a, BlockCache(c_qkv, attn, c_o, c_gu, (g, u, s_gate))

    def backward(self, dh: Array, cache: BlockCache, grads: FlatBuffer) -> Array:
        """Accumulates the layer's parameter gradients into grads; returns d(input residual)."""
        P, tp_layers, rope = self.P, self.tp_layers, self.rope
        act = tp_layers.cfg.model.mlp_gate_act
        da = tp_layers.out_proj_backward(dh, cache.pop("down"), P, grads)
        g, u, s_gate = cache.pop("gate")
        dg, du = layers.gate_backward(da, g, u, act, s_gate)
        del da, g, u, s_gate
        # the gradients meeting at each residual are summed by the strategy (btp: in its norm's kernel)
        dh = tp_layers.in_proj_backward([dg, du], cache.pop("gate_up"), P, grads, residual=dh)
        del dg, du
        do = tp_layers.out_proj_backward(dh, cache.pop("o"), P, grads)
        B, T = self.shape
        dq, dk, dv = layers.attention_backward(do.reshape(B, T, -1), cache.pop("attn"))
        del do
        dq = layers.rope_backward(dq, *rope).reshape(B * T, -1)
        dk = layers.rope_backward(dk, *rope).reshape(B * T, -1)
        return tp_layers.in_proj_backward([dq, dk, dv.reshape(B * T, -1)], cache.pop("qkv"), P, grads, residual=dh)
