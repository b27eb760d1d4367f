"""The performance model against the CPU engine (issue 7): predicted vs measured step time.

1. `boostmpi calibrate` measures this machine and writes a profile (one device = one MPI rank on
   one core, single-threaded NumPy).
2. For each layout below, the engine runs training steps (forward_backward of `grad_accum`
   micro-batches, then the AdamW update) under `timeout mpiexec -n tp*pp*dp`, one BLAS thread per
   rank; a step's time is the slowest rank's, and the median over the timed steps after warm-up
   is reported.
3. `boostmpi.sim.model.predict(cfg, profile)` predicts the same step. Target: within 25% for each.

    PYTHONPATH=. .venv/bin/python bench/sim_validation.py [--append bench/RESULTS.md]
"""

import common  # noqa: F401 - first: one BLAS thread before numpy loads

import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from common import REPO  # noqa: E402

MODEL = {"arch": "cola", "vocab_size": 1024, "d_model": 512, "n_layers": 4, "n_heads": 8,
         "rank": 128, "d_ff": 1376, "seq_len": 256}
TRAIN = {"micro_batch_size": 4, "grad_accum": 1, "dtype": "float32"}
# name -> [parallel] section; the three issue 7 requires first
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
LR = 1e-3
RUN_TIMEOUT_S = 300


def config(layout, grad_accum=None):
    from boostmpi.config import config_from_dict

    par = LAYOUTS[layout]
    train = dict(TRAIN, grad_accum=grad_accum or (2 if par.get("pp", 1) > 1 else TRAIN["grad_accum"]))
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
    record = {"step": [], "step_cpu": [], "forward_backward_cpu": [], "optimizer_cpu": []}
    for step in range(warmup + repeats):
        comm.Barrier()
        wall0, cpu0 = time.perf_counter(), time.process_time()
        engine.forward_backward(batches)
        cpu1 = time.process_time()
        opt.step(engine.grads, LR)
        wall2, cpu2 = time.perf_counter(), time.process_time()
        slowest = np.array([wall2 - wall0, cpu2 - cpu0, cpu1 - cpu0, cpu2 - cpu1])
        comm.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)
        if step >= warmup:
            for key, seconds in zip(record, slowest):
                record[key].append(float(seconds))
    if comm.Get_rank() == 0:
        Path(out_path).write_text(json.dumps(record))


def run_layout(layout, warmup, repeats):
    """Launch `measure` for `layout` under `timeout mpiexec -n world`; returns its JSON result."""
    cfg = config(layout)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        mpiexec = Path(sys.executable).parent / "mpiexec"
        cmd = ["timeout", str(RUN_TIMEOUT_S), str(mpiexec), "-n", str(world_size(cfg)), sys.executable,
               str(Path(__file__).resolve()), "--measure", layout, "--warmup", str(warmup),
               "--repeats", str(repeats), "--out", str(out)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
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
    p.add_argument("--measure", help=argparse_hidden())
    p.add_argument("--out", help=argparse_hidden())
    args = p.parse_args()
    if args.measure:
        measure(args.measure, args.warmup, args.repeats, args.out)
        return

    from boostmpi.sim.model import predict

    machine_lines = common.machine_description(mpi=True)
    with tempfile.TemporaryDirectory() as tmp:
        if args.profile:
            from boostmpi.sim.machines import load_machine

            machine = load_machine(args.profile)
        else:
            machine = calibrate(Path(args.keep_profile or Path(tmp) / "cpu-local.toml"))

    rows, errors, least_disturbed = [], {}, {}
    for layout in args.layouts.split(","):
        cfg = config(layout)
        measured = run_layout(layout, args.warmup, args.repeats)
        prediction = predict(cfg, machine)
        step = statistics.median(measured["step_cpu"])
        errors[layout] = prediction.time_s / step - 1
        least_disturbed[layout] = prediction.time_s / min(measured["step_cpu"]) - 1
        b = prediction.breakdown
        rows.append([layout, world_size(cfg), cfg.train.grad_accum, milliseconds(measured["step_cpu"]),
                     f"{1e3 * statistics.median(measured['optimizer_cpu']):.0f}", milliseconds(measured["step"]),
                     f"{1e3 * prediction.time_s:.0f}", f"{100 * errors[layout]:+.1f}%",
                     f"{100 * least_disturbed[layout]:+.1f}%",
                     " / ".join(f"{1e3 * b[k]:.0f}" for k in ("gemm", "elementwise", "tp_comm",
                                                              "pp_bubble_and_p2p", "dp_comm", "optimizer"))])
        print(rows[-1], flush=True)

    m = machine
    profile_text = (f"Profile ({'given: ' + args.profile if args.profile else 'calibrated by `boostmpi calibrate` just before'}): "
                    f"GEMM peak float32 {m.peak('float32') / 1e9:.1f} GFLOP/s (k0 {m.gemm_k_overhead:g}, "
                    f"c {m.gemm_mn_overhead:g}), elementwise {m.memory_bandwidth / 1e9:.2f} GB/s, "
                    f"per-kernel {1e6 * m.kernel_launch_s:.1f} us, AdamW {m.optimizer_passes:.1f} passes, "
                    f"all-reduce {1e6 * m.intra_node_latency:.1f} us/step + {m.intra_node_bandwidth / 1e9:.2f} GB/s.")
    table = common.markdown_table(
        ["layout", "ranks", "micro-batches", "measured CPU ms (min-max)", "of which AdamW", "wall ms (min-max)",
         "predicted ms", "error vs median", "error vs min",
         "predicted gemm / elementwise / tp / pp / dp / optimizer ms"], rows)
    worst = max(abs(e) for e in errors.values())
    worst_min = max(abs(e) for e in least_disturbed.values())
    summary = (f"Model: {MODEL}, micro-batch {TRAIN['micro_batch_size']}, float32. A step = forward_backward + "
               f"AdamW; the slowest rank's CPU time (this machine is shared: wall time includes other people's processes; MPICH polls while waiting, so waiting is counted); median of {args.repeats} steps after {args.warmup} warm-up.\n\n"
               f"{profile_text}\n\n{table}\n\nWorst error {100 * worst:.1f}% (target within "
               f"{100 * TARGET:.0f}% for each: {common.verdict(worst <= TARGET)}); against each layout's "
               f"least disturbed step (the minimum CPU time) {100 * worst_min:.1f}% "
               f"({common.verdict(worst_min <= TARGET)}).")
    common.emit("sim_validation: performance model vs the CPU engine", machine_lines, [summary], args.append)


def milliseconds(values):
    """'median (min-max)' in ms."""
    return f"{1e3 * statistics.median(values):.0f} ({1e3 * min(values):.0f}-{1e3 * max(values):.0f})"


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
