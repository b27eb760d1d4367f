"""Checkpoints end to end (docs/FORMATS.md): model.h5 readable with plain h5py at the documented names
and global shapes, the round trip into a fresh engine, exact resume (bit-identical losses and
weights), atomic writes under a simulated crash, `keep` pruning, and damaged files refused by name.

Every run is the tiny config (configs/tiny.toml) on a little real text."""

import importlib.util
import json
import shutil

import h5py
import numpy as np
import pytest

from boostmpi import checkpoint as ckpt
from boostmpi.checkpoint import writer
from boostmpi.cli import main
from boostmpi.config import SECTIONS, load_config
from boostmpi.parallel.engine import Engine
from boostmpi.train.trainer import Trainer
from tests.support.checkpoint_stages import at_stage
from tests.support.global_tensors import save_global
from tests.support.train_helpers import (TINY_CONFIG, assert_refused, file_digests, h5_datasets, read_metrics, reproducible,
                           run_train, stop_signals_restored, write_text_shards)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_text_shards(tmp_path_factory.mktemp("text"), max_bytes=60_000)


def step_dir(run_dir, step):
    return run_dir / "checkpoints" / f"step_{step:08d}"


def contract_shapes(m):
    """name -> global shape of every tensor of model.h5, written out from docs/FORMATS.md."""
    d, V, kv = m["d_model"], m["vocab_size"], m["n_kv_heads"] * (m["d_model"] // m["n_heads"])
    dims = {"q": (d, d), "k": (d, kv), "v": (d, kv), "o": (d, d),
            "gate": (d, m["d_ff"]), "up": (d, m["d_ff"]), "down": (m["d_ff"], d)}
    shapes = {"embed": (V, d), "final_norm": (d,), "lm_head": (d, V)}
    for i in range(m["n_layers"]):
        shapes[f"layers/{i}/attn_norm"] = shapes[f"layers/{i}/mlp_norm"] = (d,)
        for name, (d_in, d_out) in dims.items():
            if m["arch"] == "full":
                shapes[f"layers/{i}/{name}/W"] = (d_in, d_out)
            else:
                r = m["attn_rank"] if name in ("q", "k", "v", "o") else m["mlp_rank"]
                shapes[f"layers/{i}/{name}/A"] = (d_in, r)
                shapes[f"layers/{i}/{name}/B"] = (r, d_out)
    return shapes


@pytest.mark.parametrize("arch", ["full", "svd", "cola"])
def test_model_h5_is_plain_hdf5_at_contract_names_and_global_shapes(arch, shards, tmp_path):
    run_dir = tmp_path / "run"
    # attn_rank != mlp_rank, so that a factor with the wrong rank key would show in its shape
    assert run_train(run_dir, *shards, f"model.arch={arch}", "model.mlp_rank=12", "train.steps=2") == 0
    folder = step_dir(run_dir, 2)
    # one process writes one rank file; model.h5 and optim.h5 are virtual datasets over it
    assert sorted(p.name for p in folder.iterdir()) == ["COMPLETE", "model.h5", "optim.h5", "rank-tp0-pp0-dp0.h5",
                                                        "state.json"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == folder.name

    with h5py.File(folder / "model.h5", "r") as f:
        assert f.attrs["format"] == "boostmpi"
        assert int(f.attrs["format_version"]) == 1
        assert int(f.attrs["step"]) == 2
        config = json.loads(f.attrs["config"])
    assert set(config) == set(SECTIONS) == {"model", "parallel", "train", "data", "checkpoint"}
    assert config == load_config(run_dir / "config.toml").to_dict()  # the full resolved configuration
    assert config["model"]["arch"] == arch

    tensors = h5_datasets(folder / "model.h5")
    assert {name: t.shape for name, t in tensors.items()} == contract_shapes(config["model"])
    assert all(np.isfinite(t).all() for t in tensors.values())
    for i in range(config["model"]["n_layers"]):  # the norms were trained away from their initial ones
        assert not np.array_equal(tensors[f"layers/{i}/attn_norm"], np.ones(config["model"]["d_model"]))


def test_round_trip_into_a_fresh_engine_gives_the_same_weights_and_loss(shards, tmp_path, capfd):
    run_dir = tmp_path / "run"
    overrides = [f"train.run_dir={run_dir}", f"data.train={shards[0]}", f"data.val={shards[1]}",
                 "train.steps=3", "train.val_windows=8"]
    cfg = load_config(TINY_CONFIG, overrides=overrides)
    with stop_signals_restored():
        trainer = Trainer(cfg)
        trainer.train()
    x, y = trainer.val_x, trainer.val_y

    fresh = Engine(cfg)
    assert fresh.evaluate(x, y) != trainer.engine.evaluate(x, y)  # the untrained weights differ
    with h5py.File(step_dir(run_dir, 3) / "model.h5", "r") as f:
        ckpt.read_params(f, fresh.specs, fresh.params)
    assert np.array_equal(fresh.params.data, trainer.engine.params.data)
    assert fresh.evaluate(x, y) == trainer.engine.evaluate(x, y)

    if importlib.util.find_spec("boostmpi.tools.evaluate") is None:
        pytest.skip("boostmpi eval is not there yet")
    # `boostmpi eval` over the validation windows, batched as the trainer's validation, gives its number
    capfd.readouterr()
    B = cfg.train.micro_batch_size
    assert main(["eval", str(run_dir), "--data", str(shards[1]), "--max-windows", "8", "--batch-size", str(B)]) == 0
    result = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
    assert result["loss"] == read_metrics(run_dir)[-1]["val_loss"]
    assert result["tokens"] == 8 * cfg.model.seq_len


def assert_same_checkpoint(a, b):
    """Bit-identical model.h5 and optim.h5 tensors, Adam step count and data position."""
    for name in ("model.h5", "optim.h5"):
        ta, tb = h5_datasets(a / name), h5_datasets(b / name)
        assert ta.keys() == tb.keys()
        for key in ta:
            assert ta[key].dtype == tb[key].dtype and np.array_equal(ta[key], tb[key]), f"{name}:{key} differs"
    with h5py.File(a / "optim.h5", "r") as fa, h5py.File(b / "optim.h5", "r") as fb:
        assert int(fa.attrs["t"]) == int(fb.attrs["t"])
    assert ckpt.read_state(a)["data"] == ckpt.read_state(b)["data"]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_resume_is_exact(dtype, shards, tmp_path):
    settings = (f"train.dtype={dtype}", "train.steps=20", "checkpoint.every=10", "train.val_every=5",
                "train.val_windows=4", "train.warmup_steps=3")
    straight = tmp_path / "straight"
    assert run_train(straight, *shards, *settings) == 0
    rows = reproducible(read_metrics(straight))
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert dtype in str(h5_datasets(step_dir(straight, 20) / "model.h5")["embed"].dtype)

    # --resume from the straight run's step 10, into a new run directory
    resumed = tmp_path / "resumed"
    assert run_train(resumed, *shards, *settings, resume=step_dir(straight, 10)) == 0
    assert reproducible(read_metrics(resumed)) == rows[10:]
    assert_same_checkpoint(step_dir(straight, 20), step_dir(resumed, 20))

    # a run that died after step 15 (metrics written, last checkpoint at 10), started again with the
    # same command: it resumes from `latest` by itself and drops the rows that it writes again
    crashed = tmp_path / "crashed"
    shutil.copytree(straight, crashed)
    shutil.rmtree(step_dir(crashed, 20))
    (crashed / "checkpoints" / "latest").write_text("step_00000010\n")
    lines = (crashed / "metrics.jsonl").read_text().splitlines(keepends=True)
    (crashed / "metrics.jsonl").write_text("".join(lines[:15]))
    assert run_train(crashed, *shards, *settings) == 0
    assert reproducible(read_metrics(crashed)) == rows
    assert_same_checkpoint(step_dir(straight, 20), step_dir(crashed, 20))


class SimulatedCrash(Exception):
    pass


@pytest.mark.parametrize("stage", ["model.h5", "marker"])
def test_a_failure_mid_write_leaves_the_previous_checkpoint_in_charge(stage, shards, tmp_path, capfd):
    run_dir = tmp_path / "run"
    assert run_train(run_dir, *shards, "train.steps=2") == 0
    previous, folder = step_dir(run_dir, 2), run_dir / "checkpoints"
    names_before, before = {p.name for p in folder.iterdir()}, file_digests(folder)

    def crash_at(where):
        if where == stage:
            raise SimulatedCrash(where)

    cfg = load_config(run_dir / "config.toml")
    model = h5_datasets(previous / "model.h5")
    optim = h5_datasets(previous / "optim.h5")
    moments = tuple({k.split("/", 1)[1]: v for k, v in optim.items() if k.startswith(f"{which}/")} for which in "mv")
    with pytest.raises(SimulatedCrash), at_stage(crash_at):
        save_global(str(run_dir), 3, cfg, model, moments, 3, ckpt.read_state(previous))

    # the failed write took its temporary folder with it; everything that was there before is untouched
    assert {p.name for p in folder.iterdir()} == names_before
    assert file_digests(folder) == before
    assert ckpt.find_latest(str(run_dir)) == str(previous)

    # training again resumes from the previous checkpoint and writes step 3 in full
    capfd.readouterr()
    assert run_train(run_dir, *shards, "train.steps=3") == 0
    assert f"resumed from {previous} (step 2)" in capfd.readouterr().out
    assert ckpt.find_latest(str(run_dir)) == str(step_dir(run_dir, 3))


def test_an_unfinished_checkpoint_folder_is_never_loaded(shards, tmp_path, capfd):
    run_dir = tmp_path / "run"
    assert run_train(run_dir, *shards, "train.steps=2") == 0
    # a later step's folder holding every file but the completion marker, and `latest` naming it
    unfinished = step_dir(run_dir, 9)
    shutil.copytree(step_dir(run_dir, 2), unfinished)
    (unfinished / "COMPLETE").unlink()
    (run_dir / "checkpoints" / "latest").write_text(unfinished.name + "\n")

    assert ckpt.find_latest(str(run_dir)) == str(step_dir(run_dir, 2))
    assert_refused(capfd, ["train", "--config", str(TINY_CONFIG), "--set", f"train.run_dir={tmp_path / 'other'}",
                           "--set", f"data.train={shards[0]}", "--set", f"data.val={shards[1]}",
                           "--resume", str(unfinished)],
                   tmp_path, str(unfinished), "incomplete")


def test_keep_prunes_all_but_the_newest_checkpoints(shards, tmp_path):
    run_dir = tmp_path / "run"
    assert run_train(run_dir, *shards, "train.steps=5", "checkpoint.every=1", "checkpoint.keep=2") == 0
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_00000004", "step_00000005"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000005"
    assert run_train(run_dir, *shards, "train.steps=7", "checkpoint.every=1", "checkpoint.keep=2") == 0
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_00000006", "step_00000007"]


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_one_bit(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [truncate, flip_one_bit], ids=["truncated", "bit-flipped"])
def test_a_damaged_model_h5_is_refused_by_name(damage, shards, tmp_path, capfd):
    run_dir = tmp_path / "run"
    assert run_train(run_dir, *shards, "train.steps=2") == 0
    model_h5 = step_dir(run_dir, 2) / "model.h5"
    damage(model_h5)

    # resuming the run by itself (from `latest`), and explicitly into another run directory
    same_run = ["train", "--config", str(TINY_CONFIG), "--set", f"train.run_dir={run_dir}", "--set", "train.steps=4",
                "--set", f"data.train={shards[0]}", "--set", f"data.val={shards[1]}"]
    assert_refused(capfd, same_run, tmp_path, model_h5)
    other_run = [a.replace(str(run_dir), str(tmp_path / "other")) for a in same_run]
    assert_refused(capfd, other_run + ["--resume", str(step_dir(run_dir, 2))], tmp_path, model_h5)
    assert not (tmp_path / "other").exists()

    if importlib.util.find_spec("boostmpi.tools.evaluate") is None:
        pytest.skip("boostmpi eval is not there yet")
    assert_refused(capfd, ["eval", str(run_dir), "--data", str(shards[1])], tmp_path, model_h5)


def set_format_version(folder, version):
    """Checkpoint `folder`'s model.h5 given `format_version = version`, its COMPLETE record updated to
    match: the checkpoint as a boostmpi of that format would have written it."""
    model = folder / "model.h5"
    with h5py.File(model, "r+") as f:
        f.attrs["format_version"] = version
    marker = json.loads((folder / ckpt.MARKER).read_text())
    marker["model.h5"] = {"bytes": model.stat().st_size, ckpt.Checksum.name: ckpt.file_digest(str(model))}
    (folder / ckpt.MARKER).write_text(json.dumps(marker))


def test_a_checkpoint_of_a_newer_format_is_refused_in_one_line_and_an_older_one_reads(shards, tmp_path, capfd):
    """format_version above FORMAT_VERSION: resuming (from `latest` or with --resume into another run
    directory), `inspect` and `eval` each refuse it in one line naming model.h5, its version and the one
    this build reads, exit 2, nothing changed. An equal or older version reads as before."""
    run_dir = tmp_path / "run"
    assert run_train(run_dir, *shards, "train.steps=2") == 0
    folder = step_dir(run_dir, 2)
    newer = ckpt.FORMAT_VERSION + 1
    set_format_version(folder, newer)
    fragments = (folder / "model.h5", f"format version {newer}", f"version {ckpt.FORMAT_VERSION}, the newest")
    same_run = ["train", "--config", str(TINY_CONFIG), "--set", f"train.run_dir={run_dir}", "--set", "train.steps=4",
                "--set", f"data.train={shards[0]}", "--set", f"data.val={shards[1]}"]
    assert_refused(capfd, same_run, tmp_path, *fragments)
    other_run = [a.replace(str(run_dir), str(tmp_path / "other")) for a in same_run]
    assert_refused(capfd, other_run + ["--resume", str(folder)], tmp_path, *fragments)
    assert not (tmp_path / "other").exists()
    assert_refused(capfd, ["inspect", str(folder)], tmp_path, *fragments)
    assert_refused(capfd, ["eval", str(run_dir), "--data", str(shards[1])], tmp_path, *fragments)

    for version in (ckpt.FORMAT_VERSION, ckpt.FORMAT_VERSION - 1):
        set_format_version(folder, version)
        assert main(["inspect", str(folder)]) == 0
    assert run_train(run_dir, *shards, "train.steps=3") == 0
    assert f"resumed from {folder} (step 2)" in capfd.readouterr().out


def test_resuming_from_an_older_checkpoint_moves_the_later_ones_aside(shards, tmp_path, capfd):
    """A run that goes on from step 2 of a run that reached step 6 must write its own steps 4 and 6:
    the old ones are moved aside (kept, never loaded), and `latest` names what the new run wrote."""
    run_dir, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    assert run_train(run_dir, *shards, "train.steps=6", "checkpoint.every=2") == 0
    old = {step: file_digests(step_dir(run_dir, step)) for step in (4, 6)}
    old_rows = read_metrics(run_dir)
    shutil.copytree(step_dir(run_dir, 2), tmp_path / "copy" / "checkpoints" / "step_00000002")

    capfd.readouterr()
    assert run_train(run_dir, *shards, "train.steps=6", "checkpoint.every=2", "train.lr=0.01",
                     resume=step_dir(run_dir, 2)) == 0
    out = capfd.readouterr().out
    aside = [p for p in root.iterdir() if p.name.startswith("abandoned-")]
    assert len(aside) == 1, sorted(p.name for p in root.iterdir())
    assert f"step_00000004, step_00000006 and 4 metrics rows of the abandoned timeline are moved to {aside[0]}" in out
    assert {step: file_digests(aside[0] / f"step_{step:08d}") for step in (4, 6)} == old
    assert [json.loads(line) for line in (aside[0] / "metrics.jsonl").read_text().splitlines()] == old_rows[2:]

    # every checkpoint the log announces holds this run's state, and `latest` names its last one
    assert (root / "latest").read_text().strip() == "step_00000006"
    for step in (4, 6):
        assert f"checkpoint {step_dir(run_dir, step)}" in out
        with h5py.File(step_dir(run_dir, step) / "model.h5", "r") as f:
            assert json.loads(f.attrs["config"])["train"]["lr"] == 0.01
    # the same continuation run elsewhere (from a copy of step 2) ends with the same weights
    assert run_train(tmp_path / "copy", *shards, "train.steps=6", "checkpoint.every=2", "train.lr=0.01") == 0
    assert_same_checkpoint(step_dir(run_dir, 6), step_dir(tmp_path / "copy", 6))
    assert reproducible(read_metrics(run_dir))[2:] == reproducible(read_metrics(tmp_path / "copy"))


def test_async_save_writes_the_checkpoints_of_a_synchronous_one(shards, tmp_path):
    settings = ("train.dtype=float64", "train.steps=6", "checkpoint.every=2")
    sync, asynchronous = tmp_path / "sync", tmp_path / "async"
    assert run_train(sync, *shards, *settings) == 0
    assert run_train(asynchronous, *shards, *settings, "checkpoint.async=true") == 0
    for step in (2, 4, 6):
        assert_same_checkpoint(step_dir(sync, step), step_dir(asynchronous, step))
        ckpt.verify(str(step_dir(asynchronous, step)))
    assert ckpt.find_latest(str(asynchronous)) == str(step_dir(asynchronous, 6))
    assert reproducible(read_metrics(asynchronous)) == reproducible(read_metrics(sync))
    # the snapshot is accounted: the bytes of the rank file (parameters and both moments of the whole local
    # buffer, one rank, and their HDF5 structure) in whole pages
    import mmap

    n = sum(t.size for t in h5_datasets(step_dir(sync, 6) / "model.h5").values())
    file_bytes = (step_dir(asynchronous, 6) / ckpt.rank_file_name(0, 0, 0)).stat().st_size
    assert file_bytes > 3 * 8 * n
    assert read_metrics(asynchronous)[-1]["memory"]["checkpoint_snapshot"] == -(-file_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
    assert read_metrics(sync)[-1]["memory"]["checkpoint_snapshot"] == 0


def test_a_failed_async_write_stops_the_run_with_the_previous_checkpoint_intact(shards, tmp_path, capfd, monkeypatch):
    import errno
    import os

    run_dir = tmp_path / "run"
    write = writer.write_file_image  # what an asynchronous save writes its snapshot with
    calls = []

    def fail_the_second(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        write(path, *args, **kwargs)

    monkeypatch.setattr(writer, "write_file_image", fail_the_second)
    capfd.readouterr()
    status = run_train(run_dir, *shards, "train.steps=6", "checkpoint.every=2", "checkpoint.async=true")
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith("error: cannot write checkpoint step_00000004 into") and "no space left" in err[0], err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_00000002"]
    assert ckpt.find_latest(str(run_dir)) == str(step_dir(run_dir, 2))
    ckpt.verify(str(step_dir(run_dir, 2)))


def test_a_save_reports_the_seconds_of_each_phase(tmp_path):
    """PendingSave.phases, read by bench/scale.py: the rank file's write (its checksum taken on the way),
    its fsync, the wait for the others, rank 0's virtual files and the publishing, each measured (> 0)
    and the checkpoint complete."""
    from boostmpi.train.optim import AdamW

    cfg = load_config(TINY_CONFIG, overrides=[f"train.run_dir={tmp_path / 'run'}"])
    engine = Engine(cfg)
    optimizer = AdamW(engine.params, engine.specs, cfg.train)
    pending = ckpt.PendingSave(cfg.train.run_dir, 1, cfg, [ckpt.rank_state(engine, optimizer)], 0, {"data": {}})
    pending.write()
    folder = pending.finish()
    assert ckpt.is_complete(folder)
    assert set(pending.phases) == {"write", "fsync", "wait", "virtual files", "publish"}
    assert all(seconds > 0 for seconds in pending.phases.values()), pending.phases


def test_a_rank_file_is_hashed_while_its_fsync_waits_for_the_disk(tmp_path, monkeypatch):
    """The checksum of a written file runs beside its fsync (CPU and disk at once), and is still its bytes'."""
    import xxhash
    import threading

    started, real_digest = threading.Event(), writer.file_digest
    monkeypatch.setattr(writer, "file_digest", lambda path: (started.set(), real_digest(path))[1])
    overlapped = []
    monkeypatch.setattr(writer, "fsync_file", lambda path: overlapped.append(started.wait(timeout=5)))
    path = tmp_path / "rank.h5"
    path.write_bytes(b"boost" * 1000)
    phases = {}
    record = writer.file_record(str(path), phases)
    assert overlapped == [True], "the hash did not start before the fsync returned"
    assert record == {"bytes": 5000, "xxh3_64": xxhash.xxh3_64(b"boost" * 1000).hexdigest()}
    assert set(phases) == {"fsync", "checksum"}
