"""Operation plans: what one tensor-parallel rank runs for one layer and one micro-batch.

A plan is a list of operations in forward order (GEMMs, elementwise passes, the attention core,
collectives: the terms of `operations.py`), each with the activations its backward needs. The cost model (`costs.py`) prices
them and the step model (`model.py`) assembles a step from them, so time, bytes per axis and
activation memory are all read off one list and cannot disagree. The plans follow the engine's
layouts (docs/DESIGN.md) and the collectives follow docs/COMMUNICATION.md element for element.

Letters as everywhere: N = B*T tokens of a micro-batch, C d_model, F d_ff, K kv width,
Ra/Rm attention/MLP rank, p = tp. docs/SIM.md explains every term.
"""

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from boostmpi.model.params import tp_strategy
from boostmpi.sim.operations import (ATTENTION_DROPOUT_PASSES, CROSS_ENTROPY_PASSES, SOFTMAX_REDUCTION_PASSES, Attention,
                                     Collective, Gemm, Op, Pointwise, Shape, binary, unary)

if TYPE_CHECKING:
    from boostmpi.config import Config


def attention_core(s: Shape, heads: int, kv_heads: int) -> list[Op]:
    """The attention of `heads` q heads and `kv_heads` kv heads on this rank (q, k, v in, o out)."""
    N, T, Dh, B = s.N, s.T, s.Dh, s.B
    # q, k, v are what the backward of the core reads besides its output, which the o GEMM keeps
    qkv = N * Dh * (heads + 2 * kv_heads)
    if s.attention == "flash":  # plus the log-sum-exp of every row: what the engine's GPU path keeps
        # (kernels/attention.cu, layers.FusedAttentionCache); float32, counted at the compute dtype's size
        # backward: two kernels, dQ (with delta = rowsum(dO * O)) per query tile, then dK/dV per key tile
        return [Attention("attention", B * heads, T, Dh, saved=qkv + B * heads * T,
                          bwd_kernels=2 if s.engine_kernels else 1, kv_heads=B * kv_heads)]
    group = heads // kv_heads
    scores = B * heads * T * T
    passes, per_row = s.softmax_passes, s.softmax_saved_per_row
    if s.attention_dropout:
        passes = tuple(a + b for a, b in zip(passes, ATTENTION_DROPOUT_PASSES))
        per_row += T // 2 if per_row >= T else 0  # the mask, beside kept probabilities
    return [
        Gemm("scores", group * T, T, Dh, batch=B * kv_heads, saved=qkv),
        # the engine's CPU path (its tiled softmax) keeps two statistics per row (maximum, sum), never
        # the T x T probabilities: its backward recomputes them tile by tile (boostmpi/model/layers.py)
        Pointwise("softmax", scores, passes[0], passes[1], saved=per_row * B * heads * T),
        Gemm("probs@v", group * T, Dh, T, batch=B * kv_heads),
    ]


def norm(s: Shape, name: str, n_tokens: int, width: int) -> Pointwise:
    """RMSNorm over the whole row: one fused kernel each way, 2 / 3 passes, for another framework;
    the engine's kernels (kernels/rmsnorm.cu) as follows. Forward: rmsnorm_forward reads x, writes y
    (2 passes: the row is held in registers between its sum and its scaling). Backward, 5 passes in 4 kernels:
    rmsnorm_projection reads dy and x (the row statistic), rmsnorm_backward reads dy and x and writes
    dx over column tiles (no shared memory at any C), then the sum of its per-chunk dw rows and the
    accumulation into dw (kernels of C floats per row chunk: not counted in the bytes; on GPUs one
    kernel, dw_accumulate, so 3 in all)."""
    saved = n_tokens * width + n_tokens
    if not s.engine_kernels:
        return Pointwise(name, n_tokens * width, 2, 3, saved=saved)
    return Pointwise(name, n_tokens * width, 2, 5, saved=saved, bwd_kernels=3 if s.gpu else 4)


