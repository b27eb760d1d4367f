"""Scale-out state: per-rank memory, parallel checkpoint writes against a plain write, asynchronous
save, resume, engine build and the first step, at 1, 2 and 4 ranks; then the performance model's
checkpoint time and per-rank memory for the paper's 7B (tp = 4) and a 30B layout.

    PYTHONPATH=. .venv/bin/python bench/scale.py [--repeats 10] [--layouts "1,1,2,1 2,1,2,1"] [--append bench/RESULTS.md]

Each layout runs as its own `mpiexec` job (this script relaunched as a worker). Per layout:
- build: Engine + AdamW construction, the slowest rank;
- step 1 and the median of the next steps (forward, backward, optimizer step), the slowest rank;
- checkpoint write (checkpoint.save, every rank its own file, then publish), by phase, against a plain
  write of the same bytes by the same ranks in the same job (each rank `tofile` + fsync of as many
  bytes as its rank file), interleaved round by round; bandwidth = the checkpoint's bytes / time;
- asynchronous save: the step that runs while every rank's writer thread writes a snapshot,
  against a step without a save, interleaved; the save is then published;
- resume: checkpoint.load of this layout's checkpoint into the engine, the slowest rank;
- peak resident memory (VmHWM) of every rank at the end.
"""

import common  # noqa: F401  (one BLAS thread; before numpy)

import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from common import emit, launch_under_mpiexec, machine_description, markdown_table, median, mpi_worker, parser  # noqa: E402

MODEL = dict(arch="cola", vocab_size=32000, d_model=256, n_layers=4, n_heads=4, rank=64, seq_len=128)
BATCH = 2
# (tp, pp, dp, zero_stage)
LAYOUTS = [(1, 1, 1, 0), (2, 1, 1, 0), (1, 1, 2, 1), (2, 1, 2, 1), (1, 1, 4, 1)]
STEADY_STEPS = 3
# the phases of a checkpoint write (checkpoint.PendingSave.phases), each the slowest rank's seconds
PHASES = ("hdf5 write", "fsync", "sha256", "wait", "virtual files", "publish")


