"""ZeRO-1 under GPU mixed precision through the train command, across ranks (tests/integration/gpu/test_gpu.py).

Run as `mpiexec -n 4 python tests/support/gpu_zero_resume.py FOLDER`: `boostmpi train` at tp=2 x dp=2 with
zero_stage = 1 and train.dtype = bfloat16 (device gpu, NCCL stand-in) for 4 steps, checkpointing at
step 2; the step-2 checkpoint (float32 master slices and moment slices, one file per rank) resumed
under zero_stage = 0 at the same layout and under tp=2 x pp=2 (no dp). Rank 0 prints one line per
failed check, or `ok`.
"""

import json
import sys

import numpy as np

from tests.support.gpu_steps import run_or_abort

STEPS, CUT = 4, 2
COMMON = ("train.device=gpu", "train.dtype=bfloat16", f"train.steps={STEPS}", f"checkpoint.every={CUT}",
          "train.val_every=0", "train.warmup_steps=1", "train.micro_batch_size=2", "model.vocab_size=256")


def layout(tp, pp, dp, zero, accum):
    return (f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={dp}", f"parallel.zero_stage={zero}",
            f"train.grad_accum={accum}")


def rows(run_dir):
    with open(run_dir / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if "loss" in r and r.get("step")]


def main(folder):
    from pathlib import Path

    from mpi4py import MPI

    from boostmpi.cli import main as cli
    from tests.support.train_helpers import train_argv, write_text_shards

    comm = MPI.COMM_WORLD
    folder = Path(folder)
    shards = comm.bcast(write_text_shards(folder / "text", max_bytes=60_000) if comm.Get_rank() == 0 else None, root=0)
    zero1 = folder / "zero1"
    runs = {"zero1": (zero1, layout(2, 1, 2, 1, 1), None),
            "resumed-zero0": (folder / "zero0", layout(2, 1, 2, 0, 1), zero1 / "checkpoints" / f"step_{CUT:08d}"),
            "resumed-tp2-pp2": (folder / "pp2", layout(2, 2, 1, 0, 2), zero1 / "checkpoints" / f"step_{CUT:08d}")}
    for name, (run_dir, settings, resume) in runs.items():
        status = cli(train_argv(run_dir, *shards, *COMMON, *settings, resume=resume))
        if not comm.allreduce(status == 0, op=MPI.LAND):
            raise RuntimeError(f"{name}: boostmpi train exited {status}")
    if comm.Get_rank() != 0:
        return
    failures = []
    ref = rows(zero1)
    # memory: float32 moments and master weights of the slice, the whole bf16 copy (largest rank)
    mem = ref[0]["memory"]
    owned = mem["optimizer"] // 8  # two float32 moments of the slice
    n = mem["grads"] // 4 - owned  # the whole local gradient, and the reduce-scattered slice
    whole = rows(runs["resumed-zero0"][0])[0]["memory"]["params"]
    if not (owned == -(-n // 2) and mem["params"] == 4 * owned + 2 * n and whole == 6 * n):
        failures.append(f"memory: params {mem['params']} bytes (zero_stage 0: {whole}) for {n} local parameters "
                        f"and a slice of {owned}: float32 master weights are not the slice only")
    same = rows(runs["resumed-zero0"][0])
    if [r["loss"] for r in same] != [r["loss"] for r in ref[CUT:]]:
        failures.append(f"resumed under zero_stage 0: losses {[r['loss'] for r in same]} != {[r['loss'] for r in ref]}")
    other = rows(runs["resumed-tp2-pp2"][0])
    have, want = [r["loss"] for r in other], [r["loss"] for r in ref[CUT:]]
    if len(have) != len(want) or not np.allclose(have, want, rtol=2e-3, atol=0):
        failures.append(f"resumed under tp2-pp2: losses {have} != {want} (bf16 tolerance 2e-3)")
    print("\n".join(failures) if failures else "ok")


if __name__ == "__main__":
    run_or_abort(main, sys.argv[1])
