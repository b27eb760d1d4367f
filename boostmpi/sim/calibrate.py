"""`boostmpi calibrate --out PROFILE.toml [--ranks 2]`: measure this machine, write a sim profile.

The profile describes one MPI rank of the CPU engine as the model's "device": one core running
single-threaded NumPy. Measured: GEMM rates over square and thin shapes (float64 and float32),
the effective bandwidth of boostmpi's own elementwise layer functions and AdamW step, the cost of
one layer function on tiny inputs, and MPI all-reduce latency and bandwidth between local ranks (a small probe of
this module started with the virtualenv's `mpiexec -n RANKS` under `timeout`). The compute
probe runs in a child process with one BLAS thread. About 20-40 seconds in all.
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, cast

from boostmpi.errors import UserError
from boostmpi.files import write_file_atomically
from boostmpi.parallel.launch import find_mpiexec

if TYPE_CHECKING:
    from boostmpi.sim.machines import Machine

# (m, n, k): squares, then thin in each dim, the shapes of low-rank layers on a small model
GEMM_SHAPES = [(64, 64, 64), (128, 128, 128), (256, 256, 256), (512, 512, 512),
               (2048, 256, 256), (2048, 256, 32), (2048, 32, 256), (32, 256, 2048),
               (2048, 512, 16), (2048, 16, 512), (256, 512, 2048), (1024, 1024, 128)]
ELEMENTWISE_SIZE = (2048, 1024)  # [N, C]: 8 MB in float32, past the caches of most cores
MPI_SIZES = [8, 64, 1024, 16384, 131072, 1 << 20, 1 << 22]
PROBE_TIMEOUT_S = 40

GemmTime = tuple[str, int, int, int, float]
"""(dtype, m, n, k, seconds) of one measured GEMM."""


class ComputeProbe(TypedDict):
    """What the compute probe measured (probe_compute; JSON between the processes)."""

    gemm: list[GemmTime]
    peak: dict[str, float]  # dtype -> the best GEMM rate, FLOP/s
    call_s: float  # one layer function on tiny inputs
    bandwidth: float  # bytes/s of the elementwise layer functions
    optimizer_passes: float


class NetworkProbe(TypedDict):
    """What the MPI probe measured (probe_mpi): all-reduce seconds by payload bytes."""

    sizes: list[int]
    seconds: list[float]


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = subparsers.add_parser("calibrate", help="measure this machine and write a sim profile",
                              description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="profile TOML to write")
    p.add_argument("--ranks", type=int, default=2, help="MPI ranks of the communication probe")
    p.add_argument("--name", default="cpu-local", help="profile name")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.ranks < 2:
        raise UserError(f"--ranks must be at least 2 to measure communication, got {args.ranks}")
    out = Path(args.out)
    if out.parent and not out.parent.exists():
        raise UserError(f"directory of --out {out} does not exist")
    started = time.perf_counter()
    compute = cast(ComputeProbe, _run_probe([sys.executable, "-m", "boostmpi.sim.calibrate", "--probe-compute"],
                                            "compute"))
    mpiexec = find_mpiexec()
    network = cast(NetworkProbe, _run_probe([mpiexec, "-n", str(args.ranks), sys.executable, "-m",
                                             "boostmpi.sim.calibrate", "--probe-mpi"], "MPI"))
    profile = build_profile(args.name, compute, network, args.ranks)
    from boostmpi.sim.machines import machine_from_file, machine_to_toml

    header = (f"# Measured by `boostmpi calibrate --ranks {args.ranks}` on {os.uname().nodename} "
              f"in {time.perf_counter() - started:.0f} s.\n# One device = one MPI rank on one core, "
              "single-threaded NumPy. docs/SIM.md explains each key.\n")
    write_file_atomically(out, header + machine_to_toml(profile, _NOTES))
    machine_from_file(out)  # what we wrote must read back
    print(f"wrote {out}: float64 {profile.peak_flops['float64'] / 1e9:.1f} GFLOP/s, "
          f"float32 {profile.peak_flops['float32'] / 1e9:.1f} GFLOP/s, elementwise "
          f"{profile.memory_bandwidth / 1e9:.1f} GB/s, MPI all-reduce {profile.intra_node_latency * 1e6:.1f} us + "
          f"{profile.intra_node_bandwidth / 1e9:.2f} GB/s")
    return 0


_NOTES = {
    "peak_flops": "best single-thread NumPy GEMM rate measured",
    "gemm_k_overhead": "fitted to the measured thin-k GEMMs",
    "gemm_mn_overhead": "fitted to the measured thin-m/n GEMMs",
    "memory_bandwidth": "nominal traffic of boostmpi's elementwise layers / their measured time",
    "kernel_launch_s": "mean time of boostmpi's elementwise layer functions on tiny inputs",
    "optimizer_passes": "measured time of boostmpi's AdamW step x bandwidth / buffer bytes",
    "intra_node_bandwidth": "fitted ring all-reduce bandwidth between local MPI ranks",
    "intra_node_latency": "fitted ring all-reduce step latency",
    "inter_node_bandwidth": "not measured: same as intra-node",
}


def _run_probe(command: list[str], what: str) -> object:
    """Run one probe under `timeout`; it writes JSON to the file named last on its command line."""
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "probe.json"
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        timeout = shutil.which("timeout")
        full = ([timeout, str(PROBE_TIMEOUT_S)] if timeout else []) + command + [str(result_path)]
        try:
            done = subprocess.run(full, env=env, capture_output=True, text=True,
                                  timeout=PROBE_TIMEOUT_S + 10)
        except subprocess.TimeoutExpired:
            raise UserError(f"the {what} probe did not finish in {PROBE_TIMEOUT_S} s") from None
        if done.returncode != 0 or not result_path.exists():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise UserError(f"the {what} probe failed (exit {done.returncode}): {last}")
        return json.loads(result_path.read_text())


# ------------------------------------------------------------------ fitting the profile
def build_profile(name: str, compute: ComputeProbe, network: NetworkProbe, ranks: int) -> "Machine":
    from dataclasses import replace

    from boostmpi.sim.machines import Machine

    cores = os.cpu_count() or 1
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / cores
    except (ValueError, OSError, AttributeError):
        memory = 4 * 2**30
    latency, bandwidth = fit_allreduce(network["sizes"], network["seconds"], ranks)
    base = Machine(name=name, description=f"{cores}-core CPU, one single-threaded NumPy rank per core",
                   device="cpu", memory_capacity_bytes=float(memory),
                   memory_bandwidth=compute["bandwidth"], elementwise_efficiency=1.0,
                   peak_flops={"float64": compute["peak"]["float64"], "float32": compute["peak"]["float32"]},
                   gemm_efficiency=1.0, gemm_tile_m=1, gemm_tile_n=1, gemm_k_overhead=0.0,
                   gemm_mn_overhead=0.0, compute_units=1, attention="matmul",
                   kernel_launch_s=compute["call_s"], optimizer_passes=compute["optimizer_passes"],
                   gpus_per_node=cores, intra_node_bandwidth=bandwidth, intra_node_latency=latency,
                   inter_node_bandwidth=bandwidth, inter_node_latency=latency)
    k0, c0 = fit_gemm_overheads(base, compute["gemm"])
    return replace(base, gemm_k_overhead=k0, gemm_mn_overhead=c0)


def fit_gemm_overheads(machine: "Machine", measured: Sequence[GemmTime | tuple[str, int, int, int, float, int]]
                       ) -> tuple[float, float]:
    """Grid search of (k0, c0) minimising the squared log error of the model's GEMM times.
    `measured`: (dtype, m, n, k, seconds) or (dtype, m, n, k, seconds, batch) entries."""
    from dataclasses import replace

    from boostmpi.sim.costs import ITEMSIZE, gemm_seconds

    grid = [0.0] + [2.0 ** i for i in range(0, 11)]
    best: tuple[float, float, float] | None = None
    for k0 in grid[machine.device == "gpu":]:  # a GPU's split-K choice divides by k0
        for c0 in grid:
            trial = replace(machine, gemm_k_overhead=k0, gemm_mn_overhead=c0)
            err = sum((math.log(gemm_seconds(m, n, k, (batch or [1])[0], ITEMSIZE[dt], trial, dt)) - math.log(t)) ** 2
                      for dt, m, n, k, t, *batch in measured)
            if best is None or err < best[0]:
                best = (err, k0, c0)
    assert best is not None  # the grid is not empty
    return best[1], best[2]


def fit_allreduce(sizes: Sequence[int], seconds: Sequence[float], ranks: int) -> tuple[float, float]:
    """(step latency, bandwidth) of the ring model t = 2(p-1) a + 2(p-1)/p n / bw, relative errors."""
    import numpy as np

    p = ranks
    t = np.asarray(seconds, dtype=float)
    n = np.asarray(sizes, dtype=float)
    design = np.stack([np.full_like(n, 2 * (p - 1)), 2 * (p - 1) / p * n], axis=1) / t[:, None]
    (alpha, inv_bw), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    alpha = max(alpha, 1e-7)
    if inv_bw <= 0:  # all sizes latency-bound: take the largest message's rate
        inv_bw = t[-1] / (2 * (p - 1) / p * n[-1])
    return float(alpha), float(1.0 / inv_bw)


# ------------------------------------------------------------------ the probes (child processes)
def _best_time(fn: Callable[[], object], min_total: float = 0.08, max_reps: int = 200) -> float:
    """Smallest CPU time of one call, repeating until about `min_total` seconds were spent.

    CPU time of this (single-threaded) process, not wall time: on a shared machine other processes
    take the core for whole time slices, which wall time would count and the minimum over a few
    repetitions does not reliably filter out.
    """
    fn()  # warm up: allocations, page faults, BLAS initialisation
    best, spent, reps = float("inf"), 0.0, 0
    while (spent < min_total or reps < 3) and reps < max_reps:
        start = time.process_time()
        fn()
        elapsed = time.process_time() - start
        best, spent, reps = min(best, elapsed), spent + elapsed, reps + 1
    return best


def probe_compute() -> ComputeProbe:
    import numpy as np

    from boostmpi.config import config_from_dict
    from boostmpi.model import layers
    from boostmpi.model.params import FlatBuffer, param_specs
    from boostmpi.train.optim import AdamW

    rng = np.random.default_rng(0)
    gemm: list[GemmTime] = []
    peak: dict[str, float] = {}
    for dtype in ("float64", "float32"):
        for m, n, k in GEMM_SHAPES:
            a = rng.standard_normal((m, k)).astype(dtype)
            b = rng.standard_normal((k, n)).astype(dtype)
            out = np.empty((m, n), dtype=dtype)
            t = _best_time(lambda: np.matmul(a, b, out=out))
            gemm.append((dtype, m, n, k, t))
            peak[dtype] = max(peak.get(dtype, 0.0), 2.0 * m * n * k / t)

    # nominal passes of each layer kernel, as the model counts them (plans.norm, operations.unary / binary);
    # at a tiny size the same kernels give the fixed cost of one model "kernel" (Python + NumPy calls)
    rates: list[float] = []
    call_s = 0.0  # measured in the last (tiny) round
    for dtype, size in (("float64", ELEMENTWISE_SIZE), ("float32", ELEMENTWISE_SIZE), ("float32", (4, 8))):
        x = rng.standard_normal(size).astype(dtype)
        u = rng.standard_normal(size).astype(dtype)
        w = np.ones(size[1], dtype=dtype)
        dw = np.zeros_like(w)
        y, rstd = layers.rmsnorm_forward(x, w, 1e-6)
        kernels = [(lambda: layers.rmsnorm_forward(x, w, 1e-6), 2),
                   (lambda: layers.rmsnorm_backward(y, x, w, rstd, dw), 5),
                   (lambda: layers.silu_forward(x), 2), (lambda: layers.silu_backward(y, x), 3),
                   (lambda: layers.gate_forward(x, u, True), 3),
                   (lambda: layers.gate_backward(y, x, u, True), 5),
                   (lambda: layers.gate_forward(x, u, False), 3),
                   (lambda: layers.gate_backward(y, x, u, False), 5)]
        if size != ELEMENTWISE_SIZE:
            call_s = sum(_best_time(fn, min_total=0.01, max_reps=500) for fn, _ in kernels) / len(kernels)
            continue
        seconds = sum(_best_time(fn) for fn, _ in kernels)
        nominal = sum(passes for _, passes in kernels) * x.size * x.itemsize
        rates.append(nominal / seconds)
    bandwidth = sum(rates) / len(rates)

    # the engine's own AdamW on a ~4M-parameter flat buffer
    cfg = config_from_dict({"model": {"d_model": 512, "n_layers": 2, "vocab_size": 4096, "n_heads": 8,
                                      "arch": "cola"}})
    specs = param_specs(cfg)
    params, grads = FlatBuffer(specs, np.float32), FlatBuffer(specs, np.float32)
    grads.data[:] = rng.standard_normal(grads.size)
    opt = AdamW(params, specs, cfg.train)
    step_s = _best_time(lambda: opt.step(grads, 1e-3), min_total=0.3)
    optimizer_passes = step_s * bandwidth / (params.size * 4)
    return {"gemm": gemm, "peak": peak, "call_s": call_s, "bandwidth": bandwidth,
            "optimizer_passes": optimizer_passes}


def probe_mpi() -> NetworkProbe | None:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    sizes: list[int] = []
    seconds: list[float] = []
    for nbytes in MPI_SIZES:
        send = np.ones(max(1, nbytes // 8))
        recv = np.empty_like(send)
        reps = max(5, min(500, (1 << 24) // max(nbytes, 1)))
        best = float("inf")
        for _ in range(5):  # the best of several trials: other processes share this machine's cores
            comm.Barrier()
            start = time.process_time()  # CPU time, as in _best_time: MPICH polls while it waits
            for _ in range(reps):
                comm.Allreduce(send, recv, op=MPI.SUM)
            elapsed = comm.allreduce((time.process_time() - start) / reps, op=MPI.MAX)
            best = min(best, elapsed)
        sizes.append(send.nbytes)
        seconds.append(best)
    return {"sizes": sizes, "seconds": seconds} if comm.Get_rank() == 0 else None


def _probe_main(argv: Sequence[str]) -> None:
    kind, out = argv[0], Path(argv[-1])
    result = probe_compute() if kind == "--probe-compute" else probe_mpi()
    if result is not None:
        write_file_atomically(out, json.dumps(result))


if __name__ == "__main__":
    _probe_main(sys.argv[1:])
