"""Validation through a pipeline: `Engine.evaluate_batches` (the batches pipelined) against the same
batches evaluated one at a time (what the engine did before: each batch through every stage, then a sum
over the ranks), with stage forwards that are fixed sleeps.

The engine's own evaluation code and its real MPI pipeline messages at pp ranks (default 4) and n
batches (default 8); every stage forward sleeps `unit` seconds (bench/pipeline_bubble.py's
SleepingEngine), so the 2-core machine's load does not stand in for compute. Formulas: pipelined
(n + pp - 1) unit, one at a time n pp unit. Target: the pipelined pass within 10% of its formula.
The two are timed interleaved round by round.

    PYTHONPATH=. .venv/bin/python bench/pipelined_eval.py [--pp 4] [--batches 8] [--unit 0.05] [--append bench/log/pipelined_eval.md]

The logical-clock version of the same measurement is a test (tests/unit/parallel/test_pipelined_eval.py).
"""

import common  # first: one BLAS thread before numpy loads

import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from pipeline_bubble import B, T, SleepingEngine, sleeping_main  # noqa: E402

TARGET = 0.10


def main():
    def add_arguments(p):
        p.add_argument("--batches", type=int, default=8, help="batches of the pass (default %(default)s)")

    return sleeping_main(__doc__.splitlines()[0], measure, 0.05, add_arguments)


def measure(args, world):
    from mpi4py import MPI

    from boostmpi.parallel.comm import HostCollectives

    rank0 = world.Get_rank() == 0
    machine = common.machine_description(mpi=True) if rank0 else None
    engine = SleepingEngine(world, 1, args.unit)
    engine.grid.host = HostCollectives(world)
    batches = [(np.zeros((B, T), dtype=np.int64), np.zeros((B, T), dtype=np.int64)) for _ in range(args.batches)]
    ways = {"pipelined (evaluate_batches)": lambda: engine.evaluate_batches(batches),
            "one at a time (before)": lambda: [engine.evaluate_batches([b]) for b in batches]}
    walls = {name: [] for name in ways}
    names = list(ways)
    for round_no in range(args.warmup + args.repeats):
        shift = round_no % len(names)
        for name in names[shift:] + names[:shift]:
            world.Barrier()
            t0 = time.perf_counter()
            ways[name]()
            wall = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if round_no >= args.warmup:
                walls[name].append(wall)
    if not rank0:
        return 0
    n, pp, unit = args.batches, args.pp, args.unit
    formulas = {names[0]: (n + pp - 1) * unit, names[1]: n * pp * unit}
    rows, met = [], True
    for name, values in walls.items():
        q1, med, q3 = statistics.quantiles(values, n=4)
        off = med / formulas[name] - 1
        if name == names[0]:
            met = abs(off) <= TARGET
        rows.append([name, f"{formulas[name]:.3f}", f"{med:.3f}", f"{q1:.3f} - {q3:.3f}", f"{off:+.1%}"])
    ratio = [a / b for a, b in zip(walls[names[0]], walls[names[1]])]
    r1, rmed, r3 = statistics.quantiles(ratio, n=4)
    table = common.markdown_table(["evaluation", "formula (s)", "measured wall (median, s)", "quartiles",
                                   "vs formula"], rows)
    section = (f"pp = {pp}, n = {n} batches, stage forward {1e3 * unit:.0f} ms (a sleep), {args.repeats} rounds "
               f"after {args.warmup} untimed\n\n{table}\n\npipelined / one at a time, round by round: median "
               f"{rmed:.3f} (quartiles {r1:.3f} - {r3:.3f}); formula (n + pp - 1) / (n pp) = "
               f"{(n + pp - 1) / (n * pp):.3f}\n\nTarget: the pipelined pass within {TARGET:.0%} of (n + pp - 1) "
               f"forwards: {common.verdict(met)}")
    common.emit("pipelined_eval: validation through a pipeline, with sleeping stages", machine, [section], args.append)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
