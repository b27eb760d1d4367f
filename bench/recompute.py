"""Activation recomputation and communication overlap at 2 ranks, tp=2 btp.

cola d=1024 (16 heads), r=256, d_ff=2736, 4 layers, T=256, vocab 256, float32, one thread per
rank. Cases: `train.recompute` none / layer / lowrank, each with `parallel.overlap` on and off,
all in one mpiexec launch (every case's engine lives in the same two processes) and timed
interleaved round by round. A step is forward + backward + AdamW update; its time is the
slowest rank's.

Memory, three ways, each per case and the largest over the ranks:
  saved activations  Engine.saved_activation_bytes: what the forward keeps for the backward,
                     per micro-batch (the step has one micro-batch), split into the mean per
                     layer (Engine.saved_activation_bytes_per_layer) and the rest (token ids,
                     the head's cache), which no recompute mode touches;
  step peak          tracemalloc's peak during one extra, untimed step, tracing started just
                     before it: the most bytes allocated during the step and alive at once
                     (numpy reports its array buffers to tracemalloc). Resident parameters,
                     gradients and optimizer state allocated earlier are not in it, so the
                     cases' engines sharing a process do not blur it;
  process peak RSS   getrusage's ru_maxrss is a process-lifetime maximum, so it is measured in
                     a separate mpiexec launch per recompute mode (overlap on) that builds only
                     that engine and runs 2 steps. It includes the interpreter, libraries,
                     parameters, gradients and optimizer state.
Targets: lowrank keeps <= 20% of none's saved-activation bytes at <= 25% extra step time, and
saves >= 1.5x more memory per ms of added time than layer.

    PYTHONPATH=. .venv/bin/python bench/recompute.py [--no-rss] [--append bench/log/recompute.md]

The script starts itself under `timeout <--timeout> mpiexec -n <--ranks>` (the mpiexec of `boostmpi.parallel.launch.find_mpiexec`).
"""

import common  # first: one BLAS thread before numpy loads

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import tracemalloc  # noqa: E402
from pathlib import Path  # noqa: E402

MODEL = {"arch": "cola", "vocab_size": 256, "d_model": 1024, "n_layers": 4, "n_heads": 16,
         "d_ff": 2736, "rank": 256, "seq_len": 256}
MODES = ("none", "layer", "lowrank")
CASES = {f"{mode}, overlap {'on' if overlap else 'off'}": (mode, overlap)
         for overlap in (True, False) for mode in MODES}
TARGET_SAVED_SHARE, TARGET_EXTRA_TIME, TARGET_EFFICIENCY = 0.20, 0.25, 1.5
MB = 2 ** 20


