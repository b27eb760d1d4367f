"""The performance model: time, communication and memory of one optimizer step.

One tensor-parallel rank's work on one micro-batch is written down once, as a plan: a list of
operations (GEMMs, elementwise passes, the attention core, collectives), each with the
activations its backward needs. Time, bytes per axis and activation memory are all read off
that one plan, so they cannot disagree. The plans follow the engine's layouts (docs/DESIGN.md)
and the collectives follow docs/COMMUNICATION.md element for element.

Letters as everywhere: N = B*T tokens of a micro-batch, C d_model, F d_ff, K kv width,
Ra/Rm attention/MLP rank, p = tp. docs/SIM.md explains every term.
"""

import math
from dataclasses import dataclass, field, replace

from boostmpi.model.params import param_specs, stage_layers, tp_strategy

ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2}
BREAKDOWN_KEYS = ("gemm", "elementwise", "tp_comm", "pp_bubble_and_p2p", "dp_comm", "optimizer")

# Full-buffer memory passes of the softmax of materialised attention scores, as boostmpi's NumPy
# attention runs it: forward = mask add (3), max (1), subtract (2), exp (2), sum (1), divide (2);
# backward = (dP*P) (3) and its row sum (1), subtract (2), multiply (3).
_SOFTMAX_PASSES = (11, 9)
_SOFTMAX_REDUCTION_PASSES = 2  # max and sum: what a recompute handed the statistics skips
# Cross-entropy over the local logits: max, exp-sum, target pick (forward); softmax minus one-hot (backward).
_CROSS_ENTROPY_PASSES = (3, 3)
# A flash-attention backward does 5 T x T matmuls to the forward's 2 (FlashAttention-2, Dao 2023).
_FLASH_BACKWARD_RATIO = 2.5


# ------------------------------------------------------------------ operations of a plan
@dataclass
class Gemm:
    """y[m, n] = x[m, k] @ w[k, n], `batch` times; backward is dx (m, k, n) and dw (k, n, m)."""
    name: str
    m: int
    n: int
    k: int
    batch: int = 1
    saved: int = 0  # elements kept for backward (the input x, unless another op already keeps it)


@dataclass
class Pointwise:
    """A memory-bound kernel over `elements` values: `passes` full reads/writes forward and backward."""
    name: str
    elements: int
    fwd_passes: float
    bwd_passes: float
    saved: int = 0


def unary(name, n, saved=0):  # y = f(x): read x, write y; backward reads x and dy, writes dx
    return Pointwise(name, n, 2, 3, saved)


def binary(name, n, saved=0):  # y = f(a, b): backward reads a, b, dy and writes da, db
    return Pointwise(name, n, 3, 5, saved)


@dataclass
class Attention:
    """The fused (flash) attention core: B*H heads of T x T x Dh, causal."""
    name: str
    heads: int  # B * local q heads
    T: int
    Dh: int
    saved: int = 0


@dataclass
class Collective:
    """`kind` allreduce or allgather of `elements` contributed per member, in the forward or backward."""
    name: str
    kind: str
    elements: int
    phase: str  # "fwd" or "bwd"
    saved: int = 0
    keeps_output: bool = True  # under recompute = lowrank its output is kept, so it is never reissued


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
    attention: str  # "flash" or "matmul"

    @property
    def N(self):
        return self.B * self.T

    @property
    def K(self):
        return self.Hkv * self.Dh


def shape_of(cfg, attention):
    m, par = cfg.model, cfg.parallel
    ranks = m.linear_shapes()
    return Shape(B=cfg.train.micro_batch_size, T=m.seq_len, C=m.d_model, F=m.d_ff, H=m.n_heads,
                 Hkv=m.n_kv_heads, Dh=m.head_dim, V=m.vocab_size, Ra=ranks["q"][2] or 0,
                 Rm=ranks["gate"][2] or 0, p=par.tp, cola=m.arch == "cola", gate_act=m.mlp_gate_act,
                 grouped=par.grouped, sync_norm=par.norm == "sync", attention=attention)


