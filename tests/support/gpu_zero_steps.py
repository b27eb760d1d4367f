"""ZeRO-1 under GPU mixed precision, across ranks through the NCCL stand-in (tests/integration/gpu/test_gpu.py).

Run as `mpiexec -n 4 python tests/support/gpu_zero_steps.py RUN_DIR`: a tp=2 x dp=2 bf16 model trains a few
steps with zero_stage 0, with zero_stage 1 (gradients reduce-scattered on NCCL's side stream, the bf16
compute buffer all-gathered) and with zero_stage 1 without overlap (the blocking reduce-scatter); the
zero_stage 1 run checkpoints and is loaded back under zero_stage 1 and 0. Every check is gathered to
rank 0, which prints `ok` or the failures; any exception aborts the job (MPI_Abort).
"""

import os
import sys

import numpy as np

from tests.support.global_tensors import gather_global
from tests.support.gpu_steps import MODEL, config, run_or_abort

STEPS, LR = 3, 0.01


def train(comm, zero, overlap=True):
    from boostmpi.parallel.engine import Engine
    from boostmpi.train.optim import AdamW
    from boostmpi.train.trainer import optimizer_step

    cfg = config("cola", "gpu", "bfloat16", dict(tp=2, dp=2, zero_stage=zero, overlap=overlap), dict(lr=LR))
    engine = Engine(cfg, comm, local_rank=comm.Get_rank())
    assert engine.grid.use_nccl, "a multi-rank GPU run did not choose NCCL"
    optimizer = AdamW(engine.params, engine.specs, cfg.train, engine.xp, shard=engine.shard, master=engine.master)
    rng = np.random.default_rng(engine.grid.coords.dp)
    losses = []
    for _ in range(STEPS):
        tokens = rng.integers(0, MODEL["vocab_size"], (2, MODEL["seq_len"] + 1))
        losses.append(engine.forward_backward([(tokens[:, :-1], tokens[:, 1:])]))
        optimizer_step(engine, optimizer, LR, 1.0)
    return cfg, engine, optimizer, losses


def gathered(engine, buffer):
    from boostmpi.backend import to_numpy
    from boostmpi.model.params import FlatBuffer

    host = FlatBuffer(engine.specs, np.float64, np, data=to_numpy(buffer.data).astype(np.float64))
    return gather_global(engine, host)


def main(run_dir):
    from mpi4py import MPI

    from boostmpi import checkpoint as ckpt
    from boostmpi.model.params import FlatBuffer

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    failures = []
    runs = {}
    for name, zero, overlap in (("zero0", 0, True), ("zero1", 1, True), ("zero1-blocking", 1, False)):
        cfg, engine, optimizer, losses = train(comm, zero, overlap)
        engine._refresh_compute_params()  # zero_stage 0 rounds its master weights at the next step's start
        runs[name] = (cfg, engine, optimizer, losses, gathered(engine, engine.cparams))
    cfg1, e1, o1, _, _ = runs["zero1"]
    # the master weights are this rank's slice only, in float32; the compute weights whole, in bf16
    lo, hi = e1.shard
    if not (e1.master_separate and e1.master.size == hi - lo < e1.params.size and e1.master.dtype == np.float32
            and o1.master is e1.master and e1.params.data.dtype.itemsize == 2
            and e1.param_bytes == e1.master.nbytes + e1.params.data.nbytes
            and o1.nbytes == 2 * e1.master.nbytes):
        failures.append(f"rank {rank}: zero_stage=1 bf16 holds master {e1.master.size} of {e1.params.size} elements "
                        f"({e1.master.dtype}), param_bytes {e1.param_bytes}")
    # checkpoint of the zero_stage 1 run (master slices) loaded under zero_stage 1 and 0
    state = {"data": {}, "layout": {}} if rank == 0 else None
    folder = ckpt.save(os.path.join(run_dir, "run"), STEPS, cfg1, [ckpt.rank_state(e1, o1)], o1.t, state, comm=comm)
    masters = {}
    for zero in (1, 0):
        cfg, engine, optimizer, _ = train(comm, zero)
        buffer = engine.master_buffer()
        ckpt.load(folder, engine.specs, buffer, optimizer, engine.xp)
        engine.adopt_master(buffer)
        from boostmpi.backend import to_numpy

        if zero == 1 and not (np.array_equal(to_numpy(engine.master), to_numpy(e1.master))
                              and np.array_equal(to_numpy(engine.params.data), to_numpy(e1.params.data))
                              and np.array_equal(to_numpy(optimizer.m), to_numpy(o1.m))):
            failures.append(f"rank {rank}: zero_stage=1 did not load back exactly what it saved")
        full = FlatBuffer(engine.specs, np.float64, np, data=to_numpy(buffer.data).astype(np.float64))
        masters[zero] = gather_global(engine, full)
    if rank == 0:
        ref_losses, ref_params = runs["zero0"][3], runs["zero0"][4]
        for name in ("zero1", "zero1-blocking"):
            losses, params = runs[name][3], runs[name][4]
            if losses != ref_losses:
                failures.append(f"{name}: losses {losses} != zero_stage=0 {ref_losses}")
            for k, v in ref_params.items():
                if not np.array_equal(params[k], v):
                    failures.append(f"{name}: bf16 weights {k} differ from zero_stage=0 by "
                                    f"{np.abs(params[k] - v).max():.3g}")
        for k in masters[1]:
            if not np.array_equal(masters[1][k], masters[0][k]):
                failures.append(f"master weights {k} read differently under zero_stage 1 and 0")
    everyone = comm.gather(failures, root=0)
    # the zero_stage 0 run's fp32 master weights are whole: they must equal what the checkpoint holds
    ref = gathered(runs["zero0"][1], runs["zero0"][1].params)
    if rank == 0:
        failures = [f for fs in everyone for f in fs]
        for k, v in ref.items():
            if not np.array_equal(masters[0][k], v):
                failures.append(f"checkpointed master {k} differs from the zero_stage=0 master weights")
        print("\n".join(failures) if failures else "ok")
    comm.Barrier()


if __name__ == "__main__":
    run_or_abort(main, sys.argv[1])