def online_norm(s: Shape, name: str, width: int, residual: bool = False) -> Pointwise:
    """btp's online RMSNorm on this rank's [N, width] shard, up to the A GEMM. Forward, one kernel:
    rmsnorm_online_stats reads x, writes x * w (2 passes); with `residual` it is
    residual_online_stats, which adds the branch output first (reads h and y, writes h + y and
    (h + y) * w: 4 passes), the residual add folded in. Backward: btp_backward_post reads dxw (the
    float32 accumulator: 2 passes in a 16-bit step) and x and writes dx, then the sum of its per-chunk
    dw rows and the accumulation into dw (3 kernels); with `residual`, the sum of the two gradients
    at the residual (reads 2, writes 1) is one kernel more. On GPUs btp_backward_post also reads the
    gradient from above that meets dx at the group's input and writes their sum (one pass more, no
    kernel more), for the attention norm (the gradient of the layer's output) and the MLP's, and the dw
    sum and accumulation are one kernel (dw_accumulate): 2 kernels; residual_online_stats there also
    writes h + y a second time (5 passes), the buffer the down projection's GEMM accumulates into."""
    N = s.N
    post = (2 if s.half else 1) + 2
    if s.gpu:
        return Pointwise(name, N * width, 5 if residual else 2, post + 1, saved=N * width + N, bwd_kernels=2)
    if residual:
        return Pointwise(name, N * width, 4, post + 3, saved=N * width + N, bwd_kernels=4)
    return Pointwise(name, N * width, 2, post, saved=N * width + N, bwd_kernels=3)


def residual(s: Shape, n: int, in_recompute: bool = True, in_gemm_and_norm: bool = False) -> Pointwise:
    """The residual add h + y. Forward reads h and y, writes the sum; its backward passes the gradient
    on to both unchanged, and the kernel is the sum of the two gradients that meet at h (reads 2,
    writes 1). With `in_gemm_and_norm` (btp on GPUs) no kernel: y's GEMM adds into a copy of h (beta = 1:
    one read of h) and a norm's backward kernel sums the gradients (`online_norm`). Other frameworks'
    plans keep the generic binary op's 3 / 5 passes."""
    if not s.engine_kernels:
        return binary("residual", n)
    if in_gemm_and_norm:
        return Pointwise("residual", n, 1, 0, in_recompute=in_recompute, fwd_kernels=0, bwd_kernels=0)
    return Pointwise("residual", n, 3, 3, in_recompute=in_recompute)


def rope(s: Shape, n: int) -> Pointwise:
    """RoPE on q and k (`n` their elements together): one kernel each (rope_forward, rope_backward)."""
    kernels = 2 if s.engine_kernels else 1
    return Pointwise("rope", n, 2, 3, fwd_kernels=kernels, bwd_kernels=kernels)


def layer_plan(s: Shape, strategy: str) -> list[Op]:
    """One layer, one micro-batch, one tensor-parallel rank: ops in forward order."""
    ops = {"btp": _btp_layer, "vanilla": _vanilla_layer, "megatron": _megatron_layer}[strategy](s)
    return eager_pytorch(ops) if s.eager else ops


# Full passes (forward, backward) of the elementwise work of a LLaMA block as eager PyTorch runs
# it, kernel by kernel, instead of the fused kernels of the default plan. A pass is one read or
# write of the tensor in the 16-bit compute dtype; an fp32 intermediate counts 2.
#   RMSNorm `(x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)).type_as(x) * w`: upcast 1 + 2,
#     pow 2 + 2, mean 2, scale 2 + 2, downcast 2 + 1, weight 1 + 1 = 18 forward; backward: weight
#     (dx and the dw reduction) 5, downcast 3, scale 4, its row sum 4, pow 6, sum of the two
#     gradients 6, upcast 3 = 31;
#   RoPE through complex fp32 views: upcast 1 + 2, complex product 2 + 2, downcast 2 + 1 = 10
#     forward, the same 10 backward (per element of q and k);
#   SwiGLU `silu(a) * b`: silu 1 + 1, product 2 + 1 = 5 forward; backward: both product
#     gradients 3 + 3, silu 3 = 9;
#   cross-entropy on logits upcast to fp32: upcast 1 + 2, log-softmax 2 + 2 + 2 = 9 forward;
#     backward: the scattered gradient 2, log-softmax 6, downcast 3 = 11.
EAGER_PYTORCH_PASSES = {"norm": (18, 31), "rope": (10, 10), "gate*up": (5, 9), "cross_entropy": (9, 11)}


