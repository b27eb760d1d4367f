"""Scale-out state: per-rank memory, parallel checkpoint writes against a plain write, asynchronous
save, resume, engine build and the first step, at 1, 2 and 4 ranks; then the performance model's
checkpoint time and per-rank memory for the paper's 7B (tp = 4) and a 30B layout.

    PYTHONPATH=. .venv/bin/python bench/scale.py [--model small|277m] [--repeats 10] [--layouts "1,1,2,1 2,1,2,1"] [--append bench/log/scale.md]

Each layout runs as its own `mpiexec` job (this script relaunched as a worker). Per layout:
- build: Engine + AdamW construction, the slowest rank;
- step 1 and the median of the next steps (forward, backward, optimizer step), the slowest rank;
- checkpoint write (checkpoint.save, every rank its own file, then publish), by phase, against a plain
  write of the same bytes by the same ranks in the same job (each rank `tofile` + fsync of as many
  bytes as its rank file), interleaved round by round; bandwidth = the checkpoint's bytes / time;
- asynchronous save, as the trainer runs one: snapshot and start, steps while every rank's writer
  thread writes (polled at each step boundary), publishing; against as many steps without a save,
  interleaved;
- resume: checkpoint.load of this layout's checkpoint into the engine, the slowest rank;
- peak resident memory (VmHWM) of every rank at the end.
"""

import common  # noqa: F401  (one BLAS thread; before numpy)

import json  # noqa: E402
import mmap  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from common import emit, launch_under_mpiexec, machine_description, markdown_table, median, mpi_worker, parser  # noqa: E402

# --model: "small" fits a shared 2-core machine's time; "277m" is the model of the scale-out measurements
# (cola d=2048, 8 layers, r=512, vocab 32000)
MODELS = {"small": (dict(arch="cola", vocab_size=32000, d_model=256, n_layers=4, n_heads=4, rank=64, seq_len=128), 2),
          "277m": (dict(arch="cola", vocab_size=32000, d_model=2048, n_layers=8, n_heads=16, rank=512, seq_len=256), 1)}
# (tp, pp, dp, zero_stage)
LAYOUTS = [(1, 1, 1, 0), (2, 1, 1, 0), (1, 1, 2, 1), (2, 1, 2, 1), (1, 1, 4, 1)]
STEADY_STEPS = 3
# the phases of a checkpoint write (checkpoint.PendingSave.phases), each the slowest rank's seconds
PHASES = ("write", "fsync", "wait", "virtual files", "publish")
ASYNC_PHASES = ("snapshot", "write", "checksum", "fsync", "virtual files", "publish")