def vm_hwm():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def worker(args):
    from mpi4py import MPI

    from boostmpi.config import config_from_dict
    from boostmpi.parallel.engine import Engine
    from boostmpi.train import checkpoint as ckpt
    from boostmpi.train.optim import AdamW

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    tp, pp, dp, zero = (int(x) for x in args.layout.split(","))
    base = world.bcast(tempfile.mkdtemp(prefix="scale-", dir=args.dir) if rank == 0 else None)
    cfg = config_from_dict({"model": MODEL, "parallel": {"tp": tp, "pp": pp, "dp": dp, "zero_stage": zero},
                            "train": {"dtype": "float32", "micro_batch_size": BATCH, "run_dir": os.path.join(base, "run")}},
                           world_size=world.Get_size())

    def slowest(seconds):
        return world.allreduce(seconds, op=MPI.MAX)

    world.Barrier()
    t0 = time.perf_counter()
    engine = Engine(cfg, world)
    optimizer = AdamW(engine.params, engine.specs, cfg.train, shard=engine.shard)
    build = slowest(time.perf_counter() - t0)
    rng = np.random.default_rng(engine.grid.coords.dp)

    def step():
        tokens = rng.integers(0, MODEL["vocab_size"], (BATCH, MODEL["seq_len"] + 1))
        engine.forward_backward([(tokens[:, :-1], tokens[:, 1:])])
        engine.optimizer_step(optimizer, 1e-4, 1.0)

    def timed(fn):
        world.Barrier()
        t = time.perf_counter()
        fn()
        return slowest(time.perf_counter() - t)

    first = timed(step)
    steady = [timed(step) for _ in range(STEADY_STEPS)]

    state = {"data": {}, "layout": {}} if rank == 0 else None
    step_no = [0]

    phases = []  # per checkpoint round: {phase: seconds of the slowest rank}

    def save():
        step_no[0] += 1
        pending = ckpt.PendingSave(cfg.train.run_dir, step_no[0], cfg, [ckpt.rank_state(engine, optimizer)],
                                   optimizer.t, state, comm=world, keep=1)
        pending.write()
        pending.finish()
        mine = pending.phases
        phases.append({k: world.allreduce(mine.get(k, 0.0), op=MPI.MAX) for k in PHASES})

    my_bytes = ckpt.rank_state(engine, optimizer).nbytes
    total_bytes = world.allreduce(my_bytes)
    plain_dir = os.path.join(base, "plain")
    os.makedirs(plain_dir, exist_ok=True)
    payload = np.ones(my_bytes // 4, dtype=np.float32)

    def plain():
        path = os.path.join(plain_dir, f"rank{rank}.bin")
        with open(path, "wb") as f:
            payload.tofile(f)
            f.flush()
            os.fsync(f.fileno())

    def async_step():
        step_no[0] += 1
        pending = ckpt.PendingSave(cfg.train.run_dir, step_no[0], cfg, [ckpt.rank_state(engine, optimizer, copy=True)],
                                   optimizer.t, state, comm=world, keep=1)
        writer = threading.Thread(target=pending.write)
        writer.start()
        seconds = timed(step)
        writer.join()
        pending.finish()
        return seconds

    times = {"checkpoint": [], "plain": [], "step": [], "step with async save": []}
    for r in range(args.warmup + args.repeats):
        order = [("checkpoint", lambda: timed(save)), ("plain", lambda: timed(plain)),
                 ("step", lambda: timed(step)), ("step with async save", async_step)]
        shift = r % len(order)
        for name, fn in order[shift:] + order[:shift]:
            seconds = fn()
            if r >= args.warmup:
                times[name].append(seconds)
            elif name == "checkpoint":
                phases.pop()

    latest = ckpt.find_latest(cfg.train.run_dir) if rank == 0 else None
    latest = world.bcast(latest)
    resume = timed(lambda: ckpt.load(latest, engine.specs, engine.params, optimizer))
    peaks = world.gather(vm_hwm())
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
        result = {"layout": [tp, pp, dp, zero], "build": build, "first": first, "steady": median(steady),
                  "times": times, "phases": phases, "bytes": total_bytes, "peaks": peaks, "resume": resume,
                  "params": int(world.allreduce(engine.params.size) // max(1, dp))}
        with open(args.out, "w") as f:
            json.dump(result, f)
    else:
        world.allreduce(engine.params.size)


def quartiles(values):
    q = np.percentile(values, [25, 50, 75])
    return q[0], q[1], q[2]


def classify(ratios, target, higher_is_better):
    lo, mid, hi = quartiles(ratios)
    good = (lambda x: x >= target) if higher_is_better else (lambda x: x <= target)
    if good(lo if higher_is_better else hi):
        return "met"
    if good(mid) or good(hi if higher_is_better else lo):
        return "within noise" if not good(mid) else "met (median; quartiles straddle)"
    return "missed"


def sim_section():
    from boostmpi.config import config_from_dict
    from boostmpi.sim.machines import load_machine
    from boostmpi.sim.model import checkpoint_bytes, checkpoint_seconds, predict

    machine = load_machine("a100-80gb")
    rank_bw, fs_bw = 2e9, 100e9  # per-process write and aggregate filesystem bandwidth (assumed; stated)
    rows = []
    cases = [("7B", dict(d_model=4096, n_layers=32, n_heads=32, rank=1024), dict(tp=4, pp=1, dp=8)),
             ("30B", dict(d_model=7168, n_layers=48, n_heads=56, rank=1792), dict(tp=8, pp=4, dp=8))]
    for name, model, par in cases:
        for zero in (0, 1):
            cfg = config_from_dict({"model": dict(model, arch="cola", vocab_size=32000, seq_len=2048),
                                    "parallel": dict(par, zero_stage=zero),
                                    "train": {"dtype": "bfloat16", "device": "gpu", "micro_batch_size": 1,
                                              "recompute": "lowrank"}})
            p = predict(cfg, machine)
            largest, total = checkpoint_bytes(cfg)
            gib = 2**30
            mem = p.memory_bytes
            rows.append([name, f"tp{par['tp']} pp{par['pp']} dp{par['dp']}", zero,
                         f"{(mem['params'] + mem['grads'] + mem['optimizer']) / gib:.1f}",
                         f"{mem['optimizer'] / gib:.1f}", f"{total / gib:.0f}", f"{largest / gib:.2f}",
                         f"{checkpoint_seconds(cfg, rank_bw, fs_bw):.1f}",
                         f"{total / gib * 1:.0f} GiB on rank 0"])
    return ("### Performance model: 7B and 30B (cola, bf16 on a100-80gb, rank = d/4, seq 2048)\n\n"
            f"Checkpoint time assumes {rank_bw / 1e9:.0f} GB/s per writing process and {fs_bw / 1e9:.0f} GB/s "
            "for the filesystem in total (assumptions, not measurements); the last column is what the previous "
            "format gathered on world rank 0 (every global tensor and both moments in fp32).\n\n"
            + markdown_table(["model", "layout", "zero_stage", "params+grads+moments per GPU, GiB",
                              "moments per GPU, GiB", "checkpoint GiB", "largest rank file GiB",
                              "predicted write s", "before: gathered"], rows))


def main():
    p = parser(__doc__.splitlines()[0], warmup=1, repeats=10)
    p.add_argument("--layouts", help="only these layouts, 'tp,pp,dp,zero' separated by spaces (default: all)")
    p.add_argument("--layout")
    p.add_argument("--out")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: the system's temp folder)")
    args = p.parse_args()
    if mpi_worker():
        worker(args)
        return 0
    results = []
    layouts = [tuple(int(x) for x in item.split(",")) for item in args.layouts.split()] if args.layouts else LAYOUTS
    for tp, pp, dp, zero in layouts:
        out = tempfile.mktemp(suffix=".json")
        status = launch_under_mpiexec(tp * pp * dp, 3000, ["--layout", f"{tp},{pp},{dp},{zero}", "--out", out])
        if status != 0:
            print(f"layout {tp},{pp},{dp},{zero} failed ({status})", file=sys.stderr)
            return 1
        with open(out) as f:
            results.append(json.load(f))
        os.remove(out)
    rows, ratio_rows, phase_rows = [], [], []
    mib = 2**20
    for r in results:
        tp, pp, dp, zero = r["layout"]
        t = r["times"]
        bw = [r["bytes"] / c for c in t["checkpoint"]]
        ratio = [p_ / c for c, p_ in zip(t["checkpoint"], t["plain"])]  # checkpoint bandwidth / plain bandwidth
        cost = [(a - s) / s for a, s in zip(t["step with async save"], t["step"])]
        peaks = r["peaks"]
        rows.append([f"tp{tp} dp{dp} zero{zero}", tp * pp * dp, f"{r['build']:.2f}", f"{r['first']:.2f}",
                     f"{r['steady']:.2f}", f"{r['resume']:.2f}",
                     " / ".join(f"{x / mib:.0f}" for x in peaks), f"{peaks[0] / max(peaks[1:] or peaks):.2f}"])
        phase_rows.append([f"tp{tp} dp{dp} zero{zero}", f"{median(t['checkpoint']):.3f}"]
                          + [f"{median([ph[k] for ph in r['phases']]):.3f}" for k in PHASES])
        lo, mid, hi = quartiles(ratio)
        clo, cmid, chi = quartiles(cost)
        ratio_rows.append([f"tp{tp} dp{dp} zero{zero}", f"{r['bytes'] / mib:.0f}",
                           f"{median(t['checkpoint']):.2f}", f"{median(bw) / mib:.0f}", f"{median(t['plain']):.2f}",
                           f"{mid:.2f} ({lo:.2f}-{hi:.2f})", classify(ratio, 0.5, True),
                           f"{100 * cmid:+.0f}% ({100 * clo:+.0f}% to {100 * chi:+.0f}%)", classify(cost, 0.10, False)])
    sections = [
        f"Model: cola d={MODEL['d_model']} L={MODEL['n_layers']} r={MODEL['rank']} vocab {MODEL['vocab_size']}, "
        f"seq {MODEL['seq_len']}, batch {BATCH}, float32 (the 277M model of the issue does not finish in this "
        f"benchmark's time on this shared 2-core machine); {len(results[0]['times']['step'])} interleaved rounds.",
        "### Memory, build, first step, resume (seconds: the slowest rank)\n\n" + markdown_table(
            ["layout", "ranks", "build s", "step 1 s", "steady step s (median)", "resume s",
             "peak RSS per rank MiB", "rank 0 / largest other"], rows),
        "### Checkpoint write against a plain write of the same bytes, asynchronous save\n\n"
        "Ratio = plain write time / checkpoint write time (= checkpoint bandwidth / plain bandwidth), round by "
        "round, median (quartiles); target >= 0.5. Async cost = (step during an asynchronous save - step "
        "without) / step without, round by round; target <= +10%.\n\n" + markdown_table(
            ["layout", "checkpoint MiB", "checkpoint s", "MiB/s", "plain s", "bandwidth ratio", "verdict",
             "async save cost to the step", "verdict"], ratio_rows),
        "### Checkpoint write by phase (median over the rounds of each phase's slowest rank, seconds)\n\n"
        "hdf5 write: h5py writing the rank file; fsync: its fsync; sha256: reading it back and hashing it "
        "(in a thread, during the fsync: the two overlap); "
        "wait: the gather until every rank reported (the slowest rank's wait is ~0); virtual files: rank 0 "
        "writing model.h5, optim.h5, state.json and hashing them; publish: COMPLETE, rename, `latest`.\n\n"
        + markdown_table(["layout", "checkpoint s", *PHASES], phase_rows),
        sim_section(),
    ]
    emit("scale: ZeRO-1, per-rank checkpoints, async save, first step", machine_description(mpi=True), sections,
         append_to=args.append)
    return 0


if __name__ == "__main__":
    sys.exit(main())