# ------------------------------------------------------------------ plans
def attention_core(s, heads, kv_heads):
    """The attention of `heads` q heads and `kv_heads` kv heads on this rank (q, k, v in, o out)."""
    N, T, Dh, B = s.N, s.T, s.Dh, s.B
    # q, k, v are what the backward of the core reads besides its output, which the o GEMM keeps
    qkv = N * Dh * (heads + 2 * kv_heads)
    if s.attention == "flash":  # plus the log-sum-exp of every row
        return [Attention("attention", B * heads, T, Dh, saved=qkv + B * heads * T)]
    group = heads // kv_heads
    scores = B * heads * T * T
    return [
        Gemm("scores", group * T, T, Dh, batch=B * kv_heads, saved=qkv),
        # the engine's tiled softmax keeps two statistics per row (maximum, sum), never the T x T
        # probabilities: its backward recomputes them tile by tile (boostmpi/model/layers.py)
        Pointwise("softmax", scores, *_SOFTMAX_PASSES, saved=2 * B * heads * T),
        Gemm("probs@v", group * T, Dh, T, batch=B * kv_heads),
    ]


def lowrank_linear(s, name, A, B, collectives, d_in_saved):
    """A factorised linear: the A GEMM, optional collectives, silu (cola), the B GEMM.

    `A` and `B` are (n, k) of the GEMMs; `collectives` sit between A and the nonlinearity.
    """
    N = s.N
    n_a, k_a = A
    ops = [Gemm(f"{name}.A", N, n_a, k_a, saved=d_in_saved)]
    ops += collectives
    if s.cola:  # silu needs its input z; B needs silu(z)
        ops.append(unary(f"{name}.silu", N * n_a, saved=N * n_a))
    n_b, k_b = B
    ops.append(Gemm(f"{name}.B", N, n_b, k_b, saved=N * k_b))
    return ops


def norm(name, n_tokens, width):
    return Pointwise(name, n_tokens * width, 2, 3, saved=n_tokens * width + n_tokens)


def layer_plan(s, strategy):
    """One layer, one micro-batch, one tensor-parallel rank: ops in forward order."""
    return {"btp": _btp_layer, "vanilla": _vanilla_layer, "megatron": _megatron_layer}[strategy](s)


