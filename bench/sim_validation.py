"""The performance model against the CPU engine: predicted vs measured step time.

1. `boostmpi calibrate` measures this machine and writes a profile (one device = one MPI rank on
   one core, single-threaded NumPy).
2. For each layout below, the engine runs training steps (forward_backward of `grad_accum`
   micro-batches, then the AdamW update) under `timeout mpiexec -n tp*pp*dp`, one BLAS thread per
   rank; a step's time is the slowest rank's, and the median over the timed steps after warm-up
   is reported.
   Each layout runs twice: with glibc's default allocator, and with large freed blocks kept in the
   heap (MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_), because the default one returns the
   engine's large temporaries to the kernel every step and page-faults them back, a kernel-time
   cost of the NumPy engine (up to a third of a tp=2 vanilla step) that the model does not count.
3. `boostmpi.sim.model.predict(cfg, profile)` predicts the same step. Target: within 25% for each.

    PYTHONPATH=. .venv/bin/python bench/sim_validation.py [--append bench/log/sim_validation.md]

With `--published` it instead runs `boostmpi sim` on every published training run of
`boostmpi.sim.published.cli_runs()` (a configuration file and a profile per row, docs/SIM_VALIDATION.md,
"Through the command line") and reports the errors against the published times; targets: worst
within 15%, median within 8%.

    PYTHONPATH=. .venv/bin/python bench/sim_validation.py --published [--append bench/log/sim_validation.md]
"""

import common  # noqa: F401 - first: one BLAS thread before numpy loads

import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from common import REPO  # noqa: E402

from boostmpi.parallel.launch import find_mpiexec  # noqa: E402

MODEL = {"arch": "cola", "vocab_size": 1024, "d_model": 512, "n_layers": 4, "n_heads": 8,
         "rank": 128, "d_ff": 1376, "seq_len": 256}
TRAIN = {"micro_batch_size": 4, "grad_accum": 1, "dtype": "float32"}
# name -> [parallel] section; the three required layouts first
LAYOUTS = {
    "tp1": {},
    "tp2-btp": {"tp": 2, "tp_mode": "btp"},
    "tp2-vanilla": {"tp": 2, "tp_mode": "vanilla"},
    "tp2-btp-ungrouped-sync": {"tp": 2, "tp_mode": "btp", "grouped": False, "norm": "sync"},
    "tp2-vanilla-ungrouped": {"tp": 2, "tp_mode": "vanilla", "grouped": False},
    "dp2": {"dp": 2},
    "pp2": {"pp": 2},
}
TARGET = 0.25
# glibc malloc: large blocks from the heap instead of fresh mmaps, and freed memory not trimmed
ALLOCATORS = {"default": {},
              "heap kept": {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 31)}}
LR = 1e-3
RUN_TIMEOUT_S = 300


def config(layout):
    from boostmpi.config import config_from_dict

    par = LAYOUTS[layout]
    # with pipeline stages, two micro-batches so that the 1F1B schedule has a steady state
    train = dict(TRAIN, grad_accum=2 if par.get("pp", 1) > 1 else TRAIN["grad_accum"])
    world = par.get("tp", 1) * par.get("pp", 1) * par.get("dp", 1)
    return config_from_dict({"model": MODEL, "parallel": par, "train": train}, world_size=world)


def world_size(cfg):
    return cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp


