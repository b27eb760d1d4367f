"""Reading a checkpoint while its run prunes it: a reader (eval, export) returns one complete checkpoint's
values or stops with one line, never NaN. The race is made deterministic by the readers' injection point
(BOOSTMPI_TEST_READER_PAUSE): the reader stops at a named stage while the test prunes or deletes the
folder, then goes on. Also the pins' staleness rules."""

import contextlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from boostmpi.checkpoint import held, pins
from boostmpi.checkpoint.runs import prune
from boostmpi.cli import main
from boostmpi.config import config_from_dict
from boostmpi.data.shards import write_shard
from boostmpi.errors import CheckpointError
from boostmpi.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run with checkpoints at steps 2 and 4: (run dir, shard, the eval JSON of step 2 untouched, its config)."""
    root = tmp_path_factory.mktemp("live")
    shard = root / "text.bin"
    write_shard(shard, np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 60, dtype=np.uint8))
    cfg = config_from_dict({
        "model": {"arch": "cola", "vocab_size": 128, "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                  "rank": 8, "d_ff": 64, "seq_len": 16},
        "train": {"run_dir": str(root / "run"), "steps": 4, "micro_batch_size": 2, "warmup_steps": 1},
        "data": {"train": str(shard), "val": str(shard)}, "checkpoint": {"every": 2}})
    Trainer(cfg, out=io.StringIO()).train()
    step2 = root / "run" / "checkpoints" / "step_00000002"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["eval", str(step2), "--data", str(shard)]) == 0
    return root / "run", shard, json.loads(out.getvalue()), cfg


def _env(**extra):
    return dict(os.environ, PYTHONPATH=str(REPO), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", **extra)


def _paused(tmp_path, stage, action, *argv):
    """Run `boostmpi ARGV` until its reader reaches `stage`, call `action()`, let it go on; its result."""
    go = tmp_path / f"go-{stage}"
    reader = subprocess.Popen([sys.executable, "-m", "boostmpi", *map(str, argv)], cwd=REPO,
                              env=_env(BOOSTMPI_TEST_READER_PAUSE=f"{stage}:{go}"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not Path(f"{go}.reached").exists():
        assert reader.poll() is None, f"the reader ended without stopping at {stage}: {reader.communicate()}"
        assert time.monotonic() < deadline, "the reader never reached its stage"
        time.sleep(0.02)
    try:
        action()
    finally:
        go.touch()
    out, err = reader.communicate(timeout=60)
    return reader.returncode, out, err


def _copy_run(run_dir, dest):
    shutil.copytree(run_dir, dest)
    return dest, dest / "checkpoints" / "step_00000002"


def test_pruning_keeps_a_checkpoint_a_reader_holds_and_the_reader_gets_its_values(run, tmp_path):
    run_dir, shard, reference, _ = run
    _, folder = _copy_run(run_dir, tmp_path / "run")
    said = []
    status, out, err = _paused(tmp_path, "verified", lambda: prune([str(folder)], False, said.append),
                               "eval", folder, "--data", shard)
    assert status == 0, err
    assert json.loads(out) == reference
    assert folder.is_dir() and "a reader holds it" in said[0], said
    assert not pins.live_pins(folder)  # the reader let go: the next save prunes it
    prune([str(folder)], False)
    assert not folder.exists()


def test_a_checkpoint_deleted_while_read_is_read_whole_from_its_open_files(run, tmp_path):
    """A folder removed by hand (no pin respected) after the reader opened its files."""
    run_dir, shard, reference, _ = run
    _, folder = _copy_run(run_dir, tmp_path / "run")
    status, out, err = _paused(tmp_path, "verified", lambda: shutil.rmtree(folder), "eval", folder, "--data", shard)
    assert status == 0, err
    assert json.loads(out) == reference and "NaN" not in out


def test_a_checkpoint_deleted_before_its_files_are_opened_is_one_line(run, tmp_path):
    run_dir = run[0]
    _, folder = _copy_run(run_dir, tmp_path / "run")
    out_file = tmp_path / "model.safetensors"
    status, out, err = _paused(tmp_path, "pinned", lambda: shutil.rmtree(folder),
                               "export", folder, "--to", "h5", "--out", out_file)
    assert status == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "step_00000002" in lines[0], err
    assert not out_file.exists()


def test_a_run_directory_whose_newest_checkpoint_was_pruned_before_the_pin_is_resolved_again(run, tmp_path,
                                                                                           monkeypatch):
    """Between `resolve` naming the newest checkpoint and the reader pinning it, a save published a newer
    one and pruned it: the reader takes the newest again. A step folder named by itself is one line."""
    run_dir = run[0]
    mine, step2 = _copy_run(run_dir, tmp_path / "run")
    step4 = mine / "checkpoints" / "step_00000004"
    answers = [str(step2)]  # what resolve saw a moment before step_00000002 was pruned
    real = held.resolve
    monkeypatch.setattr(held, "resolve", lambda path: answers.pop() if answers else real(path))
    prune([str(step2)], False)
    with held.hold(mine) as reader:
        assert reader.dir == str(step4) and reader.step == 4
    with pytest.raises(CheckpointError, match="does not exist"):
        held.hold(step2)


def test_a_run_resuming_from_another_runs_checkpoint_holds_it_while_its_ranks_read_it(run, tmp_path, monkeypatch):
    from boostmpi.train import trainer

    run_dir = run[0]
    _, step2 = _copy_run(run_dir, tmp_path / "other")
    said, real_load = [], trainer.ckpt.load

    def load_while_the_other_run_prunes(path, *args, **kwargs):
        prune([path], False, said.append)  # the other run's save, at this moment
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(trainer.ckpt, "load", load_while_the_other_run_prunes)
    cfg = run[3].replace(**{"train.run_dir": str(tmp_path / "mine"), "train.steps": 3})
    result = Trainer(cfg, resume=str(step2), out=io.StringIO()).train()
    assert result["step"] == 3 and np.isfinite(result["loss"])
    assert step2.is_dir() and "a reader holds it" in said[0], said
    assert not pins.live_pins(step2)


def _pin_file(folder, host, pid, age_s):
    path = Path(folder) / f"{pins.PIN_PREFIX}{host}-{pid}-{int(age_s)}{pins.PIN_SUFFIX}"
    path.write_text(json.dumps({"host": host, "pid": pid, "time": "then"}))
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path.name


def test_pins_of_dead_or_silent_readers_are_stale(tmp_path):
    here = socket.gethostname()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], stdout=subprocess.PIPE,
                          text=True).stdout.strip()
    folder = tmp_path / "step_00000001"
    folder.mkdir()
    assert pins.live_pins(folder) == []
    live = [_pin_file(folder, here, os.getpid(), 1), _pin_file(folder, "node-elsewhere", 1, 1)]
    _pin_file(folder, here, int(dead), 1)  # its reader is gone
    _pin_file(folder, "node-gone", 1, pins.LEASE_S + 5)  # not renewed for longer than the lease
    _pin_file(folder, here, os.getpid(), pins.LEASE_S + 5)
    assert pins.live_pins(folder) == sorted(live)
    assert not pins.claim_for_pruning(folder) and not (folder / pins.CLAIM).exists()
    for name in live:
        (folder / name).unlink()
    assert pins.claim_for_pruning(folder) and (folder / pins.CLAIM).exists()


def test_a_reader_that_finds_a_pruners_claim_waits_and_then_stops_in_one_line(tmp_path):
    import threading

    folder = tmp_path / "step_00000001"
    folder.mkdir()
    assert pins.claim_for_pruning(folder)  # the pruner came first: it renames the folder a moment later
    renamer = threading.Timer(0.3, lambda: os.rename(folder, tmp_path / ".step_00000001.tmp-pruned"))
    renamer.start()
    with pytest.raises(CheckpointError, match="was removed .pruned by its run, checkpoint.keep"):
        pins.Pin(folder).acquire()
    renamer.join()
    assert not list((tmp_path / ".step_00000001.tmp-pruned").glob(pins.PIN_PREFIX + "*"))


def test_a_claim_left_by_a_dead_pruner_does_not_block_readers(tmp_path):
    folder = tmp_path / "step_00000001"
    folder.mkdir()
    (folder / pins.CLAIM).write_text(json.dumps({"host": socket.gethostname(), "pid": 2**22 + 12345, "time": "then"}))
    with pins.Pin(folder) as pin:
        assert pins.live_pins(folder) == [os.path.basename(pin.path)]
    assert pins.live_pins(folder) == [] and not (folder / pins.CLAIM).exists()
