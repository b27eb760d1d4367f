"""The step model: time, communication and memory of one optimizer step.

The plans of one layer, the embedding and the head (`plans.py`) are priced per forward and
backward pass (`costs.py`) and assembled here into a step: the pipeline schedule and its bubble,
recomputation, the data-parallel all-reduce, the optimizer, memory per device and MFU.
docs/SIM.md explains every term.
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from boostmpi.model.params import ParamSpec, chunk_layers, param_specs, split_range, tp_strategy
from boostmpi.parallel.pipeline import warmup_units
from boostmpi.sim.costs import (ITEMSIZE, Link, PassTimes, group_allreduce_seconds, group_link, p2p_seconds,
                                pass_times)
from boostmpi.sim.operations import Collective, Op, Shape, shape_of, with_attention
from boostmpi.sim.plans import (attention_core_ops, core_statistics, embedding_plan, head_plan, kept_by_lowrank, layer_plan,
                                plan_strategy, recompute_plan, saved_elements)

if TYPE_CHECKING:
    from boostmpi.config import Config, ModelConfig
    from boostmpi.sim.machines import Machine

# "attention": the fused attention core (forward, backward and any recompute of it) at its backend's
# rate; materialised scores (attention = matmul / fused_softmax) count under gemm and elementwise
BREAKDOWN_KEYS = ("gemm", "elementwise", "attention", "tp_comm", "pp_bubble_and_p2p", "dp_comm", "optimizer")


@dataclass
class Prediction:
    time_s: float
    breakdown: dict[str, float]
    comm_bytes: dict[str, int] | None  # None where the workload is not a boostmpi configuration
    memory_bytes: dict[str, int]  # "fits": a bool
    mfu: float
    tokens_per_s: float
    details: dict[str, object] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return {"time_s": self.time_s, "breakdown": self.breakdown, "comm_bytes": self.comm_bytes,
                "memory_bytes": self.memory_bytes, "mfu": self.mfu, "tokens_per_s": self.tokens_per_s,
                **self.details}


def master_dtype(dtype: str) -> str:
    from boostmpi.precision import master_dtype_name

    return master_dtype_name(dtype)


def tp_per_micro_batch(cfg: "Config", measure: Callable[[Collective], int], s: Shape | None = None) -> int:
    """`measure(collective)` summed over the tensor-parallel collectives of one micro-batch and one
    pipeline (COMMUNICATION.md)."""
    s = s or shape_of(cfg, "flash")
    if s.p == 1:
        return 0
    strategy = tp_strategy(cfg)

    def collected(ops: Sequence[Op], fwd_times: int = 1) -> int:
        return sum(measure(op) * (fwd_times if op.phase == "fwd" else 1) for op in ops if isinstance(op, Collective))

    layer_fwd_times = 2 if cfg.train.recompute == "layer" else 1
    total = cfg.model.n_layers * collected(layer_plan(s, strategy), layer_fwd_times)
    return total + collected(embedding_plan(s, strategy)) + collected(head_plan(s, strategy))


def tp_calls(cfg: "Config") -> int:
    """Tensor-parallel collective calls of one optimizer step, each group's counted once (as the
    engine's counters count them)."""
    return cfg.parallel.dp * cfg.train.grad_accum * tp_per_micro_batch(cfg, lambda op: 1)


