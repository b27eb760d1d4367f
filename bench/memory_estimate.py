"""The start-up memory check's estimate against the peak resident memory of real runs.

Each case is a fresh `boostmpi train` of 2 steps (configs/tiny.toml with overrides, the final
checkpoint included) on 1 or 2 ranks; every rank reports its peak resident set (ru_maxrss: what
the kernel's out-of-memory killer counts, no cgroup needed) and the estimate the check made
(`boostmpi.sim.model.memory_estimate`, which `boostmpi train` hands to the start-up check). Beside it, the step model's figure alone
(parameters, gradients, AdamW moments, saved activations: what the check compared before the
workspace terms of boostmpi/sim/memory.py).

Target: peak <= estimate in every case (the check admits no model the OOM killer would end), and
estimate <= 1.5x peak for the cases above 1 GiB (it refuses nothing that fits by far).
"""

import common  # noqa: F401  (one BLAS thread, before numpy)

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

from boostmpi.parallel.launch import find_mpiexec  # noqa: E402

REPO = common.REPO
PROBE = '''
import json, os, resource, sys
import boostmpi.sim.model as model
from boostmpi.cli import main
seen = {}
estimate = model.memory_estimate
def recorded(cfg):
    seen.update(estimate(cfg) or {})
    return estimate(cfg)
model.memory_estimate = recorded
status = main(sys.argv[2:])
with open(os.path.join(sys.argv[1], f"rank-{os.environ.get('PMI_RANK', '0')}.json"), "w") as f:
    json.dump({"status": status, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, **seen}, f)
'''
MED = ["model.d_model=512", "model.n_heads=8", "model.n_kv_heads=4", "model.rank=128", "model.d_ff=1536",
       "model.seq_len=256", "model.vocab_size=8000", "train.micro_batch_size=4"]
HEADS = ["model.n_heads=8", "model.n_kv_heads=4", "model.rank=128"]
CASES = [  # (name, ranks, overrides of configs/tiny.toml)
    ("tiny", 1, []),
    ("tiny, tp 2", 2, ["parallel.tp=2"]),
    ("d 512 cola", 1, MED),
    ("d 512 full", 1, MED + ["model.arch=full"]),
    ("d 512 svd", 1, MED + ["model.arch=svd"]),
    ("d 512 float64", 1, MED + ["train.dtype=float64"]),
    ("d 512 recompute layer", 1, MED + ["train.recompute=layer"]),
    ("d 512 recompute lowrank", 1, MED + ["train.recompute=lowrank"]),
    ("d 512 recompute selective", 1, MED + ["train.recompute=selective"]),
    ("d 512 async checkpoint", 1, MED + ["checkpoint.async=true"]),
    ("d 512 dp 2", 2, MED + ["parallel.dp=2"]),
    ("d 512 dp 2 zero 1", 2, MED + ["parallel.dp=2", "parallel.zero_stage=1"]),
    ("d 512 tp 2 btp", 2, MED + ["parallel.tp=2"]),
    ("d 512 tp 2 vanilla", 2, MED + ["parallel.tp=2", "parallel.tp_mode=vanilla"]),
    ("d 512 full tp 2 vanilla", 2, MED + ["parallel.tp=2", "parallel.tp_mode=vanilla", "model.arch=full"]),
    ("d 512 pp 2, 2 micro-batches", 2, MED + ["parallel.pp=2", "train.grad_accum=2"]),
    ("d_ff 8192", 1, HEADS + ["model.d_model=512", "model.d_ff=8192", "model.vocab_size=512",
                              "train.micro_batch_size=4", "model.seq_len=256"]),
    ("seq 2048", 1, HEADS + ["model.d_model=256", "model.d_ff=768", "model.seq_len=2048", "model.vocab_size=512"]),
    ("seq 2048 recompute layer", 1, HEADS + ["model.d_model=256", "model.d_ff=768", "model.seq_len=2048",
                                             "model.vocab_size=512", "train.recompute=layer"]),
    ("vocab 64000", 1, HEADS + ["model.d_model=256", "model.d_ff=768", "model.vocab_size=64000",
                                "train.micro_batch_size=4", "model.seq_len=256"]),
    ("vocab 64000 tp 2", 2, HEADS + ["model.d_model=256", "model.d_ff=768", "model.vocab_size=64000",
                                     "train.micro_batch_size=4", "model.seq_len=256", "parallel.tp=2"]),
    ("d 16384 rank 64", 1, ["model.d_model=16384", "model.n_heads=16", "model.n_kv_heads=4", "model.rank=64",
                            "model.d_ff=1024", "model.seq_len=32", "model.vocab_size=512"]),
    ("d 131072 (tiny otherwise)", 1, ["model.d_model=131072"]),
    ("d 262144 (tiny otherwise)", 1, ["model.d_model=262144"]),
]
STEP_MODEL = ("params", "grads", "optimizer", "activations")


