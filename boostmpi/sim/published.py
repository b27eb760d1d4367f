"""Published training runs the performance model is validated on, and the comparison itself.

None of these runs shaped the model: the machine profiles come from datasheets and site
documentation plus the few global efficiency constants of docs/SIM.md, fixed before this
comparison, and no number here is adjusted per row. docs/SIM_VALIDATION.md ("Validation against
published runs") gives the source of every row, the configuration as published and what had to be assumed.

Two sets: `published_runs()` describes each run to the model directly (`Workload`: GPT's GELU
MLP, Megatron's fused softmax, eager PyTorch), and `cli_runs()` states each run as a user states
it to `boostmpi sim`: a configuration file, `--set` nothing, `--machine` a built-in profile or a
profile file; `cli_validation_table()` runs the command line itself for every row.

    python -m boostmpi.sim.published          # prints both error tables
    python -m boostmpi.sim.published --cli    # the command-line set only, with each row's command
"""

import contextlib
import io
import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypedDict

from boostmpi.sim.machines import Machine, load_machine
from boostmpi.sim.model import Workload, model_flops, predict_workload
from boostmpi.sim.operations import ATTENTION_DROPOUT_PASSES, FUSED_SOFTMAX_PASSES, Shape

# Megatron's fused scale-mask-softmax (read the scores, write the probabilities; backward reads
# the probabilities and their gradient, writes the scores' gradient) followed by attention dropout
# (read, write, a one-byte mask: half a 16-bit pass each way): passes over the B*h*s*s scores.
FUSED_SOFTMAX_DROPOUT_PASSES = tuple(a + b for a, b in zip(FUSED_SOFTMAX_PASSES, ATTENTION_DROPOUT_PASSES))
Summary = TypedDict("Summary", {"worst": float, "median": float, "best": float})  # of the rows' absolute errors
CliSummary = TypedDict("CliSummary", {"worst": float, "median": float, "best": float, "frameworks": list[str], "gpus": list[str]})
PredictionJson = TypedDict("PredictionJson", {"time_s": float, "time_with_validation_s": float, "breakdown": dict[str, float]})  # what the tables read of `sim --json`


@dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    machine: str  # built-in profile
    measured_s: float  # seconds per iteration, derived from the published figure (see `derived`)
    derived: str  # how measured_s follows from what is published
    workload: Workload
    assumed: str  # what the publication leaves unknown and the row assumes


