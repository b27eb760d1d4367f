"""The vocabulary of the performance model's plans: the operations a plan lists (GEMMs, elementwise
passes, the attention core, collectives), the sizes of a micro-batch on one tensor-parallel rank
(`Shape`), and the memory passes the elementwise work and the softmax cost. `plans.py` writes the
plans in these terms; `costs.py` prices each operation.

Letters as everywhere: N = B*T tokens of a micro-batch, C d_model, F d_ff, K kv width,
Ra/Rm attention/MLP rank, p = tp. docs/SIM.md explains every term.
"""

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from boostmpi.config import Config


# Full-buffer memory passes of the softmax of materialised attention scores, as boostmpi's NumPy
# attention runs it: forward = mask add (3), max (1), subtract (2), exp (2), sum (1), divide (2);
# backward = (dP*P) (3) and its row sum (1), subtract (2), multiply (3).
SOFTMAX_PASSES = (11, 9)
SOFTMAX_REDUCTION_PASSES = 2  # max and sum: what a recompute handed the statistics skips
# A GPU framework's fused scale-mask-softmax over materialised scores (Megatron's
# FusedScaleMaskSoftmax): forward reads the scores and writes the probabilities; backward reads the
# probabilities and their gradient and writes the scores' gradient. Its backward needs the
# probabilities, so they are kept: T values per row (Korthikanti et al. 2022's 2as^2b term).
FUSED_SOFTMAX_PASSES = (2, 3)
# Dropout on the materialised probabilities (model.attention_dropout > 0): forward reads them, writes
# the dropped ones and a one-byte mask (half a 16-bit pass); backward reads the gradient and the mask
# and writes the gradient. Where the probabilities are kept (a fused softmax), the mask is kept too.
ATTENTION_DROPOUT_PASSES = (2.5, 2.5)
# Cross-entropy over the local logits: max, exp-sum, target pick (forward); softmax minus one-hot (backward).
CROSS_ENTROPY_PASSES = (3, 3)


@dataclass
class Gemm:
    """y[m, n] = x[m, k] @ w[k, n], `batch` times; backward is dx (m, k, n) and dw (k, n, m)."""
    name: str
    m: int
    n: int
    k: int
    batch: int = 1
    saved: int = 0  # elements kept for backward (the input x, unless another op already keeps it)
    in_recompute: bool = True  # False: a recompute of the layer never runs it (its output is not read)
    dw_split: int = 1  # the weight gradient as this many GEMMs over column blocks of n (one per factor)
    batched_fwd: bool = False  # its forward runs inside the previous GEMM's strided-batched launch


@dataclass
class Pointwise:
    """Memory-bound work over `elements` values: `passes` full reads/writes forward and backward,
    in `kernels` launches each way (the engine's kernels; docs/SIM.md lists them)."""
    name: str
    elements: int
    fwd_passes: float
    bwd_passes: float
    saved: int = 0
    fwd_kernels: int = 1
    bwd_kernels: int = 1
    in_recompute: bool = True  # False: a recompute of the layer never runs it (its output is not read)


def unary(name: str, n: int, saved: int = 0) -> Pointwise:  # y = f(x): read x, write y; backward reads x and dy, writes dx
    return Pointwise(name, n, 2, 3, saved)


def binary(name: str, n: int, saved: int = 0) -> Pointwise:  # y = f(a, b): backward reads a, b, dy and writes da, db
    return Pointwise(name, n, 3, 5, saved)


@dataclass
class Attention:
    """The fused (flash) attention core: B*H heads of T x T x Dh, causal."""
    name: str
    heads: int  # B * local q heads
    T: int
    Dh: int
    saved: int = 0
    bwd_kernels: int = 1  # the engine's backward: a dQ pass and a dK/dV pass (kernels/attention.cu)
    kv_heads: int = 0  # B * local kv heads (0: as many as q heads)

    def traffic(self, itemsize: int) -> tuple[int, int]:
        """(forward, backward) global bytes read + written, FlashAttention-2's (`flash2_traffic`)."""
        t = flash2_traffic(self.heads, self.kv_heads or self.heads, self.T, self.Dh, itemsize)
        return sum(t["forward"]), sum(t["backward"])


def flash2_traffic(heads: int, kv_heads: int, T: int, Dh: int, itemsize: int,
                   tile: int = 64) -> dict[str, tuple[int, int]]:
    """{"forward", "backward"}: (read, written) global bytes of FlashAttention-2's kernels (Dao 2023)
    for `heads` query heads (batch x heads) over `kv_heads` key/value heads, causal, Q/K/V/O/dO of
    `itemsize` bytes. Forward, per 64-query tile: Q once, K and V up to its last query, O and the
    float32 log-sum-exp written once. Backward, per 64-key tile: K and V once; Q, dO, the log-sum-exp,
    delta and the float32 dQ (atomics: read and written) for every query the tile meets; before it
    delta = rowsum(dO o O), after it dQ converted to `itemsize`."""
    G = heads // kv_heads
    tiles = [(t0, min(T, t0 + tile)) for t0 in range(0, T, tile)]
    fwd_read = heads * sum((t1 - t0) * Dh * itemsize + 2 * t1 * Dh * itemsize for t0, t1 in tiles)
    fwd_written = heads * T * (Dh * itemsize + 4)
    bwd_read = kv_heads * sum(2 * (t1 - t0) * Dh * itemsize + G * (T - t0) * (2 * Dh * itemsize + 8 + 4 * Dh)
                              for t0, t1 in tiles)
    bwd_written = kv_heads * (T * 2 * Dh * itemsize + sum(G * (T - t0) * 4 * Dh for t0, _ in tiles))
    bwd_read += heads * T * (2 * Dh * itemsize + 4 * Dh)
    bwd_written += heads * T * (4 + Dh * itemsize)
    return {"forward": (fwd_read, fwd_written), "backward": (bwd_read, bwd_written)}