# ---------------------------------------------------------------- the measurement (one mpiexec launch)
def measure(layout, warmup, repeats, out_path):
    """Time training steps of `layout` on every rank; world rank 0 writes the JSON result."""
    from mpi4py import MPI

    from boostmpi.parallel.engine import Engine
    from boostmpi.train.optim import AdamW

    comm = MPI.COMM_WORLD
    cfg = config(layout)
    engine = Engine(cfg, comm if comm.Get_size() > 1 else None)
    opt = AdamW(engine.params, engine.specs, cfg.train)
    rng = np.random.default_rng(comm.Get_rank() // (cfg.parallel.tp * cfg.parallel.pp))  # per dp replica
    shape = (cfg.train.micro_batch_size, cfg.model.seq_len)
    batches = [(rng.integers(0, MODEL["vocab_size"], shape), rng.integers(0, MODEL["vocab_size"], shape))
               for _ in range(cfg.train.grad_accum)]

    # this machine is shared: besides wall time, each rank's CPU time, which other processes do not
    # inflate (MPICH polls while it waits, so a rank's waiting counts as it would on an idle core)
    record = {"step": [], "step_cpu": [], "forward_backward_cpu": [], "optimizer_cpu": [], "system_cpu": [],
              "page_faults": []}
    for step in range(warmup + repeats):
        comm.Barrier()
        wall0, cpu0, os0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
        engine.forward_backward(batches)
        cpu1 = time.process_time()
        opt.step(engine.grads, LR)
        wall2, cpu2, os2 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
        slowest = np.array([wall2 - wall0, cpu2 - cpu0, cpu1 - cpu0, cpu2 - cpu1, os2.ru_stime - os0.ru_stime,
                            os2.ru_minflt - os0.ru_minflt], dtype=float)
        comm.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)
        if step >= warmup:
            for key, seconds in zip(record, slowest):
                record[key].append(float(seconds))
    if comm.Get_rank() == 0:
        Path(out_path).write_text(json.dumps(record))