# ------------------------------------------------------------------ GPT on Megatron-LM (SC21)
def sc21_flops_per_iteration(B: int, s: int, l: int, h: int, V: int) -> float:
    """Narayanan et al. (SC21) Eq. 3, the FLOPs their Table 1 throughput is computed with
    (activation recomputation included): 96 B s l h^2 (1 + s/6h + V/16lh)."""
    return 96.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def gpt_params_per_stage(h: int, l: int, V: int, s: int, t: int, p: int) -> list[int]:
    """Parameters of the largest tensor-parallel rank of each stage of a Megatron GPT: per layer
    the fused QKV (3h^2 + 3h), projection (h^2 + h), h -> 4h -> h MLP (8h^2 + 5h), two LayerNorms
    (4h), split t ways except the biases of the row-parallel GEMMs and the LayerNorms; the word
    embedding (V/t rows) and learned positions (s x h) on the first stage, the tied output
    embedding's copy and the final LayerNorm on the last."""
    per_layer = (12 * h * h + 7 * h) // t + 6 * h
    layers = l // p
    stages = [layers * per_layer for _ in range(p)]
    stages[0] += V * h // t + s * h
    stages[-1] += (V * h // t if p > 1 else 0) + 2 * h
    return stages


def gpt_run(params_b: str, heads: int, h: int, l: int, t: int, p: int, n: int, B: int, tflops: float, mbs: int, v: int, overlap: bool) -> PublishedRun:
    """One row of SC21 Table 1 (GPT, V = 51200, s = 2048, 16-bit, full activation recomputation)."""
    V, s = 51200, 2048
    dp = n // (t * p)
    M = B // (mbs * dp)
    shape = Shape(B=mbs, T=s, C=h, F=4 * h, H=heads, Hkv=heads, Dh=h // heads, V=V, Ra=0, Rm=0, p=t,
                  cola=False, gate_act=False, grouped=True, sync_norm=False, attention="matmul",
                  gated=False, softmax_passes=FUSED_SOFTMAX_DROPOUT_PASSES, softmax_saved_per_row=s)
    workload = Workload(
        shape=shape, strategy="megatron", layers_per_stage=[l // p] * p, tp=t, pp=p, dp=dp,
        micro_batches=M, recompute="layer", dtype="bfloat16", overlap=overlap,
        params_per_stage=gpt_params_per_stage(h, l, V, s, t, p),
        p2p_elements=mbs * s * h // t,  # scatter/gather: each tp rank sends 1/t of the boundary
        model_flops=model_flops(12 * l * h * h + V * h, l, h, s, B * s), tokens_per_step=B * s,
        virtual_stages=v, attention="matmul")
    measured = sc21_flops_per_iteration(B, s, l, h, V) / (n * tflops * 1e12)
    return PublishedRun(
        name=f"GPT {params_b}B (t={t}, p={p}, d={dp}, {n} GPUs)",
        source="Narayanan et al., SC21, Table 1; layout from Megatron-LM examples/sc21/run_table_1.sh",
        machine="a100-80gb-dgx", measured_s=measured,
        derived=f"Eq. 3 FLOPs / ({n} GPUs x {tflops} TFLOP/s)",
        workload=workload,
        assumed=("attention and hidden dropout 0.1 (Megatron's defaults); "
                 + ("data-parallel all-reduce overlapped (torch DDP)" if overlap
                    else "data-parallel all-reduce after the backward (Megatron's local DDP)")))


# name, params (B), heads, hidden, layers, t, p, GPUs, batch, TFLOP/s per GPU (Table 1);
# micro-batch, model chunks per pipeline rank, torch DDP (run_table_1.sh)
SC21_TABLE_1 = [
    ("1.7", 24, 2304, 24, 1, 1, 32, 512, 137, 16, 1, True),
    ("3.6", 32, 3072, 30, 2, 1, 64, 512, 138, 16, 1, True),
    ("7.5", 32, 4096, 36, 4, 1, 128, 512, 142, 16, 1, True),
    ("18.4", 48, 6144, 40, 8, 1, 256, 1024, 135, 8, 1, True),
    ("39.1", 64, 8192, 48, 8, 2, 512, 1536, 138, 4, 1, False),
    ("76.1", 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 3, False),
    ("145.6", 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 2, False),
    ("310.1", 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 2, False),
    ("529.6", 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 3, False),
    ("1008.0", 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, 1, False),
]


# ------------------------------------------------------------------ LLaMA on torchtitan (FSDP2)
def llama_run(name: str, C: int, layers: int, heads: int, kv_heads: int, F: int, V: int, T: int, local_batch: int, recompute: str, wps: float, mfu: str) -> PublishedRun:
    """One row of torchtitan's docs/performance.md: FSDP2 over 64 A100-80GB, bf16, local batch."""
    gpus = 64
    K = C // heads * kv_heads
    matmul_params = layers * (C * (2 * C + 2 * K) + 3 * C * F) + V * C
    params = matmul_params + V * C + (2 * layers + 1) * C  # + embedding and RMSNorm weights
    shape = Shape(B=local_batch, T=T, C=C, F=F, H=heads, Hkv=kv_heads, Dh=C // heads, V=V, Ra=0, Rm=0,
                  p=1, cola=False, gate_act=True, grouped=False, sync_norm=False, attention="flash",
                  eager=True, attention_backend="torch")  # PyTorch SDPA: FlashAttention-2's kernel
    workload = Workload(
        shape=shape, strategy="megatron", layers_per_stage=[layers], tp=1, pp=1, dp=gpus,
        micro_batches=1, recompute=recompute, dtype="bfloat16", overlap=True, params_per_stage=[params],
        p2p_elements=0, model_flops=model_flops(matmul_params, layers, C, T, gpus * local_batch * T),
        tokens_per_step=gpus * local_batch * T, dp_sharded=True, attention="flash")
    return PublishedRun(
        name=f"{name} (FSDP 64 GPUs, batch {local_batch}, AC {'full' if recompute == 'layer' else 'none'})",
        source="torchtitan docs/performance.md (64 A100 80GB, FSDP2)", machine="a100-80gb-dgx",
        measured_s=local_batch * T / wps, derived=f"{local_batch} x {T} tokens / {wps} tokens/s per GPU "
                                                  f"(published MFU {mfu})",
        workload=workload,
        assumed=("nodes of 8 A100 with one 200 Gb/s adapter per GPU (the cluster is not described); "
                 "parameters gathered in bf16, gradients reduced in fp32; fused elementwise kernels"))


# Llama 2 13B / 70B (sequence 4096, vocabulary 32000) and Llama 3 70B (8192, 128256): the model
# shapes torchtitan trains; the selective-AC rows are left out (selective recomputation is not modelled)
TORCHTITAN = [
    ("Llama 2 13B", 5120, 40, 40, 40, 13824, 32000, 4096, 2, "none", 2162, "61.1%"),
    ("Llama 2 70B", 8192, 80, 64, 8, 28672, 32000, 4096, 2, "layer", 353, "50.5%"),
    ("Llama 3 70B", 8192, 80, 64, 8, 28672, 128256, 8192, 1, "layer", 331, "51.7%"),
]


def published_runs() -> list[PublishedRun]:
    return [gpt_run(*row) for row in SC21_TABLE_1] + [llama_run(*row) for row in TORCHTITAN]


def validation_table() -> list[tuple[PublishedRun, float, float]]:
    """[(run, predicted seconds, relative error)] for every published run."""
    rows: list[tuple[PublishedRun, float, float]] = []
    for run in published_runs():
        predicted = predict_workload(run.workload, load_machine(run.machine)).time_s
        rows.append((run, predicted, predicted / run.measured_s - 1))
    return rows


def summary(rows: Sequence[tuple[object, float, float]]) -> Summary:
    errors = [abs(e) for _, _, e in rows]
    return {"worst": max(errors), "median": statistics.median(errors), "best": min(errors)}


def format_table(rows: Sequence[tuple[PublishedRun, float, float]]) -> str:
    lines = ["| run | source | measured s/iter | predicted s/iter | error |", "|---|---|---|---|---|"]
    for run, predicted, error in rows:
        lines.append(f"| {run.name} | {run.source} | {run.measured_s:.2f} | {predicted:.2f} | {error:+.1%} |")
    s = summary(rows)
    lines.append(f"\nworst {s['worst']:.1%}, median {s['median']:.1%}, best {s['best']:.1%} "
                 f"over {len(rows)} runs")
    return "\n".join(lines)



# ================================================================== the command-line set
@dataclass(frozen=True)
class CliRun:
    """A published run stated the way a user states it to `boostmpi sim`."""
    name: str
    framework: str
    gpu: str  # the device generation, for the coverage the targets ask for
    source: str  # publication, table or figure
    machine: str  # built-in profile
    config: dict[str, dict[str, object]]  # the configuration file: section -> key -> value
    measured_s: float  # seconds per iteration, derived from the published figure (see `derived`)
    derived: str
    assumed: str  # what the publication leaves unknown and the row assumes
    network: tuple[tuple[str, float | str], ...] = ()  # (profile key, value) overrides: the row runs with a profile file of its own

    def profile(self) -> Machine:
        """The machine the row runs on: the built-in profile, with `network` replaced."""
        machine = load_machine(self.machine)
        return replace(machine, name=f"{machine.name}-{_slug(self.name)}", **dict(self.network)) if self.network else machine  # type: ignore[arg-type]  # profile keys, values of their types


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")


def gated_d_ff(h: int, t: int) -> int:
    """GPT's h -> 4h -> h GELU MLP stated as boostmpi's gated MLP of equal FLOPs and parameters
    (3 d_ff h = 8 h^2): d_ff = 8h/3, rounded to a multiple of 64 (and of tp)."""
    step = 64 * t // _gcd(64, t)
    return step * round(8 * h / 3 / step)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def cli_config(h: int, heads: int, layers: int, V: int, s: int, t: int, p: int, dp: int, B: int, mbs: int, *, d_ff: int | None = None,
               kv_heads: int | None = None, v: int = 1, recompute: str = "layer", sp: bool = False, overlap: bool = True, zero: int = 0,
               dropout: float = 0.0, val_every: int = 0, val_windows: int | None = None) -> dict[str, dict[str, object]]:
    """The TOML sections of a full-rank run (Megatron tensor parallelism: tp_mode = vanilla)."""
    model: dict[str, object] = {"arch": "full", "vocab_size": V, "d_model": h, "n_layers": layers, "n_heads": heads,
             "d_ff": d_ff or gated_d_ff(h, t), "seq_len": s}
    if dropout:
        model["attention_dropout"] = dropout
    if kv_heads:
        model["n_kv_heads"] = kv_heads
    parallel: dict[str, object] = {"tp": t, "pp": p, "dp": dp, "tp_mode": "vanilla", "overlap": overlap}
    if v > 1:
        parallel["virtual_stages"] = v
    if sp:
        parallel["sequence_parallel"] = True
    if zero:
        parallel["zero_stage"] = zero
    train: dict[str, object] = {"micro_batch_size": mbs, "global_batch_size": B, "dtype": "bfloat16", "device": "gpu",
             "recompute": recompute}
    if val_every:  # validation inside the timed steps (Megatron's --eval-interval, --eval-iters x batch)
        train.update(val_every=val_every, val_windows=val_windows)
    return {"model": model, "parallel": parallel, "train": train}


GPT_ASSUMED = ("GPT's 4h GELU MLP as a gated MLP of equal FLOPs (d_ff = 8h/3); LayerNorm, learned "
               "positions and biases as boostmpi's RMSNorm, RoPE and bias-free layers; attention "
               "scores materialised with a fused softmax (the profile's attention = fused_softmax); "
               "attention dropout 0.1, Megatron's default (model.attention_dropout); hidden dropout not priced")
# Megatron-LM's and Megatron-DeepSpeed's default --attention-dropout
GPT_DROPOUT = 0.1
# Runs of frameworks that predate fused (flash) attention materialise the T x T scores and run one fused
# softmax kernel over them: their rows run with a profile that says so (compute.attention =
# "fused_softmax"), the one thing a user changes for them.
MATERIALISED = (("attention", "fused_softmax"), ("elementwise", "fused"))
# the other frameworks' elementwise work: one fused kernel per step, not boostmpi's kernels
FUSED = (("elementwise", "fused"),)

# How a stack accumulates the weight gradients of the micro-batches of a step (the profile's
# compute.grad_accumulation_bytes; 0, boostmpi's and today's Megatron-LM's, is the weight-gradient GEMM
# adding into the fp32 buffer itself, `--gradient-accumulation-fusion`). Each is a pass over the
# rank's parameters after every micro-batch's backward, its bytes per parameter read off the code:
# * Megatron-LM's local DDP of the releases that ship examples/sc21 (megatron/model/distributed.py,
#   the backward hook `param.main_grad.add_(param.grad.data)`): read the 16-bit gradient and the fp32
#   main gradient, write the main gradient: 2 + 4 + 4;
# * the same with torch DDP (one micro-batch per step in those rows): the optimizer casts the 16-bit
#   gradients into fp32 main gradients once (`_copy_model_grads_to_main_grads`): 2 + 4;
# * DeepSpeed's bf16 ZeRO-1 (BF16_Optimizer, which its pipeline engine drives by hand:
#   deepspeed/runtime/pipe/engine.py, `clear_lp_grads()` before and `update_hp_grads()` after every
#   micro-batch's backward, "hardcoded for fp32 gradient accumulation"; deepspeed/runtime/
#   bf16_optimizer.py as of April 2022 and June 2023): `clear_lp_grads` sets the bf16 gradients to
#   None (no pass), and `update_hp_grads` runs `hp_grad.data.add_(lp.grad.data.to(hp_grad.dtype))`,
#   whose cast makes an fp32 copy before the add: read bf16, write fp32 (2 + 4), then read it and the
#   fp32 accumulator and write that (4 + 4 + 4);
# * DeepSpeed's fp16 ZeRO-1 of 2021 (no bf16 optimizer yet): autograd adds each micro-batch's fp16
#   gradient into .grad: 2 + 2 + 2.
MEGATRON_2021_LOCAL_DDP = (("grad_accumulation_bytes", 10.0),)
MEGATRON_2021_TORCH_DDP = (("grad_accumulation_bytes", 6.0),)
# DeepSpeed's pipeline engine (deepspeed/runtime/pipe/schedule.py, TrainSchedule; p2p.py: blocking
# send and recv) issues every send and every receive as its own blocking instruction in schedule
# order, four transfers on an interior stage's step where Megatron pairs them: network.pipeline_p2p.
DEEPSPEED_PIPELINE = (("pipeline_p2p", "blocking"),)
DEEPSPEED_BF16 = DEEPSPEED_PIPELINE + (("grad_accumulation_bytes", 18.0),)
DEEPSPEED_FP16 = DEEPSPEED_PIPELINE + (("grad_accumulation_bytes", 6.0),)
# PyTorch's FSDP2 of torchtitan's performance runs (torch/distributed/_composable/fsdp/ of PyTorch
# 2.3-2.4, the releases around torchtitan commit 157a12c56; its MixedPrecisionPolicy: bf16 parameters,
# fp32 reduction) copies on the compute stream around its collectives: every all-gather's output is
# copied out into the unsharded parameters (_fsdp_collectives.py, `foreach_all_gather_copy_out`:
# torch.split_with_sizes_copy, bf16 read and written: 2 + 2 bytes a parameter), and every
# reduce-scatter's input is the unsharded bf16 gradients concatenated into an fp32 buffer
# (`foreach_reduce`: torch._chunk_cat into the reduce_dtype buffer: 2 + 4). The cast and copy-in of
# the rank's own shard before a gather (10 bytes per shard element, 1/64 of the parameters) is left out.
FSDP2 = (("zero3_gather_copy_bytes", 4.0), ("zero3_reduce_copy_bytes", 6.0))


def _sc21_cli(params_b: str, heads: int, h: int, l: int, t: int, p: int, n: int, B: int, tflops: float, mbs: int, v: int, overlap: bool) -> CliRun:
    dp = n // (t * p)
    return CliRun(
        name=f"GPT {params_b}B (t={t}, p={p}, d={dp})", framework="Megatron-LM", gpu="A100",
        source="Narayanan et al., SC21, Table 1; micro-batch, v and DDP from examples/sc21/run_table_1.sh",
        machine="a100-80gb-dgx",
        network=MATERIALISED + (MEGATRON_2021_TORCH_DDP if overlap else MEGATRON_2021_LOCAL_DDP),
        config=cli_config(h, heads, l, 51200, 2048, t, p, dp, B, mbs, v=v, overlap=overlap, dropout=GPT_DROPOUT),
        measured_s=sc21_flops_per_iteration(B, 2048, l, h, 51200) / (n * tflops * 1e12),
        derived=f"Eq. 3 FLOPs / ({n} GPUs x {tflops} TFLOP/s)", assumed=GPT_ASSUMED)


# Korthikanti et al. 2022 (arXiv 2205.05198), Table 3 (layouts; data-parallel size 1, sequence 2048,
# vocabulary 51200) and Table 4 (seconds per iteration, full recompute and "present work" =
# sequence parallelism + selective recompute): name, heads, hidden, layers, t, p, GPUs = batch,
# full-recompute s, present-work s; chunks per rank as SC21's run_table_1.sh ran the same 530B and 1T
KORTHIKANTI = [
    ("22B", 64, 6144, 48, 8, 1, 4, 1.42, 1.10, 1),
    ("175B", 96, 12288, 96, 8, 8, 64, 18.13, 13.75, 1),
    ("530B", 128, 20480, 105, 8, 35, 280, 49.05, 37.83, 3),
    ("1T", 160, 25600, 128, 8, 64, 512, 94.42, 71.49, 1),
]


def _korthikanti_cli(name: str, heads: int, h: int, l: int, t: int, p: int, B: int, full_s: float, present_s: float, v: int) -> list[CliRun]:
    rows: list[CliRun] = []
    for label, seconds, recompute, sp in (("full recompute", full_s, "layer", False),
                                          ("SP + selective", present_s, "selective", True)):
        rows.append(CliRun(
            name=f"GPT {name} {label} (t={t}, p={p})", framework="Megatron-LM", gpu="A100",
            source="Korthikanti et al. 2022, Tables 3 and 4", machine="a100-80gb-dgx", network=MATERIALISED,
            config=cli_config(h, heads, l, 51200, 2048, t, p, 1, B, 1, v=v, recompute=recompute, sp=sp,
                              dropout=GPT_DROPOUT),
            measured_s=seconds, derived="Table 4, seconds per iteration as published",
            assumed=GPT_ASSUMED + f"; micro-batch 1; {v} model chunks per pipeline rank (SC21's script for "
                    "this model)" if v > 1 else GPT_ASSUMED + "; micro-batch 1; plain 1F1B"))
    return rows


# Smith et al. 2022 (MT-NLG 530B, arXiv 2201.11990), Sec. 2.4: batch 1920 sequences of 2048 on 280,
# 350 and 420 DGX A100 nodes (t = 8, p = 35 with DeepSpeed's pipeline, data parallel 8, 10, 12),
# 60.1, 50.2 and 44.4 s per iteration (126, 121, 113 TFLOP/s per GPU).
MT_NLG = [(8, 60.1), (10, 50.2), (12, 44.4)]
MT_NLG_STAGES = 35
# The micro-batch is not published; the three runs fix it (docs/SIM_VALIDATION.md): their times split, T = a * M + c
# with M = 1920 / (d * b), and only at b = 2 is c (12.7 s) 1F1B's fill and drain, (p - 1) * a, plus the
# data-parallel step (0.4 s): b = 1 leaves 5.6 s unexplained, at b = 4 the fill and drain exceed c.
MT_NLG_MICRO_BATCH = 2


def mt_nlg_fixed_cost(micro_batch: int) -> tuple[float, float]:
    """(a, c): the least-squares line T = a * M + c through the three MT-NLG runs, M = 1920 / (d * b)."""
    return statistics.linear_regression([1920 / (dp * micro_batch) for dp, _ in MT_NLG], [t for _, t in MT_NLG])


def _mtnlg_cli(dp: int, seconds: float) -> CliRun:
    b = MT_NLG_MICRO_BATCH
    return CliRun(
        name=f"MT-NLG 530B ({280 * dp} GPUs, d={dp})",
        framework="Megatron-DeepSpeed", gpu="A100",
        source="Smith et al. 2022 (MT-NLG), Sec. 2.4", machine="a100-80gb-dgx", network=MATERIALISED + DEEPSPEED_FP16,
        config=cli_config(20480, 128, 105, 51200, 2048, 8, MT_NLG_STAGES, dp, 1920, b, overlap=False, zero=1,
                          dropout=GPT_DROPOUT),
        measured_s=seconds, derived="seconds per iteration as published",
        assumed=GPT_ASSUMED + f"; micro-batch {b} (not published: the only one for which the three runs' "
                "step time that does not depend on the number of micro-batches is 1F1B's fill and drain plus "
                "the data-parallel step, docs/SIM_VALIDATION.md); DeepSpeed's pipeline (plain 1F1B, the data-parallel "
                "reduction after the flush: overlap = false) with ZeRO-1, its blocking sends and receives; fp16 "
                "(\"mixed precision\"; DeepSpeed had no bf16 optimizer in 2021) with autograd's gradient accumulation; "
                "GPT-2's vocabulary padded to 51200 (Megatron's multiple of 128 x t)")


# BLOOM 176B (BigScience; arXiv 2211.05100, Sec. 3.4): 384 A100 80GB on Jean Zay, t = 4, p = 12, d = 8,
# micro-batch 2, batch 2048 sequences of 2048, ZeRO-1, bf16, "about 150 TFLOP/s" per GPU
# (bigscience.notion.site, BigScience 176B Model); 8 GPUs and four 100 Gb/s Omni-Path links per node.
def _bloom_cli() -> CliRun:
    return CliRun(
        name="BLOOM 176B (t=4, p=12, d=8)", framework="Megatron-DeepSpeed", gpu="A100",
        source="BLOOM (arXiv 2211.05100) Sec. 3.4; BigScience 176B model page (150 TFLOP/s)",
        machine="a100-80gb-dgx",
        network=MATERIALISED + DEEPSPEED_BF16 + (("inter_node_bandwidth", 4 * 100e9 / 8 / 8),),
        config=cli_config(14336, 112, 70, 250880, 2048, 4, 12, 8, 2048, 2, overlap=False, zero=1),
        measured_s=sc21_flops_per_iteration(2048, 2048, 70, 14336, 250880) / (384 * 150e12),
        derived="Eq. 3 FLOPs / (384 GPUs x 150 TFLOP/s), the Megatron-DeepSpeed throughput formula",
        assumed=GPT_ASSUMED.replace("attention dropout 0.1, Megatron's default (model.attention_dropout)",
                                    "no attention dropout (bigscience/bloom's config.json: attention_dropout 0.0)")
        + "; ALiBi as RoPE; 70 layers over 12 stages as 6 and 5; the network as 4 x 100 "
                "Gb/s per 8 GPUs (inter_node_bandwidth 6.25e9); DeepSpeed's pipeline (overlap = false, blocking "
                "sends and receives) with its bf16 optimizer's fp32 gradient accumulation")


# Llama 3 405B (Llama Team 2024, arXiv 2407.21783, Table 4): 126 layers, 16384 wide, 128 heads, 8 kv
# heads, d_ff 53248, vocabulary 128256, sequence 8192, 16M tokens per batch; 8192 H100 at t = 8,
# p = 16, d = 64: 430 TFLOP/s per GPU; 16384 at d = 128: 400. (The third row, context parallel 16
# at sequence 131072, is left out: boostmpi has no context parallelism.)
LLAMA3 = [(64, 430), (128, 400)]


def _llama3_cli(dp: int, tflops: float) -> CliRun:
    gpus = 8 * 16 * dp
    config = cli_config(16384, 128, 126, 128256, 8192, 8, 16, dp, 2048, 1, d_ff=53248, kv_heads=8, v=2,
                        recompute="none", sp=True, zero=1)
    matmul = 126 * (16384 * (2 * 16384 + 2 * 1024) + 3 * 16384 * 53248) + 128256 * 16384
    flops = model_flops(matmul, 126, 16384, 8192, 2048 * 8192)
    return CliRun(
        name=f"Llama 3 405B ({gpus} GPUs, d={dp})", framework="Meta (Megatron-style 4D)", gpu="H100",
        source="Llama 3 (arXiv 2407.21783), Table 4", machine="h100-sxm", network=FUSED, config=config,
        measured_s=flops / (gpus * tflops * 1e12),
        derived=f"6N + 12LCT FLOPs of 16M tokens / ({gpus} GPUs x {tflops} TFLOP/s)",
        assumed=("interleaved 1F1B with 2 chunks per rank (the number is not published); sequence "
                 "parallelism; no activation recomputation; FSDP that keeps weights gathered as ZeRO-1; "
                 "126 layers split by the model's rule (the paper drops one layer from the first and last stages)"))


# Dash et al. 2023 ("Optimizing Distributed Training on Frontier for Large Language Models", arXiv
# 2312.12705, ISC 2024): Megatron-DeepSpeed on Frontier's MI250X, 38.38%, 36.14% and 31.96% of peak
# for the 22B, 175B and 1T GPT models: 73.5, 69.2 and 61.2 TFLOP/s per GCD (191.5 TFLOP/s peak each).
# Layouts: the authors' launch scripts for these three models on Frontier (github.com/sajal-vt/
# Megatron-DeepSpeed-ORNL, branch FA2: launch_gpt22b_bf16.slurm, launch_gpt175b_bf16.slurm,
# launch_gpt1T_bf16.slurm): name, heads, hidden, layers, sequence, t, p, nodes, batch, per-GCD
# share of peak. Every script: micro-batch 1, ZeRO-1, activation checkpointing, flash attention 2, and
# fp16: the DeepSpeed configuration each names (ds_config_16N_175B.json for 22B and 175B,
# ds_config_128N_1T_fp16.json for 1T) enables "fp16", which decides the engine's precision (under
# --deepspeed, Megatron's own --bf16 of the 1T script only sets the dtype the weights are built in).
# The last two numbers are each script's --eval-interval and --eval-iters (22B, 175B: 3 and 3; 1T: 1 and
# 1). Megatron's training loop (megatron/training.py of that branch) times each logged iteration with the
# `interval-time` timer, which keeps running through `evaluate_and_print_results`: an evaluation of
# eval-iters global batches lands in the next logged iteration's time.
FRONTIER = [
    ("22B", 48, 6144, 48, 2048, 1, 8, 2, 640, 0.3838, 3, 3),
    ("175B", 96, 12288, 96, 4096, 4, 16, 16, 640, 0.3614, 3, 3),
    ("1T", 200, 25600, 128, 2048, 4, 128, 128, 1024, 0.3196, 1, 1),
]


def _frontier_cli(name: str, heads: int, h: int, l: int, seq: int, t: int, p: int, nodes: int, B: int, share: float, eval_interval: int, eval_iters: int) -> CliRun:
    gcds = 8 * nodes
    dp = gcds // (t * p)
    V = 50688  # GPT-2's 50257 padded to a multiple of 128 x tp (Megatron's rule)
    tflops = share * 191.5
    return CliRun(
        name=f"GPT {name} on Frontier (t={t}, p={p}, d={dp}, {gcds} GCDs)", framework="Megatron-DeepSpeed",
        gpu="MI250X", source="Dash et al. 2023 (arXiv 2312.12705); layout: the authors' Frontier scripts",
        machine="mi250x-gcd", network=DEEPSPEED_FP16 + FUSED,
        config=cli_config(h, heads, l, V, seq, t, p, dp, B, 1, overlap=False, zero=1,
                          val_every=eval_interval, val_windows=eval_iters * B),
        measured_s=sc21_flops_per_iteration(B, seq, l, h, V) / (gcds * tflops * 1e12),
        derived=(f"Eq. 3 FLOPs / ({gcds} GCDs x {tflops:.1f} TFLOP/s per GCD = {share:.2%} of 191.5); "
                 "Megatron-DeepSpeed's throughput_calculator counts Eq. 3 under --checkpoint-activations"),
        assumed=("the paper's per-GCD figure holds for the layout of the authors' script for this model and "
                 f"averages the iterations it logs, which hold its evaluations ({eval_iters} global batch(es) every "
                 f"{eval_interval} iteration(s): train.val_every, train.val_windows) "
                 "(the paper reports weak scaling at 100% efficiency, so the per-GCD rate does not depend on "
                 "the data-parallel size); GPT-2 vocabulary; DeepSpeed's pipeline (overlap = false, blocking sends "
                 "and receives) with fp16 ZeRO-1 and autograd's gradient accumulation (the scripts' DeepSpeed configurations: "
                 "fp16, stage 1); "
                 + GPT_ASSUMED.replace("; attention scores materialised with a fused softmax "
                                       "(the profile's attention = fused_softmax)", "; flash attention")))


def _torchtitan_cli(name: str, C: int, layers: int, heads: int, kv_heads: int, F: int, V: int, T: int, local_batch: int, recompute: str, wps: float, mfu: str) -> CliRun:
    config = cli_config(C, heads, layers, V, T, 1, 1, 64, 64 * local_batch, local_batch, d_ff=F, kv_heads=kv_heads,
                        recompute=recompute, zero=3)
    return CliRun(
        name=f"{name} (FSDP2, 64 GPUs, batch {local_batch})", framework="torchtitan (FSDP2)", gpu="A100",
        source="torchtitan docs/performance.md (64 A100 80GB)", machine="a100-80gb-dgx", config=config,
        network=(("elementwise", "eager"),) + FSDP2,
        measured_s=local_batch * T / wps, derived=f"{local_batch} x {T} tokens / {wps} tokens/s per GPU (MFU {mfu})",
        assumed=("FSDP2 as zero_stage = 3 (one layer prefetched) with its copies around the collectives "
                 "(zero3_gather_copy_bytes 4, zero3_reduce_copy_bytes 6: every unit gathered twice, where torchtitan "
                 "keeps its last block and the root gathered after the forward); nodes of 8 A100 with one 200 Gb/s "
                 "adapter per GPU; the elementwise work as eager PyTorch runs it (the preset does not compile: the "
                 "profile's elementwise = eager)"))


# DeepSpeed ZeRO-3 on Azure (the DeepSpeed team's post "Azure empowers easy-to-use, high-performance, and
# hyperscale model training using DeepSpeed", 2022-07-26, docs/_posts/2022-07-26-deepspeed-azure.md of
# the DeepSpeed repository): Megatron-DeepSpeed's GPT, DeepSpeed 0.6.2, on NDm A100 v4 nodes (8 A100 80GB
# on NVSwitch, one 200 Gb/s HDR adapter per GPU: the a100-80gb-dgx profile), the peak TFLOP/s per GPU by
# Megatron's Eq. 3. The text states three runs with their micro-batch (the 530B's 171.37 TFLOP/s is not
# tied to one): name, heads, hidden, layers (the post's Table 2), sequence, GPUs, micro-batch, TFLOP/s.
# The layouts are the post's recipes (microsoft/Megatron-DeepSpeed, examples_deepspeed/azure/run-175b.sh
# and run-1t.sh): no tensor or pipeline parallelism, ZeRO stage 3 with overlap_comm, fp16, activation
# checkpointing, one micro-batch per step (global batch = GPUs x micro-batch), GPT-2's vocabulary; the 1T
# recipe (and so the 2T run) offloads the optimizer to the CPU (offload_optimizer "cpu", --cpu-optimizer).
AZURE_ZERO3 = [
    ("175B", 96, 12288, 96, 512, 256, 32, 204.49, False),
    ("1T", 160, 25600, 128, 1024, 1024, 8, 165.36, True),
    ("2T", 128, 32768, 160, 1024, 1024, 8, 157.0, True),
]


# DeepSpeed 0.6.2's ZeRO-3 copies on the compute path for these models, read off its code (zero/
# partition_parameters.py, stage3.py, partitioned_param_coordinator.py, comm/coalesced_collectives.py;
# docs/SIM_VALIDATION.md): every gather is of one weight (biases under stage3_param_persistence_threshold stay
# gathered, the larger 4h bias is fetched on its own), which lands in place without the torch.cat
# copy-out; every weight's gradient exceeds reduce_bucket_size and is reduce-scattered alone, leaving
# only the in-place pre-divide (div_: 2 + 2 bytes a parameter).
DEEPSPEED_ZERO3 = (("zero3_gather_copy_bytes", 0.0), ("zero3_reduce_copy_bytes", 4.0))


def _azure_cli(name: str, heads: int, h: int, l: int, seq: int, gpus: int, mbs: int, tflops: float, offload: bool) -> CliRun:
    V = 50304  # GPT-2's 50257 padded to a multiple of 128 (Megatron's rule at tp = 1)
    B = gpus * mbs
    offloaded = ("; the optimizer offloaded to the CPU (DeepSpeed's CPU Adam over each GPU's 1/N of the "
                 "parameters, and their transfers over PCIe) is not priced: by host-memory bandwidth about 1 s "
                 "a step; the model's memory says the run does not fit 80 GB, and the post keeps activations in "
                 "main memory too (not priced either)") if offload else ""
    return CliRun(
        name=f"GPT {name} ZeRO-3 ({gpus} GPUs, micro-batch {mbs}, seq {seq})", framework="DeepSpeed ZeRO-3",
        gpu="A100", source="DeepSpeed on Azure (deepspeed.ai, 2022-07-26); layout: its Megatron-DeepSpeed recipes",
        machine="a100-80gb-dgx", network=MATERIALISED + DEEPSPEED_ZERO3,
        config=cli_config(h, heads, l, V, seq, 1, 1, gpus, B, mbs, zero=3, dropout=GPT_DROPOUT),
        measured_s=sc21_flops_per_iteration(B, seq, l, h, V) / (gpus * tflops * 1e12),
        derived=(f"Eq. 3 FLOPs / ({gpus} GPUs x {tflops} TFLOP/s per GPU, the post's peak); "
                 "Megatron-DeepSpeed's throughput calculator counts Eq. 3 under --checkpoint-activations"),
        assumed=(GPT_ASSUMED + "; DeepSpeed 0.6.2's copies around its collectives as read off its code "
                 "(none on a gather, each one parameter; 4 bytes a parameter per reduce-scatter, the "
                 "pre-divide); the peak (fastest) iteration taken as the step" + offloaded))


def cli_runs() -> list[CliRun]:
    runs = [_sc21_cli(*row) for row in SC21_TABLE_1]
    runs += [r for row in KORTHIKANTI for r in _korthikanti_cli(*row)]
    runs += [_mtnlg_cli(*row) for row in MT_NLG]
    runs.append(_bloom_cli())
    runs += [_llama3_cli(*row) for row in LLAMA3]
    runs += [_torchtitan_cli(*row) for row in TORCHTITAN]
    runs += [_frontier_cli(*row) for row in FRONTIER]
    runs += [_azure_cli(*row) for row in AZURE_ZERO3]
    return runs


# ------------------------------------------------------------------ running the command line
def toml_text(sections: dict[str, dict[str, object]]) -> str:
    """A configuration file of scalar keys, as a user writes it."""
    from boostmpi.toml_io import toml_value

    lines: list[str] = []
    for section, keys in sections.items():
        lines += [f"[{section}]"] + [f"{k} = {toml_value(v)}" for k, v in keys.items()] + [""]
    return "\n".join(lines)


def cli_argv(run: CliRun, directory: str | Path) -> list[str]:
    """Write the row's configuration (and profile, if its network differs) into `directory` and
    return the `boostmpi sim` arguments that predict it."""
    from boostmpi.sim.machines import machine_to_toml

    directory = Path(directory)
    config = directory / f"{_slug(run.name)}.toml"
    config.write_text(toml_text(run.config))
    machine = run.machine
    if run.network:
        profile = directory / f"{_slug(run.name)}-machine.toml"
        profile.write_text(machine_to_toml(run.profile()))
        machine = str(profile)
    return ["sim", "--config", str(config), "--machine", machine, "--json"]


def run_cli(argv: list[str]) -> tuple[int, PredictionJson | None]:
    """`boostmpi sim ... --json` in this process: (exit status, the printed JSON object or None)."""
    from boostmpi.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(argv)
    text = out.getvalue().strip()
    return status, (json.loads(text) if status == 0 and text else None)


def cli_validation_table() -> list[tuple[CliRun, float, float, PredictionJson]]:
    """[(run, predicted seconds, relative error, prediction)] with every row run through the CLI."""
    rows: list[tuple[CliRun, float, float, PredictionJson]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in cli_runs():
            status, prediction = run_cli(cli_argv(run, tmp))
            if status != 0 or prediction is None:
                raise RuntimeError(f"boostmpi sim failed on {run.name} (exit {status})")
            # what a training log times per iteration: the step, and the validation passes spread over the steps
            predicted = prediction["time_with_validation_s"]
            rows.append((run, predicted, predicted / run.measured_s - 1, prediction))
    return rows


def cli_summary(rows: Sequence[tuple[CliRun, float, float, PredictionJson]]) -> CliSummary:
    return {**summary([r[:3] for r in rows]), "frameworks": sorted({r[0].framework for r in rows}),
            "gpus": sorted({r[0].gpu for r in rows})}


def format_cli_table(rows: Sequence[tuple[CliRun, float, float, PredictionJson]]) -> str:
    lines = ["| run | framework | source | measured s/iter | predicted s/iter | error | "
             "compute / tp / bubble+p2p / dp / validation (s) |", "|---|---|---|---|---|---|---|"]
    for run, predicted, error, p in rows:
        b = p["breakdown"]
        compute = b["gemm"] + b["elementwise"] + b["attention"] + b["optimizer"]
        lines.append(f"| {run.name} | {run.framework} | {run.source} | {run.measured_s:.2f} | {predicted:.2f} | "
                     f"{error:+.1%} | {compute:.2f} / {b['tp_comm']:.2f} / {b['pp_bubble_and_p2p']:.2f} / "
                     f"{b['dp_comm']:.2f} / {p['time_with_validation_s'] - p['time_s']:.2f} |")
    s = cli_summary(rows)
    lines.append(f"\nworst {s['worst']:.1%}, median {s['median']:.1%}, best {s['best']:.1%} over {len(rows)} runs "
                 f"({len(s['frameworks'])} frameworks: {', '.join(s['frameworks'])}; GPUs: {', '.join(s['gpus'])})")
    return "\n".join(lines)


if __name__ == "__main__":
    if "--cli" not in sys.argv[1:]:
        print(format_table(validation_table()) + "\n")
    print(format_cli_table(cli_validation_table()))