def eager_pytorch(ops: Sequence[Op]) -> list[Op]:
    """`ops` with the elementwise passes of eager PyTorch (EAGER_PYTORCH_PASSES)."""
    out: list[Op] = []
    for op in ops:
        kind = "norm" if op.name.endswith("norm") else op.name
        if isinstance(op, Pointwise) and kind in EAGER_PYTORCH_PASSES:
            op = replace(op, fwd_passes=EAGER_PYTORCH_PASSES[kind][0], bwd_passes=EAGER_PYTORCH_PASSES[kind][1],
                         fwd_kernels=1, bwd_kernels=1)
        out.append(op)
    return out


def _megatron_layer(s: Shape) -> list[Op]:
    N, C, F, K, p = s.N, s.C, s.F, s.K, s.p
    Ns = N // p if s.sp else N  # tokens per rank outside the tensor-parallel regions
    enter, leave = _tp_region_edges(s)
    ops: list[Op] = [norm(s, "attn_norm", Ns, C)]
    ops += enter("qkv")
    widths = {"q": C // p, "k": K // p, "v": K // p}
    split = s.engine_kernels  # the engine's weight gradients: one GEMM per linear of a grouped GEMM
    if s.grouped:
        ops.append(Gemm("qkv", N, sum(widths.values()), C, saved=Ns * C, dw_split=3 if split else 1))
        ops.append(_column_dx("qkv", s))
    else:
        for i, (lin, w) in enumerate(widths.items()):
            ops.append(Gemm(lin, N, w, C, saved=Ns * C if i == 0 else 0))
            ops.append(_column_dx(lin, s))
    ops.append(rope(s, N * (C + K) // p))
    ops += attention_core(s, s.H // p, s.Hkv // p)
    ops.append(Gemm("o", N, C, C // p, saved=N * C // p))
    ops += leave("o")
    ops.append(residual(s, Ns * C))
    ops.append(norm(s, "mlp_norm", Ns, C))
    ops += enter("mlp")
    if not s.gated:  # GPT: up (column-parallel), GELU, down (row-parallel)
        ops.append(Gemm("up", N, F // p, C, saved=Ns * C))
        ops.append(_column_dx("up", s))
        ops.append(unary("gelu", N * F // p, saved=N * F // p))
    elif s.grouped:
        ops.append(Gemm("gate_up", N, 2 * F // p, C, saved=Ns * C, dw_split=2 if split else 1))
        ops.append(_column_dx("gate_up", s))
    else:
        for i, lin in enumerate(("gate", "up")):
            ops.append(Gemm(lin, N, F // p, C, saved=Ns * C if i == 0 else 0))
            ops.append(_column_dx(lin, s))
    if s.gated:
        ops.append(binary("gate*up", N * F // p, saved=2 * N * F // p))
    ops.append(Gemm("down", N, C, F // p, saved=N * F // p))
    ops += leave("down")
    ops.append(residual(s, Ns * C, in_recompute=False))  # a recompute stops at the down projection
    return ops


def _tp_region_edges(s: Shape) -> tuple[Callable[[str], list[Op]], Callable[[str], list[Op]]]:
    """(enter, leave): the collectives where a Megatron tensor-parallel region begins and ends.

    Without sequence parallelism the input is whole on every rank (nothing on entry) and the
    row-parallel output is all-reduced on exit. With it (Korthikanti et al. 2022, Sec. 4.2.2) the
    N/p tokens of each rank are all-gathered on entry (the backward reduce-scatters the input's
    gradient, `_column_dx`) and the output is reduce-scattered on exit (the backward all-gathers
    its gradient): the same bytes and ring steps as the all-reduces they replace. Megatron saves
    the sharded input and gathers it again in the backward for the weight gradient, overlapped
    with the input-gradient GEMM; that second gather is not on the critical path and not counted."""
    N, C, p = s.N, s.C, s.p
    if not s.sp:
        return (lambda name: []), (lambda name: [Collective(f"{name}.y", "allreduce", N * C, "fwd")])
    return ((lambda name: [Collective(f"{name}.x", "allgather", N * C // p, "fwd")]),
            (lambda name: [Collective(f"{name}.y", "reducescatter", N * C, "fwd"),
                           Collective(f"{name}.dy", "allgather", N * C // p, "bwd")]))


def _column_dx(name: str, s: Shape) -> Collective:
    """The backward collective of a column-parallel GEMM's input gradient."""
    return Collective(f"{name}.dx", "reducescatter" if s.sp else "allreduce", s.N * s.C, "bwd")


def _vanilla_layer(s: Shape) -> list[Op]:
    """Megatron applied to each factor: A column-parallel along R, B row-parallel, all-reduce after B."""
    N, C, F, K, p = s.N, s.C, s.F, s.K, s.p
    Ra, Rm = s.Ra // p, s.Rm // p

    def factor_pairs(names: tuple[str, ...], d_in: int, r: int, outs: tuple[int, ...],
                     saved_input: int) -> list[Op]:
        """Linears sharing one input: grouped = one A GEMM and one all-reduce of the B outputs; else each
        B ends in an all-reduce of its output."""
        ops: list[Op] = []
        if s.grouped:  # the engine's weight gradient: one GEMM per factor's column block of dZ
            ops += [Gemm("+".join(names) + ".A", N, r * len(names), d_in, saved=saved_input,
                         dw_split=len(names) if s.engine_kernels else 1),
                    Collective("+".join(names) + ".dx", "allreduce", N * d_in, "bwd")]
        else:
            for i, name in enumerate(names):
                ops += [Gemm(f"{name}.A", N, r, d_in, saved=saved_input if i == 0 else 0),
                        Collective(f"{name}.dx", "allreduce", N * d_in, "bwd")]
        if s.cola:
            ops.append(unary("silu", N * r * len(names), saved=N * r * len(names)))
        for name, d_out in zip(names, outs):
            ops.append(Gemm(f"{name}.B", N, d_out, r, saved=N * r))
            if not s.grouped:
                ops.append(Collective(f"{name}.y", "allreduce", N * d_out, "fwd"))
        if s.grouped:  # the group's outputs in one all-reduce
            ops.append(Collective("+".join(names) + ".y", "allreduce", N * sum(outs), "fwd", fed_by=len(names)))
        return ops

    ops: list[Op] = [norm(s, "attn_norm", N, C)]
    ops += factor_pairs(("q", "k", "v"), C, Ra, (C, K, K), N * C)
    ops.append(rope(s, N * (C + K)))
    ops += attention_core(s, s.H, s.Hkv)  # replicated: every rank holds every head
    ops += factor_pairs(("o",), C, Ra, (C,), N * C)
    ops.append(residual(s, N * C))
    ops.append(norm(s, "mlp_norm", N, C))
    ops += factor_pairs(("gate", "up"), C, Rm, (F, F), N * C)
    ops.append(binary("gate*up", N * F, saved=2 * N * F))
    ops += factor_pairs(("down",), F, Rm, (C,), N * F)
    ops.append(residual(s, N * C, in_recompute=False))  # a recompute stops at the down projection
    return ops


def _btp_layer(s: Shape) -> list[Op]:
    """Bottleneck-aware: residual sharded along C, A row-parallel, all-reduce of the rank-R activation."""
    N, p = s.N, s.p
    Cl, Fl, Kl = s.C // p, s.F // p, s.K // p
    Ra, Rm = s.Ra, s.Rm

    def a_group(names: tuple[str, ...], d_in_local: int, r: int, with_norm_statistic: bool) -> list[Op]:
        """A GEMMs of linears sharing one input, then their all-reduce(s) of [N, r] each."""
        stat = N if with_norm_statistic and not s.sync_norm else 0
        ops: list[Op] = []
        if with_norm_statistic and s.sync_norm:
            ops.append(Collective("norm.sumsq", "allreduce", N, "fwd", min_itemsize=4))  # float32 at least
        if s.grouped:  # the engine's weight gradient: one GEMM per factor's column block of dP (on GPUs one GEMM)
            ops += [Gemm("+".join(names) + ".A", N, r * len(names), d_in_local, saved=N * d_in_local,
                         dw_split=len(names) if s.engine_kernels and not s.gpu else 1),
                    Collective("+".join(names) + ".z", "allreduce", N * r * len(names) + stat, "fwd", wide=stat)]
        else:
            for i, name in enumerate(names):
                ops += [Gemm(f"{name}.A", N, r, d_in_local, saved=N * d_in_local if i == 0 else 0),
                        Collective(f"{name}.z", "allreduce", N * r + (stat if i == 0 else 0), "fwd",
                                   wide=stat if i == 0 else 0)]
        width = N * r * len(names)
        if with_norm_statistic and s.cola and not s.eager:
            # z arrives unnormalised: one kernel scales each token's row by 1/rms and applies the SiLU
            # (the engine's btp_rescale_silu: reads z, writes Z and silu(Z)); its backward is one
            # kernel too (btp_backward_pre: reads dZs and Z, writes dP)
            ops.append(Pointwise("norm.scale+silu", width, 3, 3, saved=width))
            return ops
        if with_norm_statistic:  # z arrives unnormalised: scale each token's row by 1/rms
            ops.append(unary("norm.scale", width))
        if s.cola:
            ops.append(unary("silu", width, saved=width))
        return ops

    def b_gemms(names: tuple[str, ...], r: int, outs: tuple[int, ...], in_recompute: bool = True) -> list[Op]:
        """B GEMMs and the backward all-reduce of dz: one for the group when grouped, else one each."""
        ops: list[Op] = []
        for i, (name, d_out) in enumerate(zip(names, outs)):
            # on a GPU, grouped: B factors of one shape side by side are one strided-batched GEMM forward
            # (BottleneckTP._b_products); the backward's dZ and dB stay one GEMM each
            batched = s.engine_kernels and s.gpu and s.grouped and i > 0 and outs[i - 1] == d_out
            ops.append(Gemm(f"{name}.B", N, d_out, r, saved=N * r, in_recompute=in_recompute, batched_fwd=batched))
            if not s.grouped:
                ops.append(Collective(f"{name}.dz", "allreduce", N * r, "bwd"))
        if s.grouped:
            ops.append(Collective("+".join(names) + ".dz", "allreduce", N * r * len(names), "bwd"))
        return ops

    ops: list[Op] = [online_norm(s, "attn_norm", Cl) if s.engine_kernels else norm(s, "attn_norm", N, Cl)]
    ops += a_group(("q", "k", "v"), Cl, Ra, True)
    ops += b_gemms(("q", "k", "v"), Ra, (Cl, Kl, Kl))
    ops.append(rope(s, N * (Cl + Kl)))
    ops += attention_core(s, s.H // p, s.Hkv // p)
    ops += a_group(("o",), Cl, Ra, False)
    ops += b_gemms(("o",), Ra, (Cl,))
    if not s.engine_kernels:  # another framework: the add and the norm apart
        ops += [residual(s, N * Cl), norm(s, "mlp_norm", N, Cl)]
    else:  # the engine: one kernel, residual_online_stats
        ops.append(online_norm(s, "residual+mlp_norm", Cl, residual=True))
    ops += a_group(("gate", "up"), Cl, Rm, True)
    ops += b_gemms(("gate", "up"), Rm, (Fl, Fl))
    ops.append(binary("gate*up", N * Fl, saved=2 * N * Fl))
    ops += a_group(("down",), Fl, Rm, False)
    # a recompute stops at the down projection's input: its B GEMM (out_proj_cache) and the add are skipped
    ops += b_gemms(("down",), Rm, (Cl,), in_recompute=not s.engine_kernels)
    # on GPUs the down B GEMM accumulates into the residual, the attention norm's backward sums the gradients
    ops.append(residual(s, N * Cl, in_recompute=False, in_gemm_and_norm=s.engine_kernels and s.gpu))
    return ops


def embedding_plan(s: Shape, strategy: str) -> list[Op]:
    N, C, p = s.N, s.C, s.p
    if strategy == "btp":  # each rank looks up its own columns: no communication
        return [Pointwise("embedding", N * C // p, 2, 2)]
    # vocabulary-parallel lookup: partial rows summed; under sp reduce-scattered along the sequence,
    # and the backward all-gathers the gradient every rank's rows need
    if s.sp:
        return [Pointwise("embedding", N * C, 2, 2), Collective("embedding.y", "reducescatter", N * C, "fwd"),
                Collective("embedding.dy", "allgather", N * C // p, "bwd")]
    return [Pointwise("embedding", N * C, 2, 2), Collective("embedding.y", "allreduce", N * C, "fwd")]


def head_plan(s: Shape, strategy: str) -> list[Op]:
    """Final norm, vocabulary-parallel LM head and the sharded cross-entropy."""
    N, C, p = s.N, s.C, s.p
    V_local = -(-s.V // p)  # the largest of the uneven vocabulary ranges sets the pace
    ops: list[Op] = []
    if strategy == "btp":
        ops.append(Collective("final.gather", "allgather", N * C // p, "fwd"))
    Ns = N // p if s.sp else N
    ops.append(norm(s, "final_norm", Ns, C))
    if s.sp:  # the head is a column-parallel GEMM: its input gathered along the sequence
        ops.append(Collective("lm_head.x", "allgather", N * C // p, "fwd"))
    ops += [Gemm("lm_head", N, V_local, C, saved=Ns * C),
            _column_dx("lm_head", s),
            Pointwise("cross_entropy", N * V_local, *CROSS_ENTROPY_PASSES, saved=N * V_local),
            Collective("ce.max", "allreduce", N, "fwd", min_itemsize=4),  # softmax statistics in >= fp32
            Collective("ce.sums", "allreduce", 2 * N, "fwd", min_itemsize=4)]
    return eager_pytorch(ops) if s.eager else ops


_CORE_OPS = {"attention", "scores", "softmax", "probs@v"}


def attention_core_ops(ops: Sequence[Op]) -> list[Op]:
    """The ops of the attention core (q, k, v in, o out): what `recompute = selective` runs again."""
    return [op for op in ops if op.name in _CORE_OPS and not isinstance(op, Collective)]


def core_statistics(ops: Sequence[Op]) -> int:
    """Elements the attention core keeps besides its inputs q, k, v (which `selective` still keeps): the
    log-sum-exp per row of flash attention, the softmax's saved statistics or probabilities per row
    of materialised scores (2 per row for the engine's tiled softmax on the CPU path, T for a
    framework that keeps the probabilities: Korthikanti et al.'s 5as/h term lives here). The engine's
    GPU path is `flash`: one log-sum-exp per row."""
    return sum(op.heads * op.T if isinstance(op, Attention) else op.saved
               for op in attention_core_ops(ops) if not isinstance(op, Gemm))


def recompute_plan(ops: Sequence[Op], recompute: str) -> list[Op] | None:
    """The forward ops the backward runs again first, or None when nothing is recomputed.

    `selective` runs the attention core again (its inputs are kept, no collective is involved).
    `layer` runs the forward again up to the down projection's input (the layer's output is never
    read: ops marked `in_recompute = False`, the last residual add and btp's down B GEMM, are
    skipped). `lowrank` keeps the output of every forward collective (btp: the rank-R z after its
    all-reduce, rescaled by the norm: a normed group runs only its SiLU again; vanilla: each B
    output after its all-reduce), so neither those collectives nor the GEMMs that feed them
    straight in run again; it also keeps the softmax statistics, so the tiled softmax runs again
    without its two row reductions.
    """
    if recompute == "none":
        return None
    if recompute == "layer":
        return [op for op in ops if getattr(op, "in_recompute", True)]
    if recompute == "selective":
        return attention_core_ops(ops)
    feeds_kept: set[int] = set()  # the GEMMs whose outputs go straight into a forward collective
    for i, op in enumerate(ops):
        if isinstance(op, Collective) and op.phase == "fwd":
            feeds_kept.update(j for j in range(max(0, i - op.fed_by), i) if isinstance(ops[j], Gemm))
    again: list[Op] = []
    for i, op in enumerate(ops):
        if isinstance(op, Collective) or i in feeds_kept or not getattr(op, "in_recompute", True) or op.name == "norm.scale":
            continue
        if isinstance(op, Pointwise) and op.name == "norm.scale+silu":  # Z is kept: silu(Z) again
            op = replace(op, name="silu", fwd_passes=2)
        if isinstance(op, Pointwise) and op.name == "softmax":
            op = replace(op, fwd_passes=op.fwd_passes - SOFTMAX_REDUCTION_PASSES)
        again.append(op)
    return again


def saved_elements(ops: Sequence[Op]) -> int:
    return sum(op.saved for op in ops)


def kept_by_lowrank(ops: Sequence[Op], s: Shape) -> int:
    """Elements `recompute = lowrank` keeps per layer besides its input: the outputs of the forward
    collectives and the attention's softmax statistics (a log-sum-exp per row for flash, which is
    the engine's GPU path, the maximum and sum for the engine's tiled attention on the CPU), so its
    recompute reduces no scores again."""
    stats = s.B * (s.H // s.p) * s.T * (1 if s.attention == "flash" else 2)
    return stats + sum(op.elements for op in ops if isinstance(op, Collective) and op.phase == "fwd")


def plan_strategy(cfg: "Config") -> str:
    """The plan to use: without tensor parallelism the low-rank modes run the same computation,
    and the btp plan states what `recompute = lowrank` keeps (the rank-R activations)."""
    strategy = tp_strategy(cfg)
    return "btp" if strategy == "vanilla" and cfg.parallel.tp == 1 else strategy
