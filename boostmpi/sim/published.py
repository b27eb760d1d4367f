"""Published training runs the performance model is validated on, and the comparison itself.

None of these runs shaped the model: the machine profiles come from datasheets and site
documentation plus the few global efficiency constants of docs/SIM.md, fixed before this
comparison, and no number here is adjusted per row. docs/SIM.md ("Validation against published
runs") gives the source of every row, the configuration as published and what had to be assumed.

    python -m boostmpi.sim.published      # prints the error table
"""

import statistics
from dataclasses import dataclass

from boostmpi.sim.machines import load_machine
from boostmpi.sim.model import Workload, model_flops, predict_workload
from boostmpi.sim.plans import Shape

# Megatron's fused scale-mask-softmax (read the scores, write the probabilities; backward reads
# the probabilities and their gradient, writes the scores' gradient) followed by attention dropout
# (read, write, a one-byte mask: half a 16-bit pass each way): passes over the B*h*s*s scores.
FUSED_SOFTMAX_DROPOUT_PASSES = (2 + 2.5, 3 + 2.5)


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
def sc21_flops_per_iteration(B, s, l, h, V):
    """Narayanan et al. (SC21) Eq. 3, the FLOPs their Table 1 throughput is computed with
    (activation recomputation included): 96 B s l h^2 (1 + s/6h + V/16lh)."""
    return 96.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def gpt_params_per_stage(h, l, V, s, t, p):
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


def gpt_run(params_b, heads, h, l, t, p, n, B, tflops, mbs, v, overlap):
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
def llama_run(name, C, layers, heads, kv_heads, F, V, T, local_batch, recompute, wps, mfu):
    """One row of torchtitan's docs/performance.md: FSDP2 over 64 A100-80GB, bf16, local batch."""
    gpus = 64
    K = C // heads * kv_heads
    matmul_params = layers * (C * (2 * C + 2 * K) + 3 * C * F) + V * C
    params = matmul_params + V * C + (2 * layers + 1) * C  # + embedding and RMSNorm weights
    shape = Shape(B=local_batch, T=T, C=C, F=F, H=heads, Hkv=kv_heads, Dh=C // heads, V=V, Ra=0, Rm=0,
                  p=1, cola=False, gate_act=True, grouped=False, sync_norm=False, attention="flash",
                  eager=True)
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


def published_runs():
    return [gpt_run(*row) for row in SC21_TABLE_1] + [llama_run(*row) for row in TORCHTITAN]


def validation_table():
    """[(run, predicted seconds, relative error)] for every published run."""
    rows = []
    for run in published_runs():
        predicted = predict_workload(run.workload, load_machine(run.machine)).time_s
        rows.append((run, predicted, predicted / run.measured_s - 1))
    return rows


def summary(rows):
    errors = [abs(e) for _, _, e in rows]
    return {"worst": max(errors), "median": statistics.median(errors), "best": min(errors)}


def format_table(rows):
    lines = ["| run | source | measured s/iter | predicted s/iter | error |", "|---|---|---|---|---|"]
    for run, predicted, error in rows:
        lines.append(f"| {run.name} | {run.source} | {run.measured_s:.2f} | {predicted:.2f} | {error:+.1%} |")
    s = summary(rows)
    lines.append(f"\nworst {s['worst']:.1%}, median {s['median']:.1%}, best {s['best']:.1%} "
                 f"over {len(rows)} runs")
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_table(validation_table()))
