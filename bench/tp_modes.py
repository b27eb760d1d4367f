"""Tensor-parallel modes at 2 ranks: step time and tp traffic.

cola d=1024 (16 heads), r=256, d_ff=2736, 4 layers, T=256, vocab 256, tp=2, one thread per rank,
float32, side by side in one mpiexec launch (every case's engine lives in the same two processes
and the cases are timed interleaved round by round):
  cola btp online   bottleneck-aware TP, online RMSNorm (the statistic rides in the rank-r all-reduce)
  cola btp sync     the same with a separate all-reduce of the norm statistic
  cola vanilla      the paper's naive low-rank TP: Megatron TP applied to each factor, every factor
                    its own layer (all-reduce of [b, s, d_out] after every B, of [b, s, d_in] before
                    every A in backward; parallel.grouped = false)
  cola vanilla grouped     the same with BOOST's grouped GEMMs lent to it (q/k/v and gate/up share
                    one input-gradient all-reduce): an ablation, not the paper's baseline
  full megatron     arch=full, tp_mode=vanilla: standard Megatron TP of the dense model
A step is forward + backward + AdamW update; its time is the slowest rank's. Traffic is read from
the engine's counters (bytes and calls on the tp axis for one step, docs/FORMATS.md accounting).
Targets: btp moves >= 5x fewer tp bytes than vanilla and its step is faster; online makes fewer
tp calls than sync. Grouping is one of BOOST's own techniques (grouped low-rank GEMMs),
so the baseline is vanilla without it; the grouped variant is reported beside it.

    PYTHONPATH=. .venv/bin/python bench/tp_modes.py [--append bench/log/tp_modes.md]

The script starts itself under `timeout <--timeout> mpiexec -n <--ranks>` (the mpiexec of `boostmpi.parallel.launch.find_mpiexec`).
"""

import common  # first: one BLAS thread before numpy loads

import sys  # noqa: E402

MODEL = {"vocab_size": 256, "d_model": 1024, "n_layers": 4, "n_heads": 16, "d_ff": 2736,
         "rank": 256, "seq_len": 256}
# case -> (arch, tp_mode, norm, grouped); norm matters only under btp
CASES = {
    "cola btp online": ("cola", "btp", "online", True),
    "cola btp sync": ("cola", "btp", "sync", True),
    "cola vanilla": ("cola", "vanilla", "online", False),
    "cola vanilla grouped": ("cola", "vanilla", "online", True),
    "full megatron": ("full", "vanilla", "online", True),
}
TARGET_BYTES_RATIO = 5.0


def main():
    p = common.parser(__doc__.splitlines()[0], warmup=1, repeats=5)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--ranks", type=int, default=2, help="MPI ranks = tp size (default %(default)s)")
    p.add_argument("--timeout", type=int, default=300, help="seconds before the mpiexec launch is killed")
    args = p.parse_args()
    if not common.mpi_worker():
        return common.launch_under_mpiexec(args.ranks, args.timeout)

    from mpi4py import MPI

    from boostmpi.parallel.launch import run_guarded

    world = MPI.COMM_WORLD
    return run_guarded(lambda: measure(args, world), world, world.Get_rank())


def measure(args, world):
    rank0 = world.Get_rank() == 0
    machine = common.machine_description(mpi=True) if rank0 else None
    x, y = common.random_batch(MODEL, args.batch)
    steps, traffic, first_loss, waits = {}, {}, {}, {}
    for name, (arch, tp_mode, norm, grouped) in CASES.items():
        parallel = {"tp": world.Get_size(), "tp_mode": tp_mode, "norm": norm, "grouped": grouped}
        _cfg, engine, _opt, step = common.build_engine(dict(MODEL, arch=arch), args.batch, parallel, world=world)
        # the first step: counted traffic (counted once per group, on its rank 0), and a warm-up
        engine.grid.counter.reset()
        first_loss[name] = step(x, y)
        traffic[name] = engine.grid.counter.snapshot()
        steps[name], waits[name] = common.step_tracking_tp_wait(engine, step, x, y)

    barrier, slowest = common.mpi_timing_hooks(world)
    timings = common.time_interleaved(steps, args.warmup, args.repeats, barrier=barrier, reduce=slowest)
    if not rank0:
        return 0

    tokens = args.batch * MODEL["seq_len"]
    rows = []
    for name in CASES:
        tp_bytes, tp_calls = traffic[name]["bytes"]["tp"], traffic[name]["calls"]["tp"]
        rows.append([name, f"{first_loss[name]:.6f}", f"{tp_bytes:,}", f"{tp_bytes / tokens / 4:,.0f}", tp_calls,
                     *common.timing_cells(timings, name),
                     f"{1e3 * common.median(waits[name][args.warmup:]):.0f}"])
    table = common.markdown_table(
        ["case", "loss (1st step)", "tp bytes/step", "tp elements/token", "tp calls/step",
         *common.TIMING_HEADER, "blocked in tp collectives, ms (rank 0)"], rows)

    def tp(name, what):
        return traffic[name][what]["tp"]

    bytes_ratio = tp("cola vanilla", "bytes") / tp("cola btp online", "bytes")
    time_ratio = timings.median("cola btp online") / timings.median("cola vanilla")
    ratios = [
        f"- tp bytes, vanilla / btp = **{bytes_ratio:.2f}x** (target >= {TARGET_BYTES_RATIO}x: "
        f"{common.verdict(bytes_ratio >= TARGET_BYTES_RATIO)})",
        f"- step time, btp / vanilla = **{time_ratio:.2f}** (target < 1: {common.verdict(time_ratio < 1)}); "
        f"median of per-round ratios: wall {timings.paired_ratio('cola btp online', 'cola vanilla'):.2f}, "
        f"CPU {timings.paired_ratio('cola btp online', 'cola vanilla', 'cpu'):.2f}",
        f"- against vanilla with BOOST's grouping lent to it (ablation): tp bytes vanilla-grouped / btp = "
        f"{tp('cola vanilla grouped', 'bytes') / tp('cola btp online', 'bytes'):.2f}x, step time btp / "
        f"vanilla-grouped = {timings.median('cola btp online') / timings.median('cola vanilla grouped'):.2f}",
        f"- tp calls, online / sync = {tp('cola btp online', 'calls')} / {tp('cola btp sync', 'calls')} "
        f"(target fewer: {common.verdict(tp('cola btp online', 'calls') < tp('cola btp sync', 'calls'))}); "
        f"step time online / sync = {timings.median('cola btp online') / timings.median('cola btp sync'):.2f}",
        f"- cola btp vs full-rank Megatron TP: tp bytes btp / megatron = "
        f"{tp('cola btp online', 'bytes') / tp('full megatron', 'bytes'):.2f}, step time btp / megatron = "
        f"{timings.median('cola btp online') / timings.median('full megatron'):.2f} (median of per-round ratios "
        f"{timings.paired_ratio('cola btp online', 'full megatron'):.2f})",
    ]
    summary = (f"Model: {MODEL}, batch {args.batch} (micro-batch 1 x {args.batch} sequences), float32, "
               f"tp={world.Get_size()} under one mpiexec launch; traffic of the first step, times: "
               f"{args.warmup} warm-up round(s) after it, then the median of {args.repeats} interleaved timed "
               f"rounds (slowest rank per step).\n\n{table}\n\n" + "\n".join(ratios))
    common.emit(f"tp_modes: tensor-parallel modes at {world.Get_size()} ranks", machine, [summary], args.append)
    return 0


if __name__ == "__main__":
    sys.exit(main())
