"""The pipeline bubble of plain and interleaved 1F1B, with stage passes that are fixed sleeps.

The engine's own `forward_backward` loop and its real MPI pipeline messages, at pp ranks (default
4) and m micro-batches (default 8); every stage pass is a sleep instead of compute (a chunk's
forward `unit / v`, its backward `2 unit / v`, so a rank's layers cost the same whatever v), so
the 2-core machine's load does not stand in for compute. Bubble = step wall time over the busiest
rank's time asleep in stage passes, minus 1 (the slowest rank's wall time; sleeps are measured,
so oversleeping counts as busy). Formula: (pp - 1) / (v m). Passes of 100 ms: with 20 ms ones, a
load average of 8 on the 2 cores added its wake-up delays (+17% to +22% on both schedules). Target: interleaved (v = 2) within
10% of it at pp = 4, m = 8. Cases are timed interleaved round by round.

    PYTHONPATH=. .venv/bin/python bench/pipeline_bubble.py [--pp 4] [--micro 8] [--unit 0.1] [--append bench/log/pipeline_bubble.md]

The script starts itself under `timeout <--timeout> mpiexec -n <--pp>`. The logical-clock version
of the same measurement is a test (tests/unit/parallel/test_pipeline.py).
"""

import common  # first: one BLAS thread before numpy loads

import statistics  # noqa: E402
import time  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402

from boostmpi.parallel.engine import Engine  # noqa: E402

WIDTH = 64  # elements per token of the (tiny) messages: the sleeps, not the bytes, are the point
B, T = 1, 4
TARGET = 0.10


class SleepingEngine(Engine):
    """Engine.forward_backward around stage passes that sleep, with the real pipeline group."""

    def __init__(self, world, n_chunks, unit):
        from boostmpi.parallel.grid import ProcessGrid

        self.grid = ProcessGrid(world, 1, world.Get_size(), 1)
        self.xp, self.cdtype = np, np.float32
        self.stage, self.n_stages, self.n_chunks = self.grid.coords.pp, world.Get_size(), n_chunks
        self.first, self.last = self.grid.is_first_stage, self.grid.is_last_stage
        from boostmpi.parallel.data_parallel import DataParallel

        self.tp_layers = SimpleNamespace(res_cols=(0, WIDTH))
        self.grads, self.params = SimpleNamespace(data=np.zeros(1)), None
        self.data_parallel = DataParallel(self.grid.dp, 0, 1, 0, [], {}, 0, np, np.float32)  # no buckets, no ZeRO-1
        self.unit, self.busy = unit, 0.0

    def _refresh_compute_params(self):
        pass

    def _account_saved(self, saved_of_chunks):
        pass

    def _grad_sq(self):
        return 0.0

    def _sleep(self, seconds):
        t0 = time.perf_counter()
        time.sleep(seconds)
        self.busy += time.perf_counter() - t0

    def _stage_forward(self, x, y, h, keep=True, chunk=0):
        self._sleep(self.unit / self.n_chunks)
        last = self.last and chunk == self.n_chunks - 1
        return (0.0 if last else np.zeros((B * T, WIDTH), dtype=self.cdtype)), {"layers": []}

    def _stage_backward(self, dh, saved, shape, scale, on_bucket_done, chunk=0):
        self._sleep(2 * self.unit / self.n_chunks)
        return np.zeros((B * T, WIDTH), dtype=self.cdtype)


def sleeping_main(title, measure, unit, add_arguments=None):
    """The command line of a benchmark of sleeping stages: --pp ranks under mpiexec (started by the
    script itself), --unit seconds a stage forward, then `measure(args, world)` on every rank."""
    p = common.parser(title, warmup=2, repeats=12)
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks (default %(default)s)")
    p.add_argument("--unit", type=float, default=unit, help="seconds of one stage forward (default %(default)s)")
    p.add_argument("--timeout", type=int, default=600, help="seconds before the mpiexec launch is killed")
    if add_arguments:
        add_arguments(p)
    args = p.parse_args()
    if not common.mpi_worker():
        return common.launch_under_mpiexec(args.pp, args.timeout)
    from mpi4py import MPI

    from boostmpi.parallel.launch import run_guarded  # a failing rank ends every rank, never a hang

    return run_guarded(lambda: measure(args, MPI.COMM_WORLD), MPI.COMM_WORLD, MPI.COMM_WORLD.Get_rank())


def main():
    def add_arguments(p):
        p.add_argument("--micro", type=int, default=8, help="micro-batches per step (default %(default)s)")
        p.add_argument("--chunks", type=int, default=2,
                       help="chunks per rank of the interleaved case (default %(default)s)")

    return sleeping_main(__doc__.splitlines()[0], measure, 0.1, add_arguments)


def measure(args, world):
    from mpi4py import MPI

    rank0 = world.Get_rank() == 0
    machine = common.machine_description(mpi=True) if rank0 else None
    engines = {v: SleepingEngine(world, v, args.unit) for v in (1, args.chunks)}
    micro = [(np.zeros((B, T), dtype=np.int64), np.zeros((B, T), dtype=np.int64)) for _ in range(args.micro)]
    bubbles = {v: [] for v in engines}
    names = list(engines)
    for round_no in range(args.warmup + args.repeats):
        shift = round_no % len(names)
        for v in names[shift:] + names[:shift]:
            engine = engines[v]
            engine.busy = 0.0
            world.Barrier()
            t0 = time.perf_counter()
            engine.forward_backward(micro)
            wall = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            busy = world.allreduce(engine.busy, op=MPI.MAX)
            if round_no >= args.warmup:
                bubbles[v].append(wall / busy - 1)
    if not rank0:
        return 0
    rows, met = [], True
    for v, values in bubbles.items():
        q1, med, q3 = statistics.quantiles(values, n=4)
        formula = (args.pp - 1) / (v * args.micro)
        off = med / formula - 1
        if v > 1:
            met = abs(off) <= TARGET
        rows.append([f"v = {v}" + (" (plain 1F1B)" if v == 1 else " (interleaved)"), f"{formula:.4f}",
                     f"{med:.4f}", f"{q1:.4f} - {q3:.4f}", f"{off:+.1%}"])
    table = common.markdown_table(["schedule", "(pp - 1) / (v m)", "measured bubble (median)", "quartiles",
                                   "vs formula"], rows)
    section = (f"pp = {args.pp}, m = {args.micro}, stage forward {1e3 * args.unit:.0f} ms / v, backward twice "
               f"that, {args.repeats} rounds after {args.warmup} untimed\n\n{table}\n\n"
               f"Target: the interleaved bubble within {TARGET:.0%} of (pp - 1) / (v m): {common.verdict(met)}")
    common.emit("pipeline_bubble: plain and interleaved 1F1B with sleeping stages", machine, [section], args.append)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