def main():
    p = common.parser(__doc__.splitlines()[0], warmup=1, repeats=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--ranks", type=int, default=2, help="MPI ranks = tp size (default %(default)s)")
    p.add_argument("--timeout", type=int, default=240, help="seconds before an mpiexec launch is killed")
    p.add_argument("--no-rss", action="store_true", help="skip the per-mode launches that measure peak RSS")
    p.add_argument("--profile-steps", type=int, default=1,
                   help="cProfile this many steps of each recompute mode (overlap on) on rank 0; 0 = none")
    p.add_argument("--top", type=int, default=10, help="hot spots listed per profile")
    # set by the script for its own launches
    p.add_argument("--rss-only", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--rss-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not common.mpi_worker():
        return launch(args)

    from mpi4py import MPI

    from boostmpi.parallel.launch import run_guarded

    world = MPI.COMM_WORLD
    body = (lambda: measure_rss(args, world)) if args.rss_only else (lambda: measure(args, world))
    return run_guarded(body, world, world.Get_rank())


def launch(args):
    """One launch per recompute mode for its peak RSS, then the side-by-side launch."""
    with tempfile.TemporaryDirectory() as rss_dir:
        extra = [] if args.no_rss else ["--rss-dir", rss_dir]
        if not args.no_rss:
            for mode in MODES:
                status = common.launch_under_mpiexec(args.ranks, args.timeout, ["--rss-only", mode, *extra])
                if status != 0:
                    return status
        return common.launch_under_mpiexec(args.ranks, args.timeout, extra)


def build(args, world, mode, overlap):
    return common.build_engine(MODEL, args.batch, parallel={"tp": world.Get_size(), "tp_mode": "btp", "overlap": overlap},
                               train={"recompute": mode}, world=world)


def measure_rss(args, world):
    from mpi4py import MPI

    _cfg, _engine, _opt, step = build(args, world, args.rss_only, True)
    x, y = common.random_batch(MODEL, args.batch)
    for _ in range(2):
        step(x, y)
    peak_kib = world.allreduce(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, op=MPI.MAX)  # KiB on Linux
    if world.Get_rank() == 0:
        Path(args.rss_dir, f"{args.rss_only}.json").write_text(json.dumps({"maxrss_kib": peak_kib}))
    return 0


def traced_step_peak(step, x, y):
    """Peak bytes allocated during one step and alive at once (tracemalloc, started just before)."""
    tracemalloc.start()
    try:
        step(x, y)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def measure(args, world):
    from mpi4py import MPI

    rank0 = world.Get_rank() == 0
    machine = common.machine_description(mpi=True) if rank0 else None
    x, y = common.random_batch(MODEL, args.batch)
    steps, saved, saved_split, traffic, first_loss, train_steps, waits = {}, {}, {}, {}, {}, {}, {}
    for name, (mode, overlap) in CASES.items():
        _cfg, engine, _opt, step = build(args, world, mode, overlap)
        engine.grid.counter.reset()
        first_loss[name] = step(x, y)  # also the first warm-up step
        counted = engine.grid.counter.snapshot()
        traffic[name] = counted["bytes"]["tp"], counted["calls"]["tp"]
        in_layers = sum(engine.saved_activation_bytes_per_layer)
        saved[name] = world.allreduce(engine.saved_activation_bytes, op=MPI.MAX)
        saved_split[name] = (world.allreduce(in_layers / len(engine.saved_activation_bytes_per_layer), op=MPI.MAX),
                             world.allreduce(engine.saved_activation_bytes - in_layers, op=MPI.MAX))
        steps[name], waits[name] = common.step_tracking_tp_wait(engine, step, x, y)
        train_steps[name] = step

    barrier, slowest = common.mpi_timing_hooks(world)
    timings = common.time_interleaved(steps, args.warmup, args.repeats, barrier=barrier, reduce=slowest)
    peaks = {name: world.allreduce(traced_step_peak(train_steps[name], x, y), op=MPI.MAX) for name in CASES}
    # every rank runs the profiled steps (they communicate); rank 0's profile is reported
    profiles = []
    for mode in MODES if args.profile_steps > 0 else ():
        step = train_steps[f"{mode}, overlap on"]
        profiles.append(common.step_profile_section(f"{mode} (overlap on) step profile, rank 0",
                                                    lambda step=step: step(x, y), args.profile_steps, args.top))
    if not rank0:
        return 0
    rss = {}
    if args.rss_dir:
        rss = {mode: json.loads(Path(args.rss_dir, f"{mode}.json").read_text())["maxrss_kib"] * 1024 for mode in MODES}
    blocked = {name: common.median(waits[name][args.warmup:]) for name in CASES}
    return report(args, world, machine, timings, saved, saved_split, traffic, first_loss, peaks, rss, blocked,
                  profiles)


def report(args, world, machine, timings, saved, saved_split, traffic, first_loss, peaks, rss, blocked, profiles):
    on = {mode: f"{mode}, overlap on" for mode in MODES}
    t = {name: timings.median(name) for name in CASES}
    base = on["none"]
    rows = []
    for name, (mode, overlap) in CASES.items():
        rss_cell = f"{rss[mode] / MB:.0f}" if rss and overlap else ""
        rows.append([name, f"{first_loss[name]:.6f}", f"{traffic[name][0]:,}", traffic[name][1],
                     f"{saved[name] / MB:.1f}", f"{100 * saved[name] / saved[base]:.1f}%",
                     f"{saved_split[name][0] / MB:.2f}", f"{saved_split[name][1] / MB:.2f}",
                     f"{peaks[name] / MB:.1f}", rss_cell, *common.timing_cells(timings, name),
                     f"{100 * (t[name] / t[base] - 1):+.1f}%", f"{1e3 * blocked[name]:.0f}"])
    table = common.markdown_table(
        ["case", "loss (1st step)", "tp bytes/step", "tp calls/step", "saved activations MiB", "of none's",
         "of which per layer MiB", "outside the layers MiB",
         "step peak MiB (tracemalloc)", "process peak RSS MiB (own launch)", *common.TIMING_HEADER,
         "time vs none (overlap on)", "blocked in tp collectives, ms (rank 0)"], rows)

    def efficiency(mode, memory, clock="wall"):
        """MiB of memory saved per ms of added step time against none (overlap on), by the median of
        `clock`; None when the mode added no time."""
        added_ms = 1e3 * (timings.median(on[mode], clock) - timings.median(base, clock))
        return None if added_ms <= 0 else (memory[base] - memory[on[mode]]) / MB / added_ms

    def show(value):
        return "no added time" if value is None else f"{value:.3f} MiB/ms"

    def compare(memory, clock="wall"):
        """(text, target met) for lowrank's memory-per-ms against layer's."""
        low_eff, layer_eff = efficiency("lowrank", memory, clock), efficiency("layer", memory, clock)
        text = f"lowrank {show(low_eff)}, layer {show(layer_eff)}; lowrank / layer = "
        if low_eff is None:
            return text + "(lowrank added no time)", True
        if layer_eff is None or layer_eff <= 0:
            return text + "undefined (layer added no time or saved nothing)", False
        return text + f"**{low_eff / layer_eff:.3f}x**", low_eff / layer_eff >= TARGET_EFFICIENCY

    low, lay = on["lowrank"], on["layer"]

    def per_round(memory):
        """lowrank / layer memory-per-ms within each round (rounds where both modes added time):
        how far the run-to-run noise of this shared machine moves the ratio."""
        ratios = [((memory[base] - memory[low]) / (t_low - t_none)) / ((memory[base] - memory[lay]) / (t_lay - t_none))
                  for t_none, t_lay, t_low in zip(timings.wall[base], timings.wall[lay], timings.wall[low])
                  if t_low > t_none and t_lay > t_none]
        if not ratios:
            return "no round where both modes added time"
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
        return (f"median {statistics.median(ratios):.2f}x, quartiles {q1:.2f}-{q3:.2f}x, range "
                f"{min(ratios):.2f}-{max(ratios):.2f}x over {len(ratios)} rounds")

    share = saved[low] / saved[base]
    extra = t[low] / t[base] - 1
    eff_text, eff_met = compare(saved)
    eff_cpu_text, eff_cpu_met = compare(saved, "cpu")
    eff_peak_text, _ = compare(peaks)
    lines = [
        f"- lowrank keeps **{100 * share:.1f}%** of none's saved-activation bytes (target <= "
        f"{100 * TARGET_SAVED_SHARE:.0f}%: {common.verdict(share <= TARGET_SAVED_SHARE)}) at **{100 * extra:+.1f}%** "
        f"step time (target <= +{100 * TARGET_EXTRA_TIME:.0f}%: {common.verdict(extra <= TARGET_EXTRA_TIME)}); "
        f"median of per-round ratios lowrank / none: wall {timings.paired_ratio(low, base):.3f}, "
        f"CPU {timings.paired_ratio(low, base, 'cpu'):.3f}",
        f"- layer keeps {100 * saved[lay] / saved[base]:.1f}% at {100 * (t[lay] / t[base] - 1):+.1f}% step time "
        f"(per-round ratio layer / none: wall {timings.paired_ratio(lay, base):.3f})",
        f"- saved-activation memory saved per ms of added step time (wall medians): {eff_text} (target >= "
        f"{TARGET_EFFICIENCY}x: {common.verdict(eff_met)})",
        f"- the same by CPU-time medians: {eff_cpu_text} (target: {common.verdict(eff_cpu_met)})",
        f"- the same round by round (wall, saved activations): {per_round(saved)}",
        f"- the same with the tracemalloc step peak as the memory (wall medians): {eff_peak_text}",
        "- overlap off / on step time: " + ", ".join(
            f"{mode} {t[f'{mode}, overlap off'] / t[on[mode]]:.3f} (per-round "
            f"{timings.paired_ratio(f'{mode}, overlap off', on[mode]):.3f})" for mode in MODES),
    ]
    summary = (f"Model: {MODEL}, batch {args.batch} (one micro-batch), float32, tp={world.Get_size()} btp under one "
               f"mpiexec launch; traffic and saved activations from the first step, then {args.warmup} warm-up "
               f"round(s) and the median of {args.repeats} interleaved timed rounds (slowest rank per step); "
               f"memory columns: the largest over the ranks.\n\n{table}\n\n" + "\n".join(lines))
    common.emit(f"recompute: activation recomputation and overlap at {world.Get_size()} ranks, tp btp",
                machine, [summary, *profiles], args.append)
    return 0


if __name__ == "__main__":
    sys.exit(main())
