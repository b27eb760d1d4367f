"""The README's multi-rank command as pasted, with no thread variables set, against the same command
with OPENBLAS_NUM_THREADS=OMP_NUM_THREADS=1 (what an expert sets by hand).

`mpiexec -n 4 boostmpi train` at tp 2 x dp 2 on this machine's cores. `boostmpi` gives each rank the
cores divided by the ranks on the node before NumPy loads (boostmpi/parallel/startup.py,
`set_host_threads`), so the two should run alike. A third case, "unset, no per-rank setting",
runs the same command line with that setting disabled (what the command did before it existed):
every rank's OpenBLAS then starts one thread per core.

Each round runs every case once, the order rotating round by round; the wall time of the whole
command (start-up included) and the median step time from its metrics.jsonl are recorded.
Target: unset / set <= 1.2 (median over the rounds of the per-round ratio, with quartiles).
"""

import common  # noqa: F401  (sets this process's own BLAS threads before numpy)

import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from boostmpi.parallel.launch import find_mpiexec  # noqa: E402
from boostmpi.parallel.startup import THREAD_VARIABLES  # noqa: E402

REPO = common.REPO
BOOSTMPI = os.path.join(os.path.dirname(sys.executable), "boostmpi")  # the console script
# the console script's own code with the per-rank setting switched off: the command before the fix
WITHOUT_SETTING = ("import sys, boostmpi.cli as c; c.set_host_threads = lambda: None; "
                   "sys.exit(c.main(sys.argv[1:]))")
MODEL = ["model.d_model=256", "model.n_heads=4", "model.n_kv_heads=2", "model.rank=64", "model.d_ff=1024",
         "model.seq_len=64", "model.n_layers=2", "train.micro_batch_size=4"]


def run(case, run_dir, steps, ranks, mpiexec):
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    if case == "set":
        env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    program = [sys.executable, "-c", WITHOUT_SETTING] if case == "unset, no per-rank setting" else [BOOSTMPI]
    sets = ["parallel.tp=2", f"parallel.dp={ranks // 2}", f"train.steps={steps}", "checkpoint.every=0",
            "train.val_every=0", f"train.run_dir={run_dir}", *MODEL]
    argv = ["timeout", "900", mpiexec, "-n", str(ranks), *program, "train", "--config", "configs/tiny.toml"]
    for s in sets:
        argv += ["--set", s]
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    p = subprocess.run(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{case}: exit status {p.returncode}\n{p.stdout[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]
    return wall, statistics.median(r["step_time_s"] for r in rows[1:])


def quartiles(values):
    q = statistics.quantiles(values, n=4, method="inclusive")
    return statistics.median(values), q[0], q[2]


def main():
    p = common.parser(__doc__.splitlines()[0], warmup=1, repeats=10)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--old-rounds", type=int, default=3,
                   help="timed rounds that also run the case without the per-rank setting (slow: default %(default)s)")
    args = p.parse_args()
    mpiexec = find_mpiexec()
    old = "unset, no per-rank setting"
    cases = ["unset", "set"] + ([old] if args.old_rounds > 0 else [])
    machine = common.machine_description(mpi=True)
    wall = {c: [] for c in cases}
    step = {c: [] for c in cases}
    with tempfile.TemporaryDirectory() as tmp:
        for round_no in range(args.warmup + args.repeats):
            shift = round_no % len(cases)
            for case in cases[shift:] + cases[:shift]:
                if case == old and round_no >= args.warmup + args.old_rounds:
                    continue
                w, s = run(case, os.path.join(tmp, "run"), args.steps, args.ranks, mpiexec)
                if round_no >= args.warmup:
                    wall[case].append(w)
                    step[case].append(s)
                print(f"round {round_no} {case}: {w:.1f} s, step {1e3 * s:.0f} ms", file=sys.stderr, flush=True)
    rows = []
    for case in cases:
        wm, wq1, wq3 = quartiles(wall[case])
        sm, sq1, sq3 = quartiles(step[case])
        rows.append([case, f"{wm:.1f} ({wq1:.1f}-{wq3:.1f})", f"{1e3 * sm:.0f} ({1e3 * sq1:.0f}-{1e3 * sq3:.0f})"])
    table = common.markdown_table(["thread variables", "command wall s, median (quartiles)",
                                   "step ms, median (quartiles)"], rows)
    ratios = []
    for name, series in (("command wall", wall), ("step", step)):
        for other in cases[2:] + ["unset"]:
            per_round = [a / b for a, b in zip(series[other], series["set"])]
            m, q1, q3 = quartiles(per_round)
            target = " (target <= 1.2)" if other == "unset" else ""
            met = f": {common.verdict(m <= 1.2)}" if other == "unset" else ""
            ratios.append(f"- {name}, {other} / set, per round: median **{m:.2f}** (quartiles {q1:.2f}-{q3:.2f})"
                          f"{target}{met}")
    lines = [f"`mpiexec -n {args.ranks} boostmpi train`, tp 2 x dp {args.ranks // 2}, cola d=256 L=2 r=64 d_ff=1024 "
             f"T=64 micro-batch 4, {args.steps} steps, no checkpoint; {args.repeats} interleaved rounds after "
             f"{args.warmup} warm-up (the case without the setting in the first {args.old_rounds})", table, "\n".join(ratios)]
    common.emit("threads: the multi-rank command without thread variables", machine, lines, args.append)


if __name__ == "__main__":
    main()