def comm_bytes(cfg: "Config") -> dict[str, int]:
    """Payload bytes per axis of one optimizer step, exactly as docs/COMMUNICATION.md counts them."""
    par, t = cfg.parallel, cfg.train
    e = ITEMSIZE[t.dtype]
    M, N = t.grad_accum, t.micro_batch_size * cfg.model.seq_len
    tp = par.dp * M * tp_per_micro_batch(cfg, lambda op: op.nbytes(e))
    # btp's residual is sharded along d_model; under sequence parallelism along the sequence
    shard = cfg.model.d_model // par.tp if boundary_sharded(cfg) else cfg.model.d_model
    # every boundary between consecutive virtual stages (pp - 1 of them, pp * v - 1 interleaved)
    pp = par.tp * par.dp * M * 2 * (par.pp * par.virtual_stages - 1) * N * shard * e
    dp = 0
    if par.dp > 1:
        grads = sum(stage_params(cfg, st)[1] for st in range(par.pp)) * ITEMSIZE[master_dtype(t.dtype)]
        # ZeRO all-gathers the weights the forward reads: the compute dtype (bf16 under mixed precision)
        slices = e * sum(zero_allgather_elements(n, par.dp, par.zero_stage) for st in range(par.pp)
                         for n in rank_params(cfg, st))
        # stage 2 reduces every micro-batch's gradient; stage 3 also gathers the weights twice per micro-batch
        dp = {2: M * grads + slices, 3: M * (grads + 2 * slices)}.get(par.zero_stage, grads + slices)
    return {"tp": int(tp), "pp": int(pp), "dp": int(dp)}


# ------------------------------------------------------------------ parameter counts in closed form
def stage_layer_count(cfg: "Config", stage: int) -> int:
    """How many layers pipeline stage `stage` runs (its chunks' lengths; no list of them is made)."""
    par = cfg.parallel
    return sum(len(c) for c in chunk_layers(cfg.model.n_layers, par.pp, stage, par.virtual_stages))


def _layer_and_rest(cfg: "Config", stage: int) -> tuple[list[ParamSpec], list[ParamSpec]]:
    """(the specs of one layer, the specs outside the layers) of stage `stage`: every layer holds the
    same shapes, so a stage's counts are the rest plus its layer count times one layer's, computed on
    a copy of the configuration with one layer per model chunk (cost independent of n_layers)."""
    from dataclasses import replace as _replace

    par = cfg.parallel
    chunks = par.pp * par.virtual_stages
    small = _replace(cfg, model=_replace(cfg.model, n_layers=chunks))
    specs = param_specs(small, 0, stage)
    first = next((s.layer for s in specs if s.layer is not None), None)
    return [s for s in specs if s.layer is not None and s.layer == first], [s for s in specs if s.layer is None]


def _rank_numel(spec: ParamSpec, tp: int, t: int) -> int:
    numel = math.prod(spec.global_shape)
    if not isinstance(spec.shard_dim, int):  # None: every tp rank holds the whole tensor
        return numel
    size = spec.global_shape[spec.shard_dim]
    a, b = split_range(size, tp, t)
    return numel // size * (b - a)


# ------------------------------------------------------------------ ZeRO-1 (parallel.zero_stage = 1)
def rank_params(cfg: "Config", stage: int) -> list[int]:
    """Local parameter count of every tensor-parallel rank of pipeline stage `stage` (split ranges
    give the first ranks one more row or column where a dim does not divide)."""
    tp = cfg.parallel.tp
    layer, rest = _layer_and_rest(cfg, stage)
    n = stage_layer_count(cfg, stage)
    return [sum(_rank_numel(s, tp, t) for s in rest) + n * sum(_rank_numel(s, tp, t) for s in layer)
            for t in range(tp)]