def _megatron_layer(s):
    N, C, F, K, p = s.N, s.C, s.F, s.K, s.p
    ops = [norm("attn_norm", N, C)]
    widths = {"q": C // p, "k": K // p, "v": K // p}
    if s.grouped:
        ops.append(Gemm("qkv", N, sum(widths.values()), C, saved=N * C))
        ops.append(Collective("qkv.dx", "allreduce", N * C, "bwd"))
    else:
        for i, (lin, w) in enumerate(widths.items()):
            ops.append(Gemm(lin, N, w, C, saved=N * C if i == 0 else 0))
            ops.append(Collective(f"{lin}.dx", "allreduce", N * C, "bwd"))
    ops.append(unary("rope", N * (C + K) // p))
    ops += attention_core(s, s.H // p, s.Hkv // p)
    ops.append(Gemm("o", N, C, C // p, saved=N * C // p))
    ops.append(Collective("o.y", "allreduce", N * C, "fwd"))
    ops.append(binary("residual", N * C))
    ops.append(norm("mlp_norm", N, C))
    if s.grouped:
        ops.append(Gemm("gate_up", N, 2 * F // p, C, saved=N * C))
        ops.append(Collective("gate_up.dx", "allreduce", N * C, "bwd"))
    else:
        for i, lin in enumerate(("gate", "up")):
            ops.append(Gemm(lin, N, F // p, C, saved=N * C if i == 0 else 0))
            ops.append(Collective(f"{lin}.dx", "allreduce", N * C, "bwd"))
    ops.append(binary("gate*up", N * F // p, saved=2 * N * F // p))
    ops.append(Gemm("down", N, C, F // p, saved=N * F // p))
    ops.append(Collective("down.y", "allreduce", N * C, "fwd"))
    ops.append(binary("residual", N * C))
    return ops


def _vanilla_layer(s):
    """Megatron applied to each factor: A column-parallel along R, B row-parallel, all-reduce after B."""
    N, C, F, K, p = s.N, s.C, s.F, s.K, s.p
    Ra, Rm = s.Ra // p, s.Rm // p

    def factor_pairs(names, d_in, r, outs, saved_input):
        """Linears sharing one input: grouped = one A GEMM; each B ends in an all-reduce of its output."""
        ops = []
        if s.grouped:
            ops += [Gemm("+".join(names) + ".A", N, r * len(names), d_in, saved=saved_input),
                    Collective("+".join(names) + ".dx", "allreduce", N * d_in, "bwd")]
        else:
            for i, name in enumerate(names):
                ops += [Gemm(f"{name}.A", N, r, d_in, saved=saved_input if i == 0 else 0),
                        Collective(f"{name}.dx", "allreduce", N * d_in, "bwd")]
        if s.cola:
            ops.append(unary("silu", N * r * len(names), saved=N * r * len(names)))
        for name, d_out in zip(names, outs):
            ops += [Gemm(f"{name}.B", N, d_out, r, saved=N * r),
                    Collective(f"{name}.y", "allreduce", N * d_out, "fwd")]
        return ops

    ops = [norm("attn_norm", N, C)]
    ops += factor_pairs(("q", "k", "v"), C, Ra, (C, K, K), N * C)
    ops.append(unary("rope", N * (C + K)))
    ops += attention_core(s, s.H, s.Hkv)  # replicated: every rank holds every head
    ops += factor_pairs(("o",), C, Ra, (C,), N * C)
    ops.append(binary("residual", N * C))
    ops.append(norm("mlp_norm", N, C))
    ops += factor_pairs(("gate", "up"), C, Rm, (F, F), N * C)
    ops.append(binary("gate*up", N * F, saved=2 * N * F))
    ops += factor_pairs(("down",), F, Rm, (C,), N * F)
    ops.append(binary("residual", N * C))
    return ops


def _btp_layer(s):
    """Bottleneck-aware: residual sharded along C, A row-parallel, all-reduce of the rank-R activation."""
    N, p = s.N, s.p
    Cl, Fl, Kl = s.C // p, s.F // p, s.K // p
    Ra, Rm = s.Ra, s.Rm

    def a_group(names, d_in_local, r, with_norm_statistic):
        """A GEMMs of linears sharing one input, then their all-reduce(s) of [N, r] each."""
        stat = N if with_norm_statistic and not s.sync_norm else 0
        ops = []
        if with_norm_statistic and s.sync_norm:
            ops.append(Collective("norm.sumsq", "allreduce", N, "fwd"))
        if s.grouped:
            ops += [Gemm("+".join(names) + ".A", N, r * len(names), d_in_local, saved=N * d_in_local),
                    Collective("+".join(names) + ".z", "allreduce", N * r * len(names) + stat, "fwd")]
        else:
            for i, name in enumerate(names):
                ops += [Gemm(f"{name}.A", N, r, d_in_local, saved=N * d_in_local if i == 0 else 0),
                        Collective(f"{name}.z", "allreduce", N * r + (stat if i == 0 else 0), "fwd")]
        if with_norm_statistic:  # z arrives unnormalised: scale each token's row by 1/rms
            ops.append(unary("norm.scale", N * r * len(names)))
        if s.cola:
            ops.append(unary("silu", N * r * len(names), saved=N * r * len(names)))
        return ops

    def b_gemms(names, r, outs):
        ops = []
        for name, d_out in zip(names, outs):
            ops += [Gemm(f"{name}.B", N, d_out, r, saved=N * r),
                    Collective(f"{name}.dz", "allreduce", N * r, "bwd")]
        return ops

    ops = [norm("attn_norm", N, Cl)]
    ops += a_group(("q", "k", "v"), Cl, Ra, True)
    ops += b_gemms(("q", "k", "v"), Ra, (Cl, Kl, Kl))
    ops.append(unary("rope", N * (Cl + Kl)))
    ops += attention_core(s, s.H // p, s.Hkv // p)
    ops += a_group(("o",), Cl, Ra, False)
    ops += b_gemms(("o",), Ra, (Cl,))
    ops.append(binary("residual", N * Cl))
    ops.append(norm("mlp_norm", N, Cl))
    ops += a_group(("gate", "up"), Cl, Rm, True)
    ops += b_gemms(("gate", "up"), Rm, (Fl, Fl))
    ops.append(binary("gate*up", N * Fl, saved=2 * N * Fl))
    ops += a_group(("down",), Fl, Rm, False)
    ops += b_gemms(("down",), Rm, (Cl,))
    ops.append(binary("residual", N * Cl))
    return ops


def embedding_plan(s, strategy):
    N, C, p = s.N, s.C, s.p
    if strategy == "btp":  # each rank looks up its own columns: no communication
        return [Pointwise("embedding", N * C // p, 2, 2)]
    return [Pointwise("embedding", N * C, 2, 2),
            Collective("embedding.y", "allreduce", N * C, "fwd")]


def head_plan(s, strategy):
    """Final norm, vocabulary-parallel LM head and the sharded cross-entropy."""
    N, C, p = s.N, s.C, s.p
    V_local = -(-s.V // p)  # the largest of the uneven vocabulary ranges sets the pace
    ops = []
    if strategy == "btp":
        ops.append(Collective("final.gather", "allgather", N * C // p, "fwd"))
    ops += [norm("final_norm", N, C),
            Gemm("lm_head", N, V_local, C, saved=N * C),
            Collective("lm_head.dx", "allreduce", N * C, "bwd"),
            Pointwise("cross_entropy", N * V_local, *_CROSS_ENTROPY_PASSES, saved=N * V_local),
            Collective("ce.max", "allreduce", N, "fwd"),
            Collective("ce.sums", "allreduce", 2 * N, "fwd")]
    return ops


# ------------------------------------------------------------------ costs of one operation
# GPU BLAS libraries pick their tile per problem: smaller output tiles for small outputs, at a
# lower fraction of peak (less reuse per loaded operand). (tile divisor m, tile divisor n, relative
# efficiency); an assumption documented in docs/SIM.md, not fitted to any measurement.
GPU_TILE_CHOICES = ((1, 1, 1.0), (2, 1, 0.92), (2, 2, 0.85), (4, 2, 0.7))


def gemm_seconds(m, n, k, batch, itemsize, machine, dtype):
    """The fastest of the tile configurations a GPU library could pick (one fixed tile on CPUs)."""
    if machine.device != "gpu":
        return _gemm_seconds_with_tile(m, n, k, batch, itemsize, machine, dtype, 1, 1, 1.0)
    return min(_gemm_seconds_with_tile(m, n, k, batch, itemsize, machine, dtype, dm, dn, eff)
               for dm, dn, eff in GPU_TILE_CHOICES)


def _gemm_seconds_with_tile(m, n, k, batch, itemsize, machine, dtype, div_m, div_n, tile_efficiency):
    """Roofline of one GEMM with an efficiency that falls for small or thin shapes.

    Tile quantisation (a partial output tile costs a whole one), wave quantisation (the last wave
    of tiles leaves compute units idle; split-K fills them when the output is small and k long),
    the fixed prologue/epilogue of a tile (k/(k + k0)) and, on CPUs, packing overheads of thin
    operands (m/(m + c), n/(n + c)).
    """
    flops = 2.0 * m * n * k * batch
    tm, tn, units = machine.gemm_tile_m // div_m, machine.gemm_tile_n // div_n, machine.compute_units
    tiles = math.ceil(m / tm) * math.ceil(n / tn) * batch
    split = 1
    if tiles < units:  # split-K: several units share one output tile along k
        split = max(1, min(units // tiles, int(k // (4 * machine.gemm_k_overhead)) or 1))
    work = tiles * split
    waves = math.ceil(work / units)
    occupancy = (m * n * batch) / (tiles * tm * tn) * work / (waves * units)
    k_per_unit = k / split
    pipeline = k_per_unit / (k_per_unit + machine.gemm_k_overhead)
    c = machine.gemm_mn_overhead
    thin = (m / (m + c)) * (n / (n + c))
    rate = machine.peak(dtype) * machine.gemm_efficiency * tile_efficiency * occupancy * pipeline * thin
    moved = itemsize * batch * (m * k + k * n + m * n) + (split - 1) * 4 * m * n * batch
    stream = machine.memory_bandwidth * machine.elementwise_efficiency
    return max(flops / rate, moved / stream) + machine.kernel_launch_s


def pointwise_seconds(elements, passes, itemsize, machine):
    stream = machine.memory_bandwidth * machine.elementwise_efficiency
    return passes * elements * itemsize / stream + machine.kernel_launch_s


def flash_seconds(op, backward, machine, dtype):
    causal_flops = 4.0 * op.heads * op.T * op.T * op.Dh / 2  # QK^T and PV over the lower triangle
    flops = causal_flops * (_FLASH_BACKWARD_RATIO if backward else 1.0)
    return flops / (machine.peak(dtype) * machine.attention_efficiency) + machine.kernel_launch_s


@dataclass(frozen=True)
class Link:
    bandwidth: float
    latency: float


def group_link(machine, size, stride):
    """The link a group of `size` ranks, `stride` world ranks apart, runs over (tp fastest-varying)."""
    gpn = machine.gpus_per_node
    inside = size * stride <= gpn and gpn % (size * stride) == 0 if size > 1 else True
    if inside:
        return Link(machine.intra_node_bandwidth, machine.intra_node_latency)
    return Link(machine.inter_node_bandwidth, machine.inter_node_latency)


def allreduce_seconds(nbytes, size, link):
    """Ring all-reduce: 2(p-1) steps, each member sends 2(p-1)/p of the buffer."""
    if size <= 1 or nbytes == 0:
        return 0.0
    return 2 * (size - 1) * link.latency + 2 * (size - 1) / size * nbytes / link.bandwidth


def allgather_seconds(contributed_bytes, size, link):
    """Ring all-gather: p-1 steps, each member receives the p-1 other contributions."""
    if size <= 1 or contributed_bytes == 0:
        return 0.0
    return (size - 1) * link.latency + (size - 1) * contributed_bytes / link.bandwidth


def p2p_seconds(nbytes, link):
    return link.latency + nbytes / link.bandwidth


# ------------------------------------------------------------------ one stage, one micro-batch
@dataclass
class PassTimes:
    """Seconds of one pass of a set of ops, by breakdown category."""
    gemm: float = 0.0
    elementwise: float = 0.0
    tp_comm: float = 0.0

    def add(self, other, times=1.0):
        self.gemm += other.gemm * times
        self.elementwise += other.elementwise * times
        self.tp_comm += other.tp_comm * times

    @property
    def total(self):
        return self.gemm + self.elementwise + self.tp_comm


def pass_times(ops, backward, s, machine, dtype, tp_link):
    """Time of the forward (or backward) of `ops` on one tensor-parallel rank."""
    t = PassTimes()
    e = ITEMSIZE[dtype]
    for op in ops:
        if isinstance(op, Gemm):
            if backward:  # dx = dy @ w^T and dw = x^T @ dy
                t.gemm += gemm_seconds(op.m, op.k, op.n, op.batch, e, machine, dtype)
                t.gemm += gemm_seconds(op.k, op.n, op.m, op.batch, e, machine, dtype)
            else:
                t.gemm += gemm_seconds(op.m, op.n, op.k, op.batch, e, machine, dtype)
        elif isinstance(op, Pointwise):
            passes = op.bwd_passes if backward else op.fwd_passes
            t.elementwise += pointwise_seconds(op.elements, passes, e, machine)
        elif isinstance(op, Attention):
            t.elementwise += flash_seconds(op, backward, machine, dtype)
        elif isinstance(op, Collective) and (op.phase == "bwd") == backward:
            if op.kind == "allreduce":
                t.tp_comm += allreduce_seconds(op.elements * e, s.p, tp_link)
            else:
                t.tp_comm += allgather_seconds(op.elements * e, s.p, tp_link)
    return t


def recompute_plan(ops, recompute):
    """The forward ops the backward runs again first, or None when nothing is recomputed.

    `layer` runs the whole forward again. `lowrank` keeps the output of every forward collective
    (btp: the rank-R z after its all-reduce; vanilla: each B output after its all-reduce), so
    neither those collectives nor the GEMMs that feed them straight in run again; it also keeps
    the softmax statistics, so the tiled softmax runs again without its two row reductions.
    """
    if recompute == "none":
        return None
    if recompute == "layer":
        return list(ops)
    again = []
    for op, following in zip(ops, ops[1:] + [None]):
        feeds_kept = isinstance(following, Collective) and following.phase == "fwd"
        if isinstance(op, Collective) or (isinstance(op, Gemm) and feeds_kept):
            continue
        if isinstance(op, Pointwise) and op.name == "softmax":
            op = replace(op, fwd_passes=op.fwd_passes - _SOFTMAX_REDUCTION_PASSES)
        again.append(op)
    return again


def saved_elements(ops):
    return sum(op.saved for op in ops)


def kept_by_lowrank(ops, s):
    """Elements `recompute = lowrank` keeps per layer besides its input: the outputs of the forward
    collectives and the attention's softmax statistics (a log-sum-exp per row for flash, the
    maximum and sum for the engine's tiled attention), so its recompute reduces no scores again."""
    stats = s.B * (s.H // s.p) * s.T * (1 if s.attention == "flash" else 2)
    return stats + sum(op.elements for op in ops if isinstance(op, Collective) and op.phase == "fwd")


# ------------------------------------------------------------------ the whole step
@dataclass
class Prediction:
    time_s: float
    breakdown: dict
    comm_bytes: dict
    memory_bytes: dict
    mfu: float
    tokens_per_s: float
    details: dict = field(default_factory=dict)

    def as_dict(self):
        return {"time_s": self.time_s, "breakdown": self.breakdown, "comm_bytes": self.comm_bytes,
                "memory_bytes": self.memory_bytes, "mfu": self.mfu, "tokens_per_s": self.tokens_per_s,
                **self.details}


def master_dtype(dtype):
    return "float64" if dtype == "float64" else "float32"


def plan_strategy(cfg):
    """The plan to use: without tensor parallelism the low-rank modes run the same computation,
    and the btp plan states what `recompute = lowrank` keeps (the rank-R activations)."""
    strategy = tp_strategy(cfg)
    return "btp" if strategy == "vanilla" and cfg.parallel.tp == 1 else strategy


def tp_elements_per_micro_batch(cfg, s=None):
    """Tensor-parallel elements of one micro-batch summed over one pipeline (COMMUNICATION.md)."""
    s = s or shape_of(cfg, "flash")
    if s.p == 1:
        return 0
    strategy = tp_strategy(cfg)

    def collected(ops, fwd_times=1):
        return sum(op.elements * (fwd_times if op.phase == "fwd" else 1)
                   for op in ops if isinstance(op, Collective))

    layer_fwd_times = 2 if cfg.train.recompute == "layer" else 1
    total = cfg.model.n_layers * collected(layer_plan(s, strategy), layer_fwd_times)
    return total + collected(embedding_plan(s, strategy)) + collected(head_plan(s, strategy))


def comm_bytes(cfg):
    """Payload bytes per axis of one optimizer step, exactly as docs/COMMUNICATION.md counts them."""
    par, t = cfg.parallel, cfg.train
    e = ITEMSIZE[t.dtype]
    M, N = t.grad_accum, t.micro_batch_size * cfg.model.seq_len
    tp = par.dp * M * tp_elements_per_micro_batch(cfg) * e
    shard = cfg.model.d_model // par.tp if tp_strategy(cfg) == "btp" else cfg.model.d_model
    pp = par.tp * par.dp * M * 2 * (par.pp - 1) * N * shard * e
    dp = 0
    if par.dp > 1:
        locals_ = [local_params(cfg, r, st) for r in range(par.tp) for st in range(par.pp)]
        dp = sum(locals_) + sum(zero_allgather_elements(n, par) for n in locals_)
        dp *= ITEMSIZE[master_dtype(t.dtype)]
    return {"tp": int(tp), "pp": int(pp), "dp": int(dp)}


# ------------------------------------------------------------------ ZeRO-1 (parallel.zero_stage = 1)
def zero_slice(n_params, par):
    """Elements of the flat buffer whose optimizer state one dp rank holds: all of them, or under
    ZeRO-1 the largest dp slice, ceil(n / dp)."""
    return -(-n_params // par.dp) if par.zero_stage and par.dp > 1 else n_params


def zero_allgather_elements(n_params, par):
    """Counted elements of ZeRO-1's all-gather of the updated slices (the piece of dp rank 0), else 0."""
    return zero_slice(n_params, par) if par.zero_stage and par.dp > 1 else 0


_PARAM_COUNTS = {}


def local_params(cfg, tp_rank, stage):
    """Parameters held by (tp_rank, stage), from the engine's own parameter specs."""
    par = cfg.parallel
    key = (cfg.model, par.tp, par.pp, par.tp_mode)  # what the layout of parameters depends on
    if key not in _PARAM_COUNTS:
        _PARAM_COUNTS[key] = [[sum(spec.local_numel for spec in param_specs(cfg, r, st))
                               for r in range(par.tp)] for st in range(par.pp)]
    return _PARAM_COUNTS[key][stage][tp_rank]


def model_flops_per_step(cfg):
    """PaLM's model FLOPs (Chowdhury et al. 2022, App. B): 6 x matmul parameters x tokens plus
    12 x L x C x T per token for attention, whatever recomputation or parallel layout runs it."""
    m = cfg.model
    matmul_params = m.d_model * m.vocab_size  # the LM head (the embedding is a lookup)
    for d_in, d_out, r in m.linear_shapes().values():
        matmul_params += m.n_layers * (d_in * d_out if r is None else r * (d_in + d_out))
    tokens = cfg.tokens_per_step
    return 6.0 * matmul_params * tokens + 12.0 * m.n_layers * m.d_model * m.seq_len * tokens


def predict(cfg, machine):
    """The full prediction for `cfg` (model and layout) on `machine`."""
    m, par, t = cfg.model, cfg.parallel, cfg.train
    dtype, recompute = t.dtype, t.recompute
    s = shape_of(cfg, machine.attention)
    strategy = plan_strategy(cfg)
    e, e_master = ITEMSIZE[dtype], ITEMSIZE[master_dtype(dtype)]
    M = t.grad_accum

    tp_link = group_link(machine, par.tp, 1)
    pp_link = group_link(machine, 2, par.tp)  # neighbouring stages are tp ranks apart
    dp_link = group_link(machine, par.dp, par.tp * par.pp)

    layer = layer_plan(s, strategy)
    again = recompute_plan(layer, recompute)
    layer_f = pass_times(layer, False, s, machine, dtype, tp_link)
    layer_b = pass_times(layer, True, s, machine, dtype, tp_link)
    if again is not None:  # the backward runs (part of) the forward again first
        layer_b.add(pass_times(again, False, s, machine, dtype, tp_link))
    per_layer_saved = saved_elements(layer)
    layer_input = s.N * (s.C // s.p if strategy == "btp" else s.C)
    if recompute == "layer":
        kept = layer_input  # the layer's input only
    elif recompute == "lowrank":
        kept = layer_input + kept_by_lowrank(layer, s)
    else:
        kept = per_layer_saved
    # lowrank looks the first layer's input up again from the token ids (no collective under btp)
    first_input_dropped = layer_input if recompute == "lowrank" else 0

    stages = []
    for stage in range(par.pp):
        n_layers = len(stage_layers(m.n_layers, par.pp, stage))
        extra = (embedding_plan(s, strategy) if stage == 0 else []) + \
                (head_plan(s, strategy) if stage == par.pp - 1 else [])
        fwd, bwd = PassTimes(), PassTimes()
        fwd.add(layer_f, n_layers)
        bwd.add(layer_b, n_layers)
        fwd.add(pass_times(extra, False, s, machine, dtype, tp_link))
        bwd.add(pass_times(extra, True, s, machine, dtype, tp_link))
        params = max(local_params(cfg, r, stage) for r in range(par.tp))
        in_flight = min(M, par.pp - stage)  # 1F1B: stage i holds up to pp - i micro-batches
        kept_stage = n_layers * kept - (first_input_dropped if stage == 0 and n_layers else 0)
        activations = (in_flight * (kept_stage + saved_elements(extra))
                       + (per_layer_saved if recompute != "none" else 0)) * e
        stages.append({"fwd": fwd, "bwd": bwd, "params": params, "layers": n_layers,
                       "activations": activations})

    slowest = max(stages, key=lambda st: st["fwd"].total + st["bwd"].total)
    slot = slowest["fwd"].total + slowest["bwd"].total

    # pipeline: M + pp - 1 slots of one forward and one backward; the p2p sends sit on the path
    pp_time = 0.0
    if par.pp > 1:
        msg = s.N * (s.C // s.p if strategy == "btp" else s.C) * e
        pp_time = (par.pp - 1) * slot + 2 * (M + par.pp - 1) * p2p_seconds(msg, pp_link)

    # data parallel: one all-reduce of the local gradient, hidden behind the last backward if overlap
    dp_time = 0.0
    if par.dp > 1:
        dp_time = max(allreduce_seconds(st["params"] * e_master, par.dp, dp_link) for st in stages)
        if par.zero_stage:  # a ring reduce-scatter is the first half of a ring all-reduce
            dp_time /= 2
        if par.overlap:  # buckets go out as layers finish; the last bucket cannot be hidden
            hidden = slowest["bwd"].total
            last_bucket = dp_time / (slowest["layers"] + 1)
            dp_time = max(dp_time - hidden, last_bucket)
        if par.zero_stage:  # the updated slices, gathered after the optimizer: never hidden
            dp_time += max(allgather_seconds(zero_slice(st["params"], par) * e_master, par.dp, dp_link)
                           for st in stages)

    # AdamW over the local master buffer (+ the compute copy when it is a narrower dtype)
    params = max(st["params"] for st in stages)
    owned = zero_slice(params, par)  # what this rank's AdamW updates and keeps moments for
    opt_bytes = owned * machine.optimizer_passes * e_master + (params * e if e != e_master else 0)
    optimizer = opt_bytes / (machine.memory_bandwidth * machine.elementwise_efficiency)

    per_mb = PassTimes()
    per_mb.add(slowest["fwd"])
    per_mb.add(slowest["bwd"])
    breakdown = {"gemm": M * per_mb.gemm, "elementwise": M * per_mb.elementwise,
                 "tp_comm": M * per_mb.tp_comm, "pp_bubble_and_p2p": pp_time,
                 "dp_comm": dp_time, "optimizer": optimizer}
    time_s = sum(breakdown.values())

    memory = {"params": params * (e_master + (e if e != e_master else 0)),
              "grads": (params + (owned if owned != params else 0)) * e_master,  # + ZeRO's reduced slice
              "optimizer": 2 * owned * e_master,
              "activations": max(st["activations"] for st in stages)}
    memory["total"] = sum(memory.values())
    memory["capacity"] = machine.memory_capacity_bytes
    memory["fits"] = memory["total"] <= machine.memory_capacity_bytes
    memory = {k: (v if isinstance(v, bool) else int(v)) for k, v in memory.items()}

    gpus = par.tp * par.pp * par.dp
    mfu = model_flops_per_step(cfg) / (time_s * gpus * machine.peak(dtype))
    details = {"machine": machine.name, "gpus": gpus, "strategy": strategy,
               "tokens_per_step": cfg.tokens_per_step,
               "forward_s": slowest["fwd"].total, "backward_s": slowest["bwd"].total}
    return Prediction(time_s, breakdown, comm_bytes(cfg), memory, mfu,
                      cfg.tokens_per_step / time_s, details)


def predict_step_time(cfg, machine):
    """Seconds of one optimizer step of `cfg` on `machine` (a Machine, a built-in name or a path)."""
    if not hasattr(machine, "peak_flops"):
        from boostmpi.sim.machines import load_machine
        machine = load_machine(machine)
    return predict(cfg, machine).time_s