def vm_hwm():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def worker(args):
    from mpi4py import MPI

    from boostmpi import checkpoint as ckpt
    from boostmpi.config import config_from_dict
    from boostmpi.files import write_at
    from boostmpi.parallel.engine import Engine
    from boostmpi.train.optim import AdamW
    from boostmpi.train.trainer import optimizer_step

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    tp, pp, dp, zero = (int(x) for x in args.layout.split(","))
    MODEL, BATCH = MODELS[args.model]
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
        optimizer_step(engine, optimizer, 1e-4, 1.0)

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
    async_phases = []  # the same, of the asynchronous saves

    def save():
        step_no[0] += 1
        pending = ckpt.PendingSave(cfg.train.run_dir, step_no[0], cfg, [ckpt.rank_state(engine, optimizer)],
                                   optimizer.t, state, comm=world)
        pending.write()
        pending.finish()
        mine = pending.phases
        phases.append({k: world.allreduce(mine.get(k, 0.0), op=MPI.MAX) for k in PHASES})

    my_bytes = ckpt.rank_state(engine, optimizer).nbytes
    total_bytes = world.allreduce(my_bytes)
    plain_dir = os.path.join(base, "plain")
    os.makedirs(plain_dir, exist_ok=True)
    # one page-aligned buffer of as many bytes for both plain writes (direct I/O needs the alignment)
    aligned = mmap.mmap(-1, -(-my_bytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    payload = np.frombuffer(aligned, dtype=np.uint8)
    payload[...] = 1  # its pages in
    payload = payload[:my_bytes]

    def plain():
        path = os.path.join(plain_dir, f"rank{rank}.bin")
        with open(path, "wb") as f:
            payload.tofile(f)
            f.flush()
            os.fsync(f.fileno())

    def plain_direct():
        """The disk's own speed for the same bytes (in whole pages): one direct-I/O write from page-aligned
        memory (like `dd oflag=direct`), then fsync."""
        fd = os.open(os.path.join(plain_dir, f"rank{rank}.direct"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
        try:
            write_at(fd, aligned, 0)
            os.fsync(fd)
        finally:
            os.close(fd)

    def async_save():
        """An asynchronous save as the trainer runs one: snapshot, folder (collective) and writer thread;
        steps while the writers work, every rank's progress polled at each step boundary; then rank 0
        publishes. Returns (seconds from the snapshot to the publishing, steps run, seconds of those the
        steps did not run: snapshot, start and publishing), each the slowest rank's."""
        step_no[0] += 1
        world.Barrier()
        t0 = time.perf_counter()
        pending = ckpt.PendingSave(cfg.train.run_dir, step_no[0], cfg, [ckpt.rank_state(engine, optimizer)],
                                   optimizer.t, state, comm=world)
        pending.snapshot()
        writer = threading.Thread(target=pending.write_in_background)
        writer.start()
        blocking = time.perf_counter() - t0
        n = 0
        while True:
            step()
            n += 1
            if world.allreduce(0 if pending.written else 1) == 0:
                break
        t1 = time.perf_counter()
        writer.join()
        pending.finish()
        t2 = time.perf_counter()
        async_phases.append({k: world.allreduce(pending.phases.get(k, 0.0), op=MPI.MAX) for k in ASYNC_PHASES})
        return slowest(t2 - t0), n, slowest(blocking + t2 - t1)

    def steps(n):
        return timed(lambda: [step() for _ in range(n)])

    def prune():
        """Delete the older checkpoints, untimed: pruning (the trainer's `keep`, done by a thread of rank 0
        beside the next step) is housekeeping, not part of writing a checkpoint."""
        if rank == 0:
            for old in ckpt.complete_checkpoints(cfg.train.run_dir)[:-1]:
                shutil.rmtree(old)
        world.Barrier()

    times = {"checkpoint": [], "plain": [], "plain direct": [], "async": [], "async steps": [], "async blocking": [],
             "steps": []}
    for r in range(args.warmup + args.repeats):
        # the checkpoint and the plain write alternate in order; so do the asynchronous save and as many
        # steps without a save (the number the previous rounds needed, again after the save if it differs)
        pair = [("checkpoint", lambda: timed(save)), ("plain", lambda: timed(plain)),
                ("plain direct", lambda: timed(plain_direct))]
        measured = {}
        for name, fn in pair[r % 3:] + pair[:r % 3]:
            measured[name] = fn()
            prune()
        if r % 2:
            measured["async"], n, measured["async blocking"] = async_save()
            prune()
            measured["steps"] = steps(n)
        else:
            guess = int(median(times["async steps"])) if times["async steps"] else 1
            measured["steps"] = steps(guess)
            measured["async"], n, measured["async blocking"] = async_save()
            prune()
            if n != guess:
                measured["steps"] = steps(n)
        measured["async steps"] = n
        if r >= args.warmup:
            for name, value in measured.items():
                times[name].append(value)
        else:
            phases.pop()
            async_phases.pop()

    latest = ckpt.find_latest(cfg.train.run_dir) if rank == 0 else None
    latest = world.bcast(latest)
    resume = timed(lambda: ckpt.load(latest, engine.specs, engine.params, optimizer))
    peaks = world.gather(vm_hwm())
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
        result = {"layout": [tp, pp, dp, zero], "build": build, "first": first, "steady": median(steady),
                  "times": times, "phases": phases, "async_phases": async_phases, "bytes": total_bytes, "peaks": peaks, "resume": resume,
                  "params": int(world.allreduce(engine.params.size) // max(1, dp))}
        with open(args.out, "w") as f:
            json.dump(result, f)
    else:
        world.allreduce(engine.params.size)


def quartiles(values):
    q = np.percentile(values, [25, 50, 75])
    return q[0], q[1], q[2]


def classify(ratios, target, higher_is_better):
    """met: the whole interquartile range on the target's good side; missed: all of it on the other;
    within noise: the quartiles straddle the target."""
    lo, _, hi = quartiles(ratios)
    good = (lambda x: x >= target) if higher_is_better else (lambda x: x <= target)
    if good(lo) and good(hi):
        return "met"
    if not good(lo) and not good(hi):
        return "missed"
    return "within noise"


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
    p.add_argument("--model", choices=sorted(MODELS), default="small", help="model size (default %(default)s)")
    p.add_argument("--layout")
    p.add_argument("--out")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: the system's temp folder)")
    args = p.parse_args()
    if mpi_worker():
        worker(args)
        return 0
    results, failed = [], []
    layouts = [tuple(int(x) for x in item.split(",")) for item in args.layouts.split()] if args.layouts else LAYOUTS
    for tp, pp, dp, zero in layouts:
        out = tempfile.mktemp(suffix=".json")
        status = launch_under_mpiexec(tp * pp * dp, 3000, ["--layout", f"{tp},{pp},{dp},{zero}", "--out", out,
                                                                  "--model", args.model])
        if status != 0 or not os.path.exists(out):  # reported; the other layouts still run
            print(f"layout {tp},{pp},{dp},{zero} failed (exit status {status})", file=sys.stderr)
            failed.append(f"tp{tp} pp{pp} dp{dp} zero{zero} (exit status {status})")
            continue
        with open(out) as f:
            results.append(json.load(f))
        os.remove(out)
    if not results:
        return 1
    MODEL, BATCH = MODELS[args.model]
    rows, ratio_rows, phase_rows, async_rows = [], [], [], []
    mib = 2**20
    for r in results:
        tp, pp, dp, zero = r["layout"]
        t = r["times"]
        bw = [r["bytes"] / c for c in t["checkpoint"]]
        ratio = [p_ / c for c, p_ in zip(t["checkpoint"], t["plain"])]  # checkpoint bandwidth / plain bandwidth
        direct_ratio = [p_ / c for c, p_ in zip(t["checkpoint"], t["plain direct"])]
        # the time an asynchronous save adds to training, in steps: (the steps while it was in flight, with
        # its snapshot, start and publishing - as many steps without a save) / one step without a save
        step_s = [s / n for s, n in zip(t["steps"], t["async steps"])]
        cost = [(a - s) / one for a, s, one in zip(t["async"], t["steps"], step_s)]
        blocking = [b / one for b, one in zip(t["async blocking"], step_s)]
        peaks = r["peaks"]
        rows.append([f"tp{tp} dp{dp} zero{zero}", tp * pp * dp, f"{r['build']:.2f}", f"{r['first']:.2f}",
                     f"{r['steady']:.2f}", f"{r['resume']:.2f}",
                     " / ".join(f"{x / mib:.0f}" for x in peaks), f"{peaks[0] / max(peaks[1:] or peaks):.2f}"])
        phase_rows.append([f"tp{tp} dp{dp} zero{zero}", f"{median(t['checkpoint']):.3f}"]
                          + [f"{median([ph[k] for ph in r['phases']]):.3f}" for k in PHASES])
        async_rows.append([f"tp{tp} dp{dp} zero{zero}", f"{median(step_s):.3f}"]
                          + [f"{median([ph[k] for ph in r['async_phases']]):.3f}" for k in ASYNC_PHASES])
        lo, mid, hi = quartiles(ratio)
        dlo, dmid, dhi = quartiles(direct_ratio)
        clo, cmid, chi = quartiles(cost)
        blo, bmid, bhi = quartiles(blocking)
        ratio_rows.append([f"tp{tp} dp{dp} zero{zero}", f"{r['bytes'] / mib:.0f}",
                           f"{median(t['checkpoint']):.2f}", f"{median(bw) / mib:.0f}", f"{median(t['plain']):.2f}",
                           f"{mid:.2f} ({lo:.2f}-{hi:.2f})", classify(ratio, 0.5, True),
                           f"{median(t['plain direct']):.2f}", f"{dmid:.2f} ({dlo:.2f}-{dhi:.2f})",
                           f"{median(t['async steps']):.0f}", f"{100 * bmid:.0f}% ({100 * blo:.0f}% to {100 * bhi:.0f}%)",
                           f"{100 * cmid:+.0f}% ({100 * clo:+.0f}% to {100 * chi:+.0f}%)", classify(cost, 0.10, False)])
    sections = [
        f"Model ({args.model}): cola d={MODEL['d_model']} L={MODEL['n_layers']} r={MODEL['rank']} vocab "
        f"{MODEL['vocab_size']}, {results[0]['params'] / 1e6:.0f}M parameters, seq {MODEL['seq_len']}, batch {BATCH}, "
        f"float32; {len(results[0]['times']['steps'])} interleaved rounds.",
        "### Memory, build, first step, resume (seconds: the slowest rank)\n\n" + markdown_table(
            ["layout", "ranks", "build s", "step 1 s", "steady step s (median)", "resume s",
             "peak RSS per rank MiB", "rank 0 / largest other"], rows),
        "### Checkpoint write against a plain write of the same bytes, asynchronous save\n\n"
        "Ratio = plain write time / checkpoint write time (= checkpoint bandwidth / plain bandwidth), round by "
        "round, median (quartiles); target >= 0.5. The plain write is each rank's `tofile` of as many bytes "
        "and its fsync; beside it, the disk's own speed: the same bytes in one direct-I/O write from "
        "page-aligned memory (`dd oflag=direct`), and the checkpoint's ratio to that. An asynchronous save runs as the trainer runs it (snapshot, "
        "start, steps while every rank's writer works, polled at each step boundary, publishing); its cost is "
        "the time it adds to training, (those steps with the save - as many steps without) / one step, round by "
        "round; target <= +10% of a step. Blocking: the part of it no step runs (snapshot, start, publishing), "
        "in steps.\n\n" + markdown_table(
            ["layout", "checkpoint MiB", "checkpoint s", "MiB/s", "plain s", "bandwidth ratio", "verdict",
             "direct plain s", "ratio to direct", "steps while in flight", "blocking", "async save cost, of a step", "verdict"], ratio_rows),
        "### Checkpoint write by phase (median over the rounds of each phase's slowest rank, seconds)\n\n"
        "write: the rank file's bytes (its HDF5 structure, kept from the first save, and the tensor data) "
        "through a 32 MiB staging buffer with direct I/O, their XXH3-64 taken on the way; fsync: its fsync; "
        "wait: the gather until every rank reported (the slowest rank's wait is ~0); virtual files: rank 0 "
        "writing model.h5, optim.h5, state.json and hashing them; publish: COMPLETE, rename, `latest`.\n\n"
        + markdown_table(["layout", "checkpoint s", *PHASES], phase_rows),
        "### Asynchronous save by phase (median over the rounds of each phase's slowest rank, seconds)\n\n"
        "snapshot: copying the rank file's bytes (structure and tensors) into a page-aligned buffer kept from "
        "the previous save (blocking); write: that buffer to the file with direct I/O; checksum: its XXH3-64, "
        "from memory; fsync: the file's (write, checksum, fsync: the writer thread, at nice 19, beside the steps); "
        "virtual files and publish: rank 0, when every rank has written (blocking).\n\n"
        + markdown_table(["layout", "step s", *ASYNC_PHASES], async_rows),
        sim_section(),
    ]
    if failed:
        sections.insert(1, "Layouts that failed (see the output above): " + ", ".join(failed) + ".")
    emit("scale: ZeRO-1, per-rank checkpoints, async save, first step", machine_description(mpi=True), sections,
         append_to=args.append)
    return 0


if __name__ == "__main__":
    sys.exit(main())
