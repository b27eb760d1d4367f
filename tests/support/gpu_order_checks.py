"""Checks of the stream-order tracking and of NCCL's ring order, run under mpiexec by tests/emulators/cupy_standin/test_stream_order.py.

    python tests/support/gpu_order_checks.py ring [round-once]      (4 ranks)
    python tests/support/gpu_order_checks.py pp2 [skip-p2p-wait]    (2 ranks)
    python tests/support/gpu_order_checks.py tp2-mpi [no-mpi-sync]  (2 ranks)
    python tests/support/gpu_order_checks.py pp2-dp2-zero1          (4 ranks)
    python tests/support/gpu_order_checks.py single [warp-32-reduction]  (one process, no MPI)

`ring`: bfloat16 and float16 all-reduces and reduce-scatters of a group of 4 through the project's
NcclGroup on the CuPy stand-in equal, bit for bit, a step-by-step simulation of NCCL's ring (every
member holds its buffer, each step moves one chunk to the next member, which adds its own part and
rounds); stay within p-1 roundings of the exact sum; and differ from a sum rounded once (so a
stand-in that rounds once fails). Then a dp=4 bf16 training step equals the single-rank GPU step
within tests/integration/gpu/test_gpu.py's bf16 tolerance.
`pp2`, `tp2-mpi`: a training step of the engine (a 2-stage pipeline over NCCL's send/receive
channels; tensor parallelism over CUDA-aware MPI), full rank in float32 and CoLA in bf16, with the
stand-in's order tracking on (on whichever device BOOSTMPI_STANDIN_GPU names); `pp2-dp2-zero1`:
three bf16 training steps with every kind of stream the engine has busy at once.

`single`: single-rank GPU steps against the CPU float64 step, on whichever device
BOOSTMPI_STANDIN_GPU names (tests/integration/gpu/test_gpu.py runs it at 64 lanes with a kernel reduction made
for 32: the 64-lane run must catch it, the 32-lane one cannot).

A second argument puts a mutant into this process before the check: the source text of one module
is changed and executed again in place of the module. Rank 0 prints `ok` when every check passed;
a failure prints the rank's traceback and ends every rank (exit status non-zero).
"""

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
# (module, file, text, replacement): one change each, which the check must notice
MUTANTS = {
    "round-once": ("cupy.cuda.nccl", None,
                   "total = fn(total.astype(work), parts[member, lo:hi].astype(work)).astype(dt)",
                   "total = fn(total.astype(work), parts[member, lo:hi].astype(work))"),
    "skip-p2p-wait": ("boostmpi.parallel.nccl", "boostmpi/parallel/nccl.py",
                      "        stream.wait_event(_Event(self._stream()).event)\n        return comm, stream",
                      "        return comm, stream"),
    "no-mpi-sync": ("boostmpi.parallel.startup", "boostmpi/parallel/startup.py",
                    "sync = lambda: xp.cuda.get_current_stream().synchronize()  # noqa: E731",
                    "sync = None"),
    # kernel text (every kernel's source as the loader assembles it): a warp reduction for 32 lanes
    "warp-32-reduction": ("boostmpi.gpu.kernels", "kernels/common.cuh",
                          "for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1)",
                          "for (int offset = 16; offset > 0; offset >>= 1)"),
}


def mutate(name):
    """Replace the module of MUTANTS[name] by its source with the one change made (exactly once)."""
    import importlib

    module_name, path, text, replacement = MUTANTS[name]
    module = importlib.import_module(module_name)
    path = Path(module.__file__) if path is None else ROOT / path
    source = path.read_text()
    if source.count(text) != 1:
        raise AssertionError(f"mutant {name}: the text to change occurs {source.count(text)} times in {path}")
    if path.suffix == ".py":
        exec(compile(source.replace(text, replacement), str(path), "exec"), module.__dict__)
        return
    real = module.kernel_source  # a kernel header: the source the loader hands the compiler, changed
    module.kernel_source = lambda kernel: real(kernel).replace(text, replacement)