def zero_slice(n_params: int, dp: int, zero_stage: int) -> int:
    """Elements of the flat buffer whose optimizer state one dp rank holds: all of them, or under
    ZeRO-1 the largest dp slice, ceil(n / dp)."""
    return -(-n_params // dp) if zero_stage and dp > 1 else n_params


def checkpoint_bytes(cfg: "Config") -> tuple[int, int]:
    """(largest rank's bytes, total bytes) of a checkpoint's rank files: every rank writes parameters
    and both AdamW moments (master dtype) of its dp share of its tp/pp shard (docs/CHECKPOINTS.md)."""
    par, e = cfg.parallel, ITEMSIZE[master_dtype(cfg.train.dtype)]
    shares = [-(-n // par.dp) for st in range(par.pp) for n in rank_params(cfg, st)]
    # each element once: every layer's, and the embedding, final norm and head (on the first and last stage)
    layer, _ = _layer_and_rest(cfg, 0)
    outside = {s.name: s for st in {0, par.pp - 1} for s in _layer_and_rest(cfg, st)[1]}
    total = cfg.model.n_layers * sum(math.prod(s.global_shape) for s in layer) + \
        sum(math.prod(s.global_shape) for s in outside.values())
    return 3 * e * max(shares), 3 * e * total


def checkpoint_seconds(cfg: "Config", rank_write_bandwidth: float, filesystem_bandwidth: float) -> float:
    """Seconds to write a checkpoint when every rank writes its file at once: the largest rank's bytes
    at `rank_write_bandwidth` (bytes/s one process writes), or the total at `filesystem_bandwidth`
    (bytes/s the filesystem takes from all writers together), whichever is slower."""
    largest, total = checkpoint_bytes(cfg)
    return max(largest / rank_write_bandwidth, total / filesystem_bandwidth)


def zero_allgather_elements(n_params: int, dp: int, zero_stage: int) -> int:
    """Counted elements of ZeRO-1's all-gather of the updated slices (the piece of dp rank 0), else 0."""
    return zero_slice(n_params, dp, zero_stage) if zero_stage and dp > 1 else 0


_PARAM_COUNTS: "dict[tuple[ModelConfig, int, int, str, int, bool, bool], tuple[int, int]]" = {}


def stage_params(cfg: "Config", stage: int) -> tuple[int, int]:
    """(parameters of the largest tensor-parallel rank, parameters summed over all tp ranks) of
    pipeline stage `stage`, from the engine's own parameter specs of tp rank 0: split ranges give
    the first rank the largest piece, and the sum over ranks is a sharded tensor once and a
    replicated one tp times."""
    par = cfg.parallel
    # what the counts depend on: the layout, and which kind of stage this is (its number of
    # identical layers, whether it holds the embedding, the head)
    n = stage_layer_count(cfg, stage)
    key = (cfg.model, par.tp, par.pp, par.tp_mode, n, stage == 0, stage == par.pp - 1)
    if key not in _PARAM_COUNTS:
        layer, rest = _layer_and_rest(cfg, stage)

        def counts(specs: Sequence[ParamSpec]) -> tuple[int, int]:
            return (sum(spec.local_numel for spec in specs),
                    sum(math.prod(spec.global_shape) * (par.tp if spec.tp_replicated else 1) for spec in specs))

        (layer_largest, layer_total), (rest_largest, rest_total) = counts(layer), counts(rest)
        _PARAM_COUNTS[key] = (rest_largest + n * layer_largest, rest_total + n * layer_total)
    return _PARAM_COUNTS[key]


def model_flops_per_step(cfg: "Config") -> float:
    """Model FLOPs of one step: 6 x matmul parameters + 12 x L x C x T per token.

    The standard count, the one place the project computes it (MFU here, in `bench/gpu_step.py` and
    in the validation against published runs): PaLM (Chowdhery et al. 2022, App. B, `6N + 12LHQT`)
    and Narayanan et al. (SC21, Eq. 3, per layer `24BsC^2 + 4Bs^2C` forward, x3 with the backward)
    both count the attention's QK^T and PV over the full T x T square, causal mask or not, and
    count no recomputation. Matmul parameters: every linear of a layer (factors for low-rank
    archs) and the LM head; the embedding is a lookup."""
    m = cfg.model
    matmul_params = m.d_model * m.vocab_size  # the LM head (the embedding is a lookup)
    for d_in, d_out, r in m.linear_shapes().values():
        matmul_params += m.n_layers * (d_in * d_out if r is None else r * (d_in + d_out))
    return model_flops(matmul_params, m.n_layers, m.d_model, m.seq_len, cfg.tokens_per_step)


def model_flops(matmul_params: int, n_layers: int, d_model: int, seq_len: int, tokens: int) -> float:
    """`6N + 12 L C T` per token (see model_flops_per_step), for `tokens` tokens."""
    return 6.0 * matmul_params * tokens + 12.0 * n_layers * d_model * seq_len * tokens


@dataclass
class Workload:
    """What one optimizer step runs, independent of the machine: the shape of one micro-batch on
    one tensor-parallel rank, the layout, and what the step model needs besides the plans.

    `workload_of(cfg)` builds it for a boostmpi configuration; `boostmpi.sim.published` builds it
    for the published runs the model is validated on (GPT with a GELU MLP, FSDP)."""
    shape: Shape  # its `attention` is replaced by the machine's unless `attention` is set here
    strategy: str  # "megatron", "vanilla" or "btp" (plans.layer_plan)
    layers_per_stage: list[int]
    tp: int
    pp: int
    dp: int
    micro_batches: int  # per pipeline and optimizer step
    recompute: str  # "none", "layer" (full activation recomputation), "lowrank" or "selective" (attention core)
    dtype: str
    overlap: bool  # data-parallel communication behind the backward
    params_per_stage: list[int]  # the largest tensor-parallel rank's parameter count, per stage
    p2p_elements: int  # what one rank sends per micro-batch between neighbouring stages
    model_flops: float  # per step (model_flops_per_step)
    tokens_per_step: int
    virtual_stages: int = 1  # interleaved 1F1B: model chunks per pipeline rank
    dp_sharded: bool = False  # FSDP: zero_stage 3
    zero_stage: int = 0  # 1: AdamW moments sharded over dp; 2: and gradients; 3: and parameters (dp_seconds)
    attention: str | None = None  # "flash" or "matmul" when the workload fixes it (shape as given), else the machine's
    val_micro_batches: int = 0  # forward-only micro-batches of one validation pass, per data-parallel rank
    val_every: int = 0  # steps between validation passes (0: none inside the run's steps)


class StageCost(TypedDict):
    """One pipeline stage's share of a step (predict_workload): its passes, parameters, layers and
    activation bytes."""

    fwd: PassTimes
    bwd: PassTimes
    params: int
    layers: int
    activations: float


def boundary_sharded(cfg: "Config") -> bool:
    """Whether a pipeline boundary holds 1/tp of the activation per rank (btp, or sequence parallel)."""
    par = cfg.parallel
    return tp_strategy(cfg) == "btp" or (par.sequence_parallel and par.tp > 1)


def workload_of(cfg: "Config") -> Workload:
    """The Workload of a boostmpi configuration (the engine's own layouts and parameter specs)."""
    m, par, t = cfg.model, cfg.parallel, cfg.train
    strategy = plan_strategy(cfg)
    s = shape_of(cfg, "flash")
    return Workload(
        shape=s, strategy=strategy,
        layers_per_stage=[stage_layer_count(cfg, st) for st in range(par.pp)],
        tp=par.tp, pp=par.pp, dp=par.dp, micro_batches=t.grad_accum, recompute=t.recompute,
        virtual_stages=par.virtual_stages,
        dtype=t.dtype, overlap=par.overlap, zero_stage=par.zero_stage,
        params_per_stage=[stage_params(cfg, st)[0] for st in range(par.pp)],
        p2p_elements=s.N * s.C // s.p if boundary_sharded(cfg) else s.N * s.C,
        model_flops=model_flops_per_step(cfg), tokens_per_step=cfg.tokens_per_step,
        val_micro_batches=-(-(-(-t.val_windows // par.dp)) // t.micro_batch_size), val_every=t.val_every)


def predict(cfg: "Config", machine: "Machine") -> Prediction:
    """The full prediction for `cfg` (model and layout) on `machine`."""
    return predict_workload(workload_of(cfg), machine, comm_bytes(cfg))


def predict_workload(w: Workload, machine: "Machine", comm: dict[str, int] | None = None) -> Prediction:
    """Time, memory and MFU of one optimizer step of `w` on `machine`; `comm` = payload bytes per axis."""
    dtype, recompute, M = w.dtype, w.recompute, w.micro_batches
    s = w.shape if w.attention else with_attention(w.shape, machine.attention)
    if machine.elementwise == "eager":  # the software stack runs elementwise work op by op
        s = replace(s, eager=True)
    elif machine.elementwise == "fused":  # another framework's fused kernels, not the engine's
        s = replace(s, engine=False)
    strategy = w.strategy
    e, e_master = ITEMSIZE[dtype], ITEMSIZE[master_dtype(dtype)]

    pp_link = group_link(machine, 2, w.tp)  # neighbouring stages are tp ranks apart

    layer = layer_plan(s, strategy)
    again = recompute_plan(layer, recompute)
    layer_f = pass_times(layer, False, s, machine, dtype)
    layer_b = pass_times(layer, True, s, machine, dtype)
    if again is not None:  # the backward runs (part of) the forward again first
        layer_b.add(pass_times(again, False, s, machine, dtype))
    per_layer_saved = saved_elements(layer)
    layer_input = s.N * s.C // s.p if strategy == "btp" or s.sp else s.N * s.C
    if recompute == "layer":
        kept = layer_input  # the layer's input only
    elif recompute == "lowrank":
        kept = layer_input + kept_by_lowrank(layer, s)
    elif recompute == "selective":  # everything but the attention core's statistics (or probabilities)
        kept = per_layer_saved - core_statistics(layer)
    else:
        kept = per_layer_saved
    # what a recompute rebuilds for the layer whose backward runs: the layer's whole set, or the core's
    rebuilt = {"none": 0, "selective": saved_elements(attention_core_ops(layer))}.get(recompute, per_layer_saved)
    # lowrank looks the first layer's input up again from the token ids (no collective under btp)
    first_input_dropped = layer_input if recompute == "lowrank" else 0

    stages: list[StageCost] = []
    for stage, n_layers in enumerate(w.layers_per_stage):
        extra = (embedding_plan(s, strategy) if stage == 0 else []) + \
                (head_plan(s, strategy) if stage == w.pp - 1 else [])
        fwd, bwd = PassTimes(), PassTimes()
        fwd.add(layer_f, n_layers)
        bwd.add(layer_b, n_layers)
        fwd.add(pass_times(extra, False, s, machine, dtype))
        bwd.add(pass_times(extra, True, s, machine, dtype))
        # a framework that adds each micro-batch's weight gradients into its accumulation buffer in a
        # pass of its own (not inside the weight-gradient GEMM) streams its parameters once more
        bwd.elementwise += grad_accumulation_seconds(w.params_per_stage[stage], machine)
        # ZeRO-3: the stack's copies around each gather (forward and backward) and reduce-scatter
        gather_copy, reduce_copy = zero3_copy_seconds(w, w.params_per_stage[stage], machine)
        fwd.elementwise += gather_copy
        bwd.elementwise += gather_copy + reduce_copy
        # 1F1B: stage i holds up to pp - i micro-batches; interleaved, up to its warm-up + 1 chunks of
        # 1/v of its layers, (v + 1) pp - 1 on the first rank (the head's chunk: one at a time)
        in_flight = min(M, w.pp - stage)
        in_flight_layers: float = in_flight
        if w.virtual_stages > 1:
            units = min(warmup_units(w.pp, stage, M, w.virtual_stages) + 1, w.virtual_stages * M)
            in_flight_layers = units / w.virtual_stages
        kept_stage = n_layers * kept - (first_input_dropped if stage == 0 and n_layers else 0)
        activations = (in_flight_layers * kept_stage + in_flight * saved_elements(extra)
                       + rebuilt) * e
        stages.append({"fwd": fwd, "bwd": bwd, "params": w.params_per_stage[stage],
                       "layers": n_layers, "activations": activations})

    slowest = max(stages, key=lambda st: st["fwd"].total + st["bwd"].total)
    slot = slowest["fwd"].total + slowest["bwd"].total

    # pipeline: M + (pp - 1)/v slots of one forward and one backward (interleaving v model chunks
    # per rank shortens warm-up and cool-down v times); the p2p sends sit on the path, v per slot,
    # two transfers each (four where every send and receive blocks on its own: pipeline_transfers)
    pp_time = 0.0
    if w.pp > 1:
        v = w.virtual_stages
        msg = w.p2p_elements * e
        transfers = pipeline_transfers(machine) * (v * M + w.pp - 1)
        pp_time = (w.pp - 1) / v * slot + transfers * p2p_seconds(msg, pp_link)

    # data parallel, by ZeRO stage (docs/SIM.md, "Data parallelism and ZeRO stages")
    zero = zero_stage_of(w)
    dp_time = 0.0 if w.dp == 1 else dp_seconds(w, zero, stages, slowest, e, e_master, machine)

    # AdamW over the local master buffer (+ the compute copy when it is a narrower dtype); ZeRO-3
    # keeps 1/dp of parameters, gradients and moments, stages 1 and 2 the moments (and gradients) of a slice
    full = max(st["params"] for st in stages)
    params = -(-full // w.dp) if zero == 3 and w.dp > 1 else full
    owned = zero_slice(params, w.dp, zero if zero < 3 else 0)  # what this rank's AdamW updates
    opt_bytes = owned * machine.optimizer_passes * e_master + (params * e if e != e_master else 0)
    optimizer = opt_bytes / (machine.memory_bandwidth * machine.elementwise_efficiency)

    per_mb = PassTimes()
    per_mb.add(slowest["fwd"])
    per_mb.add(slowest["bwd"])
    breakdown = {"gemm": M * per_mb.gemm, "elementwise": M * per_mb.elementwise, "attention": M * per_mb.attention,
                 "tp_comm": M * per_mb.tp_comm, "pp_bubble_and_p2p": pp_time,
                 "dp_comm": dp_time, "optimizer": optimizer}
    time_s = sum(breakdown.values())

    # master weights (under mixed precision with ZeRO-1/2, the slice only) + the whole compute copy;
    # ZeRO-3 also holds the gathered compute-dtype weights of the layer running and the one prefetched
    gathered = 2 * full / max(slowest["layers"], 1) * e if zero == 3 and w.dp > 1 else 0
    if zero == 2:
        grads = owned + full / max(slowest["layers"], 1)  # its slice + one layer's bucket being reduced
    else:
        grads = params + (owned if owned != params else 0)  # + ZeRO-1's summed slice
    memory: dict[str, float]  # bytes, and "fits"
    memory = {"params": (owned * e_master + params * e if e != e_master else params * e_master) + gathered,
              "grads": grads * e_master,
              "optimizer": 2 * owned * e_master,
              "activations": max(st["activations"] for st in stages)}
    memory["total"] = sum(memory.values())
    memory["capacity"] = machine.memory_capacity_bytes
    memory["fits"] = memory["total"] <= machine.memory_capacity_bytes
    memory_bytes = {k: (v if isinstance(v, bool) else int(v)) for k, v in memory.items()}

    gpus = w.tp * w.pp * w.dp
    mfu = w.model_flops / (time_s * gpus * machine.peak(dtype))
    # validation every val_every steps, spread over the steps: what a training log's time per step shows
    validation = validation_seconds(w, stages, machine, pp_link, e)
    details = {"machine": machine.name, "gpus": gpus, "strategy": strategy,
               "tokens_per_step": w.tokens_per_step,
               "forward_s": slowest["fwd"].total, "backward_s": slowest["bwd"].total,
               "stage_forward_s": [st["fwd"].total for st in stages],
               "validation_s": validation,
               "time_with_validation_s": time_s + (validation / w.val_every if w.val_every else 0.0)}
    return Prediction(time_s, breakdown, comm, memory_bytes, mfu, w.tokens_per_step / time_s, details)


def validation_seconds(w: Workload, stages: Sequence[StageCost], machine: "Machine", pp_link: Link, e: int) -> float:
    """One validation pass, forward only: each data-parallel rank's `val_micro_batches` micro-batches
    pipelined through the stages (boostmpi's `Engine.evaluate_batches`, Megatron's forward-only
    schedule, DeepSpeed's InferenceSchedule): n + pp - 1 slots of the slowest stage's forward, each with
    the transfers on its path (the receive; and the send too where each blocks on its own:
    pipeline_transfers), then one sum of the losses over all ranks."""
    n = w.val_micro_batches
    if not n:
        return 0.0
    from boostmpi.precision import HOST_DTYPE, itemsize

    hops = pipeline_transfers(machine) // 2 * p2p_seconds(w.p2p_elements * e, pp_link) if w.pp > 1 else 0.0
    host_sum = group_allreduce_seconds(itemsize(HOST_DTYPE) * n, w.tp * w.pp * w.dp, 1, machine)
    return (n + w.pp - 1) * (max(st["fwd"].total for st in stages) + hops) + host_sum


def grad_accumulation_seconds(params: int, machine: "Machine") -> float:
    """The separate gradient-accumulation pass of one micro-batch over `params` parameters
    (`grad_accumulation_bytes` per parameter; none when the GEMMs accumulate in place)."""
    if not machine.grad_accumulation_bytes:
        return 0.0
    stream = machine.memory_bandwidth * machine.elementwise_efficiency
    return params * machine.grad_accumulation_bytes / stream + machine.kernel_launch_s


def zero3_copy_seconds(w: Workload, params: int, machine: "Machine") -> tuple[float, float]:
    """(seconds of one gather's copies, of one reduce-scatter's copies) over a stage's `params`
    parameters: the stack's own passes around its ZeRO-3 collectives on the compute stream
    (`zero3_gather_copy_bytes`, `zero3_reduce_copy_bytes` per parameter); none without ZeRO-3 over
    more than one rank."""
    if zero_stage_of(w) != 3 or w.dp == 1:
        return 0.0, 0.0
    stream = machine.memory_bandwidth * machine.elementwise_efficiency
    return (params * machine.zero3_gather_copy_bytes / stream, params * machine.zero3_reduce_copy_bytes / stream)


def pipeline_transfers(machine: "Machine") -> int:
    """Transfers on the critical path of one 1F1B step of an interior stage: with batched calls a
    stage sends its output while it receives the next gradient (and the reverse): two; with each
    send and receive a blocking call of its own, four one after the other."""
    return 4 if machine.pipeline_p2p == "blocking" else 2


def zero_stage_of(w: Workload) -> int:
    """The ZeRO stage a workload runs (FSDP's full sharding is stage 3)."""
    return 3 if w.dp_sharded else w.zero_stage


def dp_seconds(w: Workload, zero: int, stages: Sequence[StageCost], slowest: StageCost, e: int, e_master: int,
               machine: "Machine") -> float:
    """Exposed data-parallel communication of one step (hierarchical collectives across nodes).

    Stage 0: one all-reduce of the master-dtype gradient; stage 1: its reduce-scatter (half), then the
    all-gather of the updated compute-dtype slices after the optimizer; both once per step, behind
    the last micro-batch's backward when overlapped (what exceeds it, and at least the last bucket,
    one layer's share, is exposed). Stage 2 reduce-scatters after every micro-batch's backward
    (gradients live only as slices), then all-gathers like stage 1. Stage 3 all-gathers each layer's
    compute-dtype weights before its forward and again before its backward, and reduce-scatters its
    gradient after it, every micro-batch; a framework prefetches one layer ahead (`zero3_exposed`)."""
    M, stride = w.micro_batches, w.tp * w.pp

    def collective(per_stage_bytes: Callable[[StageCost], float], fraction: float) -> float:
        return max(group_allreduce_seconds(per_stage_bytes(st), w.dp, stride, machine, fraction=fraction)
                   for st in stages)

    layers = slowest["layers"] + 1  # buckets: its layers and the embedding or head
    if zero == 3:
        gather = collective(lambda st: st["params"] * e, 0.5)
        reduce = collective(lambda st: st["params"] * e_master, 0.5)
        return M * zero3_exposed(gather, reduce, slowest, layers, w.overlap)
    reduce = collective(lambda st: st["params"] * e_master, 0.5 if zero else 1.0)
    times = M if zero == 2 else 1
    if w.overlap:  # buckets go out as layers finish; the last bucket cannot be hidden
        reduce = max(reduce - slowest["bwd"].total, reduce / layers)
    total = times * reduce
    if zero:  # the all-gather of the updated slices, after the optimizer
        total += collective(lambda st: st["params"] * e, 0.5)
    return total


def zero3_exposed(gather: float, reduce: float, slowest: StageCost, layers: int, overlap: bool) -> float:
    """Seconds of ZeRO-3 communication one micro-batch leaves on the critical path.

    The gathers of a pass and the reduce-scatters of the backward split into `layers` equal units.
    With prefetching, the gather of unit i + 1 runs while unit i computes (DeepSpeed issues gathers
    up to `stage3_prefetch_bucket_size` parameters ahead, default 5e7, which is one layer or less of
    a large model; PyTorch FSDP prefetches one layer, `backward_prefetch = BACKWARD_PRE` and
    `forward_prefetch`, FSDP2 by default), so a unit costs max(compute, communication) and only the
    first gather (and the last reduce-scatter) of a pass is exposed in full: a prefetch hides latency,
    never bandwidth. Without overlap every collective is exposed."""
    if not overlap:
        return 2 * gather + reduce
    g, r = gather / layers, reduce / layers
    f, b = slowest["fwd"].total / layers, slowest["bwd"].total / layers
    forward = g + (layers - 1) * max(0.0, g - f)
    backward = g + r + (layers - 1) * max(0.0, g + r - b)
    return forward + backward


def predict_step_time(cfg: "Config", machine: "Machine | str | Path") -> float:
    """Seconds of one optimizer step of `cfg` on `machine` (a Machine, a built-in name or a path)."""
    if isinstance(machine, (str, Path)):  # not a Machine: a built-in name or a path
        from boostmpi.sim.machines import load_machine
        machine = load_machine(machine)
    return predict(cfg, machine).time_s


def memory_estimate(cfg: "Config") -> dict[str, int] | None:
    """{params, grads, optimizer, activations, workspace, total}: bytes per rank the start-up memory
    check compares with what a rank may use: this model's figures for `cfg` (the largest pipeline
    stage) with the workspace of the path that runs (boostmpi/sim/memory.py: the optimizer's scratch;
    on the CPU path also the step's temporaries, the checkpoint's buffers and the process itself), or
    None for a layout the model does not cover."""
    from boostmpi.sim.machines import builtin_names, load_machine
    from boostmpi.sim.memory import rank_memory

    try:  # the bytes depend on neither the machine nor the attention backend (priced as the profile's auto)
        w = workload_of(cfg)
        w = replace(w, shape=replace(w.shape, attention_backend="auto"))
        memory = predict_workload(w, load_machine(builtin_names()[0]), comm_bytes(cfg)).memory_bytes
    except Exception:  # noqa: BLE001 - a layout the model does not cover: no estimate, no refusal
        return None
    return rank_memory(cfg, memory)