def run_layout(layout, warmup, repeats, extra_env):
    """Launch `measure` for `layout` under `timeout mpiexec -n world`; returns its JSON result."""
    cfg = config(layout)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = ["timeout", str(RUN_TIMEOUT_S), find_mpiexec(), "-n", str(world_size(cfg)), sys.executable,
               str(Path(__file__).resolve()), "--measure", layout, "--warmup", str(warmup),
               "--repeats", str(repeats), "--out", str(out)]
        env = dict(os.environ, **extra_env,
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        done = subprocess.run(cmd, env=env)
        if done.returncode != 0 or not out.exists():
            raise SystemExit(f"measuring {layout} failed (exit {done.returncode}): {' '.join(cmd)}")
        return json.loads(out.read_text())


def calibrate(path):
    subprocess.run([sys.executable, "-m", "boostmpi", "calibrate", "--out", str(path)], check=True,
                   env=dict(os.environ, PYTHONPATH=str(REPO)))
    from boostmpi.sim.machines import load_machine

    return load_machine(str(path))


# ---------------------------------------------------------------- the comparison
def main():
    p = common.parser(__doc__.splitlines()[0], warmup=2, repeats=7)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, from: " + ", ".join(LAYOUTS))
    p.add_argument("--profile", help="use this profile instead of calibrating now")
    p.add_argument("--keep-profile", metavar="FILE", help="write the calibrated profile here")
    p.add_argument("--published", action="store_true",
                   help="compare with published training runs through `boostmpi sim` instead")
    p.add_argument("--measure", help=argparse_hidden())
    p.add_argument("--out", help=argparse_hidden())
    args = p.parse_args()
    if args.measure:
        measure(args.measure, args.warmup, args.repeats, args.out)
        return
    if args.published:
        published_runs(args.append)
        return

    from boostmpi.sim.model import predict

    machine_lines = common.machine_description(mpi=True)
    with tempfile.TemporaryDirectory() as tmp:
        if args.profile:
            from boostmpi.sim.machines import load_machine

            machine = load_machine(args.profile)
        else:
            machine = calibrate(Path(args.keep_profile or Path(tmp) / "cpu-local.toml"))

    rows, errors = [], {name: {} for name in ALLOCATORS}
    for layout in args.layouts.split(","):
        cfg = config(layout)
        prediction = predict(cfg, machine)
        row = [layout, world_size(cfg), cfg.train.grad_accum, f"{1e3 * prediction.time_s:.0f}"]
        for allocator, extra_env in ALLOCATORS.items():
            measured = run_layout(layout, args.warmup, args.repeats, extra_env)
            errors[allocator][layout] = prediction.time_s / statistics.median(measured["step_cpu"]) - 1
            row += [milliseconds(measured["step_cpu"]), milliseconds(measured["step"]),
                    f"{1e3 * statistics.median(measured['system_cpu']):.0f}",
                    f"{statistics.median(measured['page_faults']) / 1e3:.1f}k",
                    f"{100 * errors[allocator][layout]:+.1f}%"]
        b = prediction.breakdown
        row.append(" / ".join(f"{1e3 * b[k]:.0f}" for k in ("gemm", "elementwise", "tp_comm", "pp_bubble_and_p2p",
                                                            "dp_comm", "optimizer")))
        rows.append(row)
        print(row, flush=True)

    m = machine
    profile_text = (f"Profile ({'given: ' + args.profile if args.profile else 'calibrated by `boostmpi calibrate` just before'}): "
                    f"GEMM peak float32 {m.peak('float32') / 1e9:.1f} GFLOP/s (k0 {m.gemm_k_overhead:g}, "
                    f"c {m.gemm_mn_overhead:g}), elementwise {m.memory_bandwidth / 1e9:.2f} GB/s, "
                    f"per-kernel {1e6 * m.kernel_launch_s:.1f} us, AdamW {m.optimizer_passes:.1f} passes, "
                    f"all-reduce {1e6 * m.intra_node_latency:.1f} us/step + {m.intra_node_bandwidth / 1e9:.2f} GB/s.")
    header = ["layout", "ranks", "micro-batches", "predicted ms"]
    for allocator in ALLOCATORS:
        header += [f"{allocator}: CPU ms (min-max)", "wall ms", "of which kernel (sys) ms", "page faults", "error"]
    table = common.markdown_table(header + ["predicted gemm / elementwise / tp / pp / dp / optimizer ms"], rows)
    verdicts = "; ".join(f"{allocator}: worst {100 * max(abs(e) for e in errs.values()):.1f}% "
                         f"{common.verdict(max(abs(e) for e in errs.values()) <= TARGET)}"
                         for allocator, errs in errors.items())
    summary = (f"Model: {MODEL}, micro-batch {TRAIN['micro_batch_size']}, float32. A step = forward_backward + "
               f"AdamW, timed as the slowest rank's CPU time (user + kernel): this machine is shared, and wall "
               f"time counts other people's processes (MPICH polls while a rank waits, so waiting is counted "
               f"as CPU time); median of {args.repeats} steps after {args.warmup} warm-up. Each layout is run "
               f"twice: with glibc's default allocator, which hands large freed blocks back to the kernel so "
               f"that the next step's temporaries are page-faulted and zeroed again (kernel time), and with "
               f"`{' '.join(f'{k}={v}' for k, v in ALLOCATORS['heap kept'].items())}`, which keeps them.\n\n"
               f"{profile_text}\n\n{table}\n\nTarget within {100 * TARGET:.0f}% for each layout: {verdicts}.")
    common.emit("sim_validation: performance model vs the CPU engine", machine_lines, [summary], args.append)


def published_runs(append):
    """Every published run through the command line; worst and median error against the targets."""
    from boostmpi.sim import published

    rows = published.cli_validation_table()
    s = published.cli_summary(rows)
    verdict = (f"worst {100 * s['worst']:.1f}% {common.verdict(s['worst'] <= 0.15)} (target 15%), median "
               f"{100 * s['median']:.1f}% {common.verdict(s['median'] <= 0.08)} (target 8%), over {len(rows)} runs of "
               f"{len(s['frameworks'])} frameworks on {', '.join(s['gpus'])}")
    text = ("Each row: its configuration file and machine profile written as a user writes them, then "
            "`boostmpi sim --config ROW.toml --machine PROFILE --json` (in-process); measured = the published "
            "time per iteration or what it follows from (docs/SIM_VALIDATION.md gives each row's source, layout and "
            f"assumptions). No measurement on this machine.\n\n{published.format_cli_table(rows)}\n\n{verdict}.")
    common.emit("sim_validation --published: performance model vs published runs, through the CLI",
                common.machine_description(mpi=False), [text], append)


def milliseconds(values):
    """'median (min-max)' in ms."""
    return f"{1e3 * statistics.median(values):.0f} ({1e3 * min(values):.0f}-{1e3 * max(values):.0f})"


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
