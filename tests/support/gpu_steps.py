"""One training step of a tiny model on the GPU path, for tests/integration/gpu/test_gpu.py, in-process or across ranks.

`step(...)` builds an Engine and returns (loss, {name: global gradient as float64}) on world rank 0
(None elsewhere). Run as a script under mpiexec (`python tests/support/gpu_steps.py OUT.npz`), it runs
every multi-rank layout of `LAYOUTS` for every arch and dtype and rank 0 writes the results to
OUT.npz; a rank that fails aborts the job (MPI_Abort), so the caller sees a non-zero exit and
every rank's traceback instead of a hang.
"""

import sys
import time
import traceback

import numpy as np

MODEL = dict(vocab_size=61, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, rank=16, seq_len=16)
ARCHS = ("full", "svd", "cola")
DTYPES = ("float32", "bfloat16")
B = 2
# (name, ranks, parallel settings, train settings); two micro-batches per step on every layout
LAYOUTS = [
    ("tp2", 2, dict(tp=2), {}),
    ("tp2-pp2", 4, dict(tp=2, pp=2), {}),
    ("tp2-dp2", 4, dict(tp=2, dp=2), {}),
    ("tp2-dp2-no-overlap", 4, dict(tp=2, dp=2, overlap=False), {}),
    ("tp2-pp2-lowrank", 4, dict(tp=2, pp=2), dict(recompute="lowrank")),
    # the choices besides the defaults: Megatron TP applied to each factor, the RMSNorm statistic
    # in an all-reduce of its own, and MPI carrying the device buffers (CUDA-aware MPI) instead of NCCL
    ("tp2-vanilla", 2, dict(tp=2, tp_mode="vanilla"), {}),
    ("tp2-sync-norm", 2, dict(tp=2, norm="sync"), {}),
    ("tp2-pp2-mpi", 4, dict(tp=2, pp=2, comm="mpi"), {}),
]


def layout_archs(name, train):
    """The archs a layout runs: low-rank ones only where it concerns the bottleneck (full rank always
    runs Megatron TP, whose norm is not online), all three otherwise."""
    if train.get("recompute") == "lowrank" or name in ("tp2-vanilla", "tp2-sync-norm"):
        return tuple(a for a in ARCHS if a != "full")
    return ARCHS


def batches(n_micro=2):
    x = np.random.default_rng(0).integers(0, MODEL["vocab_size"], (n_micro, B, MODEL["seq_len"] + 1))
    return [(m[:, :-1], m[:, 1:]) for m in x]


def config(arch, device, dtype, parallel=None, train=None):
    """The tiny model's configuration; train.attention is "own" unless `train` names another."""
    from boostmpi.config import config_from_dict

    parallel = dict(parallel or {})
    if arch == "full":  # full rank runs Megatron TP, which the config spells tp_mode = "vanilla"
        parallel.setdefault("tp_mode", "vanilla")
    return config_from_dict({"model": dict(MODEL, arch=arch), "parallel": parallel,
                             "train": {"device": device, "dtype": dtype, "micro_batch_size": B, "attention": "own",
                                       **(train or {})}})


def step(arch, device, dtype, parallel=None, train=None, world=None):
    from boostmpi.parallel.engine import Engine
    from tests.support.global_tensors import gather_global

    cfg = config(arch, device, dtype, parallel, train)
    # one node: the local rank is the world rank, so each rank has its own (emulated) GPU
    local_rank = 0 if world is None else _world_rank()
    eng = Engine(cfg, world, local_rank=local_rank)
    if device == "gpu" and world is not None and eng.grid.use_nccl != (cfg.parallel.comm != "mpi"):
        raise AssertionError(f"a multi-rank GPU run with parallel.comm = {cfg.parallel.comm!r} "
                             f"{'did not choose' if cfg.parallel.comm != 'mpi' else 'chose'} NCCL")
    micro = batches()
    if cfg.parallel.dp > 1:  # data-parallel rank r takes micro-batch r: the same global batch
        micro = [micro[eng.grid.coords.dp]]
    loss = eng.forward_backward(micro)
    if world is None:
        from boostmpi.backend import to_numpy

        return loss, {s.name: to_numpy(eng.grads[s.name]).astype(np.float64) for s in eng.specs}
    grads = gather_global(eng, eng.grads)
    return None if grads is None else (loss, {k: v.astype(np.float64) for k, v in grads.items()})


def _world_rank():
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


def _run_layouts(out_path, names=None, dtypes=None, attention=None, cases=None):
    """Every layout of LAYOUTS (or those named, comma-separated) in every dtype (or those named), with
    train.attention = `attention` when given; `cases`, comma-separated LAYOUT/ARCH pairs: only those."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    results = {}
    for name, ranks, parallel, train in LAYOUTS:
        if ranks > world.Get_size() or (names and name not in names.split(",")):
            continue
        color = world.Get_rank() // ranks
        comm = world.Split(color, world.Get_rank())
        for arch in layout_archs(name, train):
            if cases and f"{name}/{arch}" not in cases.split(","):
                continue
            for dtype in (dtypes.split(",") if dtypes else DTYPES):
                settings = dict(train, attention=attention) if attention else train
                got = step(arch, "gpu", dtype, parallel, settings, world=comm) if color == 0 else None
                if got is not None:
                    loss, grads = got
                    results[f"{name}/{arch}/{dtype}/loss"] = np.float64(loss)
                    for k, v in grads.items():
                        results[f"{name}/{arch}/{dtype}/grad/{k}"] = v
        comm.Free()
    if world.Get_rank() == 0:
        np.savez(out_path, **results)
    world.Barrier()


def run_or_abort(main, *args):
    """`main(*args)` on every rank; a failure prints the rank's traceback and ends every rank (MPI_Abort)."""
    try:
        main(*args)
    except BaseException:  # noqa: BLE001 - any failure ends every rank, never a hang
        from mpi4py import MPI

        sys.stderr.write(f"rank {MPI.COMM_WORLD.Get_rank()}: {traceback.format_exc()}")
        sys.stderr.flush()
        # Hydra's proxy may end before it forwards what a rank wrote just before MPI_Abort (a test read
        # an empty stderr once on a loaded machine): give it a moment to take the report first
        time.sleep(1)
        MPI.COMM_WORLD.Abort(1)


if __name__ == "__main__":
    run_or_abort(_run_layouts, *sys.argv[1:6])
