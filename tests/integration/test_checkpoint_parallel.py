"""Checkpoints written by every rank at once (run under `mpiexec -n N python -m pytest --with-mpi`):
each rank writes its own file, nobody gathers a global tensor, model.h5 and optim.h5 read with plain
h5py as the global tensors (virtual datasets over the rank files, by relative name, so a copied folder
reads the same), a rank that fails mid-save leaves the previous checkpoint in charge, and loading reads
back exactly what was saved, under ZeRO-1 too."""

import os
import shutil

import h5py
import numpy as np
import pytest

from boostmpi import checkpoint as ckpt
from boostmpi.config import config_from_dict
from boostmpi.errors import CheckpointError
from boostmpi.model.params import FlatBuffer
from boostmpi.parallel.engine import Engine
from boostmpi.train.optim import AdamW
from boostmpi.train.trainer import optimizer_step
from tests.support.checkpoint_stages import at_stage
from tests.support.global_tensors import gather_global
from tests.support.mpi_helpers import abort_on_error, assert_all_ranks, on_root, world

pytestmark = pytest.mark.mpi(min_size=2)

MODEL = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, attn_rank=8, mlp_rank=12, seq_len=8)


def layout(n):
    """tp, pp, dp for n ranks: a dp axis (ZeRO-1) wherever it fits, a tp axis at 4."""
    return {2: (1, 1, 2), 3: (1, 1, 3), 4: (2, 1, 2)}.get(n, (1, 1, n))


def trained_engine(run_dir, zero=1):
    comm = world()
    tp, pp, dp = layout(comm.Get_size())
    cfg = config_from_dict({"model": MODEL, "parallel": {"tp": tp, "pp": pp, "dp": dp, "zero_stage": zero},
                            "train": {"dtype": "float64", "micro_batch_size": 2, "run_dir": str(run_dir), "lr": 0.01}},
                           world_size=comm.Get_size())
    engine = Engine(cfg, comm)
    optimizer = AdamW(engine.params, engine.specs, cfg.train, shard=engine.shard)
    rng = np.random.default_rng(engine.grid.coords.dp)
    for _ in range(2):
        tokens = rng.integers(0, MODEL["vocab_size"], (2, MODEL["seq_len"] + 1))
        engine.forward_backward([(tokens[:, :-1], tokens[:, 1:])])
        optimizer_step(engine, optimizer, 0.01, 1.0)
    return cfg, engine, optimizer


def gathered_moment(engine, optimizer, which):
    """The global tensors of one moment: the dp slices gathered (test side), then the shards."""
    full = FlatBuffer(engine.specs, np.float64)
    lo, hi = optimizer.shard
    full.data[lo:hi] = getattr(optimizer, which)
    if engine.data_parallel.sharded:
        from mpi4py import MPI

        counts = [b - a for a, b in engine.data_parallel.ranges]
        engine.grid.dp.comm.Allgatherv(MPI.IN_PLACE, [full.data, counts, [a for a, _ in engine.data_parallel.ranges], MPI.DOUBLE])
    return gather_global(engine, full)


def save(cfg, engine, optimizer, step, **kwargs):
    state = {"data": {}, "layout": {}} if engine.grid.world_rank == 0 else None
    return ckpt.save(cfg.train.run_dir, step, cfg, [ckpt.rank_state(engine, optimizer)], optimizer.t, state,
                     comm=world(), **kwargs)


def saved_run(tmp_path):
    """(folder all ranks share, cfg, engine, optimizer, the checkpoint of step 2 they wrote)."""
    base = world().bcast(str(tmp_path) if world().Get_rank() == 0 else None, root=0)
    with abort_on_error():
        cfg, engine, optimizer = trained_engine(os.path.join(base, "run"))
        return base, cfg, engine, optimizer, save(cfg, engine, optimizer, 2)


def test_every_rank_writes_its_file_and_the_folder_reads_as_global_tensors_wherever_it_is(tmp_path):
    comm = world()
    base, cfg, engine, optimizer, folder = saved_run(tmp_path)
    with abort_on_error():
        params = gather_global(engine, engine.params)
        moments = {w: gathered_moment(engine, optimizer, w) for w in "mv"}
    tp, pp, dp = layout(comm.Get_size())

    def check():
        names = sorted(os.listdir(folder))
        ranks = sorted(ckpt.rank_file_name(t, s, d) for t in range(tp) for s in range(pp) for d in range(dp))
        assert names == sorted(["COMPLETE", "model.h5", "optim.h5", "state.json", *ranks]), names
        moved = os.path.join(base, "elsewhere", "copy")
        shutil.copytree(folder, moved)
        shutil.rmtree(folder)  # the copy must not read the original's files
        os.chdir(os.path.join(base, "elsewhere"))  # nor depend on the working directory
        ckpt.verify(moved)
        with h5py.File(os.path.join(moved, "model.h5"), "r") as f, h5py.File(os.path.join(moved, "optim.h5"), "r") as o:
            assert int(o.attrs["t"]) == 2
            for name, want in params.items():
                assert f[name].is_virtual and f[name].shape == want.shape
                np.testing.assert_array_equal(f[name][()], want, err_msg=name)
                for w in "mv":
                    np.testing.assert_array_equal(o[f"{w}/{name}"][()], moments[w][name], err_msg=f"{w}/{name}")
        return moved

    cwd = os.getcwd()
    try:
        moved = comm.bcast(on_root(check), root=0)
    finally:
        os.chdir(cwd)
    # every rank loads its own pieces back from the moved copy: exactly what it held
    with abort_on_error():
        fresh_cfg, fresh, fresh_opt = trained_engine(os.path.join(base, "run2"))
        step, _ = ckpt.load(moved, fresh.specs, fresh.params, fresh_opt)
    ok = (step == 2 and np.array_equal(fresh.params.data, engine.params.data)
          and np.array_equal(fresh_opt.m, optimizer.m) and np.array_equal(fresh_opt.v, optimizer.v))
    assert_all_ranks(ok, "a rank did not get back exactly what it saved")


class SimulatedCrash(Exception):
    pass


def test_a_rank_failing_mid_save_leaves_the_previous_checkpoint_in_charge(tmp_path):
    comm = world()
    _, cfg, engine, optimizer, previous = saved_run(tmp_path)

    def crash(stage):
        if stage == "rank file" and comm.Get_rank() == 1:
            raise SimulatedCrash("rank 1 failed after writing its file")

    failure = None
    try:
        with at_stage(crash):
            save(cfg, engine, optimizer, 3)
    except CheckpointError as exc:
        failure = str(exc)
    assert_all_ranks(failure is not None and "SimulatedCrash" in failure and "unchanged" in failure,
                     f"every rank must report the failure, got {failure!r}")

    def check():
        root = ckpt.checkpoints_dir(cfg.train.run_dir)
        assert sorted(os.listdir(root)) == ["latest", "step_00000002"]  # no temporary folder left
        assert ckpt.find_latest(cfg.train.run_dir) == previous
        ckpt.verify(previous)

    on_root(check)
    with abort_on_error():
        step, _ = ckpt.load(previous, engine.specs, engine.params, optimizer)
    assert_all_ranks(step == 2, "the previous checkpoint does not load")