@dataclass
class Collective:
    """`kind` allreduce, allgather or reducescatter of `elements` contributed per member (for a
    reduce-scatter the whole tensor each member reduces), in the forward or backward."""
    name: str
    kind: str
    elements: int
    phase: str  # "fwd" or "bwd"
    saved: int = 0
    keeps_output: bool = True  # under recompute = lowrank its output is kept, so it is never reissued
    min_itemsize: int = 0  # the payload is at least this wide whatever the step's dtype (fp32 statistics)
    wide: int = 0  # of `elements`, how many travel at least 4 bytes wide (a norm statistic beside bf16 products)
    fed_by: int = 1  # how many GEMMs right before it it reduces the outputs of (a grouped all-reduce: several)

    def nbytes(self, itemsize: int) -> int:
        """Payload bytes contributed per member at the step's item size."""
        return (self.elements - self.wide) * max(itemsize, self.min_itemsize) + self.wide * max(itemsize, 4)


Op: TypeAlias = Gemm | Pointwise | Attention | Collective
"""One operation of a plan."""


@dataclass
class Shape:
    """The sizes a plan needs, per micro-batch and per tensor-parallel rank."""
    B: int
    T: int
    C: int
    F: int
    H: int
    Hkv: int
    Dh: int
    V: int
    Ra: int  # 0 for arch full
    Rm: int
    p: int
    cola: bool
    gate_act: bool
    grouped: bool
    sync_norm: bool
    attention: str  # "flash", "matmul" or "fused_softmax" (with_attention)
    gated: bool = True  # MLP = down(act(gate) * up); False: GPT's down(gelu(up)), no gate
    # full passes of the softmax over the T x T scores when attention = "matmul": the NumPy
    # engine's by default; a GPU framework's fused scale-mask-softmax (+ dropout) moves fewer
    softmax_passes: tuple[float, ...] = SOFTMAX_PASSES
    softmax_saved_per_row: int = 2  # what the backward keeps of the scores per row (T: the probs)
    eager: bool = False  # elementwise work as eager PyTorch runs it (EAGER_PYTORCH_PASSES), not fused
    sp: bool = False  # Megatron's sequence parallelism: the regions outside tp hold N/p tokens per rank
    attention_dropout: bool = False  # dropout on materialised probabilities (flash attention fuses it)
    half: bool = False  # a 16-bit step: a float32 accumulator read by an elementwise kernel is two passes
    # the engine's own kernels (kernels/*.cu, as `shape_of` states a boostmpi run): their launches and
    # passes; False: another framework's (the published runs), one fused kernel per op each way
    engine: bool = False
    gpu: bool = False  # the engine on GPUs (CuPy): factors of one shape side by side multiply as one batched GEMM
    # the backend that runs a fused (flash) attention core: train.attention's value ("auto", "cudnn",
    # "torch", "own"), priced at the profile's rate table for it (attention_rates.py)
    attention_backend: str = "auto"
    attention_deterministic: bool = True  # train.deterministic: False prices cudnn's and torch's other backward

    @property
    def engine_kernels(self) -> bool:
        return self.engine and not self.eager

    @property
    def N(self) -> int:
        return self.B * self.T

    @property
    def K(self) -> int:
        return self.Hkv * self.Dh


def with_attention(s: Shape, attention: str) -> Shape:
    """`s` with the attention kernel a machine profile names: "flash" (fused, no T x T tensor),
    "matmul" (materialised scores, softmax as boostmpi's tiled attention runs it) or
    "fused_softmax" (materialised scores, one fused softmax kernel each way, probabilities kept)."""
    if attention == "fused_softmax":
        return replace(s, attention=attention, softmax_passes=FUSED_SOFTMAX_PASSES, softmax_saved_per_row=s.T)
    return replace(s, attention=attention)


def shape_of(cfg: "Config", attention: str) -> Shape:
    m, par = cfg.model, cfg.parallel
    ranks = m.linear_shapes()
    return Shape(B=cfg.train.micro_batch_size, T=m.seq_len, C=m.d_model, F=m.d_ff, H=m.n_heads,
                 Hkv=m.n_kv_heads, Dh=m.head_dim, V=m.vocab_size, Ra=ranks["q"][2] or 0,
                 Rm=ranks["gate"][2] or 0, p=par.tp, cola=m.arch == "cola", gate_act=m.mlp_gate_act,
                 grouped=par.grouped, sync_norm=par.norm == "sync", attention=attention,
                 sp=par.sequence_parallel and par.tp > 1, attention_dropout=m.attention_dropout > 0,
                 half=cfg.train.dtype == "bfloat16", engine=True, gpu=cfg.train.device == "gpu",
                 attention_backend=getattr(cfg.train, "attention", "auto"),
                 attention_deterministic=getattr(cfg.train, "deterministic", True))