# ---------------------------------------------------------------- NCCL's ring, simulated
def simulate_ring_allreduce(contributions, dtype):
    """NCCL's ring all-reduce, member by member: contributions [p, n] in `dtype`; returns [p, n]."""
    p, n = contributions.shape
    bounds = [(c * n // p, (c + 1) * n // p) for c in range(p)]
    held = [row.copy() for row in contributions]  # what each member's buffer holds
    wide = np.float32 if dtype.itemsize == 2 else dtype
    # reduce-scatter: at step j (1..p-1) member r sends chunk (r - j) mod p to r+1, which adds its own
    # part of that chunk to it (in float32 for 16-bit types) and stores the result, rounded
    for j in range(1, p):
        messages = [(r, (r - j) % p) for r in range(p)]
        sent = [(c, held[r][bounds[c][0]:bounds[c][1]].copy()) for r, c in messages]
        for r, (c, data) in enumerate(sent):
            to, (lo, hi) = (r + 1) % p, bounds[c]
            held[to][lo:hi] = (data.astype(wide) + held[to][lo:hi].astype(wide)).astype(dtype)
    # member c now holds the whole sum of chunk c; all-gather passes it around unchanged
    out = np.empty((p, n), dtype)
    for c, (lo, hi) in enumerate(bounds):
        out[:, lo:hi] = held[c][lo:hi]
    return out


def _ring_checks(group, rank, size):
    import cupy
    import ml_dtypes

    rng = np.random.default_rng(7)
    n = 1037  # not a multiple of 4: chunks of unequal length
    for dtype, unit in ((np.dtype(ml_dtypes.bfloat16), 2.0 ** -8), (np.dtype(np.float16), 2.0 ** -11)):
        values = (rng.standard_normal((size, n)) * 2.0 ** rng.integers(-3, 4, (size, n))).astype(dtype)
        buf = cupy.array(values[rank])
        if dtype == np.float16:  # the engine moves no float16: the communicator directly
            from cupy.cuda import nccl

            group.nccl_comm.allReduce(buf.data.ptr, buf.data.ptr, n, nccl.NCCL_FLOAT16, nccl.NCCL_SUM,
                                      cupy.cuda.get_current_stream().ptr)
        else:
            group.allreduce(buf)
        got = buf.get()
        want = simulate_ring_allreduce(values, dtype)[rank]
        exact = values.astype(np.float64).sum(0)
        once = values.astype(np.float32).sum(0).astype(dtype)
        assert got.tobytes() == want.tobytes(), \
            f"{dtype}: {np.count_nonzero(got != want)} of {n} elements differ from NCCL's ring order"
        bound = (size - 1) * unit * np.abs(values.astype(np.float64)).sum(0)
        err = np.abs(got.astype(np.float64) - exact)
        assert (err <= bound).all(), f"{dtype}: error {err.max():.3g} beyond {size - 1} roundings"
        assert np.count_nonzero(got != once) > n // 20, f"{dtype}: the ring sum equals the sum rounded once"
        gathered = group.comm.allgather(got.tobytes())
        assert len(set(gathered)) == 1, f"{dtype}: members got different bits"
        if dtype == np.float16:
            continue
        # reduce-scatter (one rooted reduce per member: one chain from root+1 around to the root)
        counts = [n // size + (r < n % size) for r in range(size)]
        start = sum(counts[:rank])
        out = cupy.empty(counts[rank], dtype=dtype)
        group.reduce_scatter(cupy.array(values[rank]), out, counts)
        chain = [(rank + k) % size for k in range(1, size + 1)]
        mine = slice(start, start + counts[rank])
        piece = values[chain[0], mine]
        for member in chain[1:]:
            piece = (piece.astype(np.float32) + values[member, mine].astype(np.float32)).astype(dtype)
        assert out.get().tobytes() == piece.tobytes(), f"{dtype}: reduce-scatter differs from NCCL's chain order"


def _dp4_step_matches_single_rank(world):
    """bf16 gradients summed over a dp group of 4 (p-1 = 3 roundings per sum) hold test_gpu's tolerance."""
    from tests.support.gpu_steps import batches, config
    from tests.integration.gpu.test_gpu import assert_step_close

    from boostmpi.backend import to_numpy
    from boostmpi.parallel.engine import Engine
    from tests.support.global_tensors import gather_global

    micro = batches(n_micro=4)
    eng = Engine(config("cola", "gpu", "bfloat16", dict(dp=4)), world, local_rank=world.Get_rank())
    loss = eng.forward_backward([micro[eng.grid.coords.dp]])
    grads = gather_global(eng, eng.grads)
    if world.Get_rank() != 0:
        return
    from mpi4py import MPI

    alone = Engine(config("cola", "gpu", "bfloat16"), None, local_rank=0)
    want_loss = alone.forward_backward(micro)
    want = {s.name: to_numpy(alone.grads[s.name]).astype(np.float64) for s in alone.specs}
    assert MPI.COMM_WORLD.Get_size() == 4
    assert_step_close((loss, {k: v.astype(np.float64) for k, v in grads.items()}), (want_loss, want), "bfloat16",
                      "dp=4 bf16 step")


def ring(world):
    from boostmpi.parallel.comm import CommCounter
    from boostmpi.parallel.nccl import NcclGroup, select_device

    rank, size = world.Get_rank(), world.Get_size()
    assert size == 4, "the ring check runs on 4 ranks"
    select_device(rank)
    group = NcclGroup("dp", world.Dup(), CommCounter())
    _ring_checks(group, rank, size)
    _dp4_step_matches_single_rank(world)


def device_dtype(dtype):
    """`dtype`, or float32 for bfloat16 on ROCm, where start-up refuses bfloat16 (boostmpi/backend.py)."""
    import cupy

    return "float32" if dtype == "bfloat16" and getattr(cupy.cuda.runtime, "is_hip", False) else dtype


def engine_step(world, layout):
    from tests.support.gpu_steps import step

    parallel = {"pp2": dict(pp=2), "tp2-mpi": dict(tp=2, comm="mpi")}[layout]
    for arch, dtype in (("full", "float32"), ("cola", "bfloat16")):
        step(arch, "gpu", device_dtype(dtype), parallel, world=world)


def single_rank_steps():
    """Full rank and CoLA, float32 and bf16 (float32 only on ROCm), one GPU step each against the CPU
    float64 step."""
    from tests.support.gpu_steps import step
    from tests.integration.gpu.test_gpu import assert_step_close

    for arch in ("full", "cola"):
        want = step(arch, "cpu", "float64")
        for dtype in dict.fromkeys(map(device_dtype, ("float32", "bfloat16"))):
            assert_step_close(step(arch, "gpu", dtype), want, dtype, f"{arch} {dtype}")


def training_steps(world):
    """pp=2 x dp=2, ZeRO-1, bf16: three steps of four micro-batches (1F1B with sends in both directions
    in flight, gradients reduce-scattered on the side stream, the compute buffer all-gathered)."""
    from tests.support.gpu_steps import MODEL, config

    from boostmpi.parallel.engine import Engine
    from boostmpi.train.optim import AdamW
    from boostmpi.train.trainer import optimizer_step

    cfg = config("cola", "gpu", "bfloat16", dict(pp=2, dp=2, zero_stage=1), dict(lr=0.01))
    engine = Engine(cfg, world, local_rank=world.Get_rank())
    optimizer = AdamW(engine.params, engine.specs, cfg.train, engine.xp, shard=engine.shard, master=engine.master)
    rng = np.random.default_rng(engine.grid.coords.dp)
    for _ in range(3):
        tokens = rng.integers(0, MODEL["vocab_size"], (4, 2, MODEL["seq_len"] + 1))
        engine.forward_backward([(t[:, :-1], t[:, 1:]) for t in tokens])
        optimizer_step(engine, optimizer, 0.01, 1.0)


def main(check, mutant=None):
    if mutant:
        mutate(mutant)
    if check == "single":  # one process, no MPI
        single_rank_steps()
        print("ok")
        return
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if check == "ring":
        ring(world)
    elif check == "pp2-dp2-zero1":
        training_steps(world)
    else:
        engine_step(world, check)
    world.Barrier()
    if world.Get_rank() == 0:
        print("ok")


if __name__ == "__main__":
    from tests.support.gpu_steps import run_or_abort

    if sys.argv[1] == "single":
        main(*sys.argv[1:])
    else:
        run_or_abort(main, *sys.argv[1:])