def run(ranks, overrides, mpiexec):
    with tempfile.TemporaryDirectory() as tmp:
        args = ["train", "--config", str(REPO / "configs" / "tiny.toml"), "--set", f"train.run_dir={tmp}/run",
                "--set", "train.steps=2", "--set", "checkpoint.every=0"]
        for kv in overrides:
            args += ["--set", kv]
        command = [sys.executable, "-c", PROBE, tmp, *args]
        if ranks > 1:
            command = [mpiexec, "-n", str(ranks), *command]
        env = dict(os.environ, PYTHONPATH=str(REPO))
        p = subprocess.run(["timeout", "900", *command], env=env, capture_output=True, text=True)
        rows = [json.load(open(os.path.join(tmp, f))) for f in sorted(os.listdir(tmp)) if f.endswith(".json")]
    if p.returncode or len(rows) != ranks or any(r["status"] for r in rows):
        raise SystemExit(f"{overrides}: the run failed\n{p.stdout}{p.stderr}")
    return rows


def main():
    args = common.parser(__doc__.splitlines()[0], 0, 1).parse_args()
    mpiexec = find_mpiexec()
    rows, bounded, tight = [], True, True
    mib = 2.0 ** 20
    for name, ranks, overrides in CASES:
        ranks_rows = run(ranks, overrides, mpiexec)
        worst = max(ranks_rows, key=lambda r: r["peak"] / r["total"])
        peak, total = worst["peak"], worst["total"]
        before = sum(worst[k] for k in STEP_MODEL)
        bounded &= peak <= total
        if peak > 2**30:
            tight &= total <= 1.5 * peak
        rows.append([name, ranks, f"{before / mib:,.0f}", f"{total / mib:,.0f}", f"{worst['workspace'] / mib:,.0f}",
                     f"{peak / mib:,.0f}", f"{before / peak:.2f}", f"{total / peak:.2f}",
                     "yes" if peak <= total else "**no**"])
        print(" | ".join(str(c) for c in rows[-1]), flush=True)
    table = common.markdown_table(
        ["case", "ranks", "step model (MiB, the old estimate)", "estimate (MiB)", "of which workspace",
         "peak RSS (MiB)", "old / peak", "estimate / peak", "bounded"], rows)
    text = (f"2-step `boostmpi train` runs of configs/tiny.toml with the overrides in bench/memory_estimate.py, "
            f"each in a fresh process; peak = ru_maxrss of the rank whose peak is nearest its estimate\n\n{table}\n\n"
            f"Target: peak <= estimate in every case: {common.verdict(bounded)}; estimate <= 1.5x peak above 1 GiB: "
            f"{common.verdict(tight)}")
    common.emit("memory_estimate: the start-up check's estimate against the peak of real runs",
                common.machine_description(mpi=True), [text], append_to=args.append)


if __name__ == "__main__":
    main()
