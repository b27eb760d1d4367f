"""Bad input to `boostmpi train`: each case is one clear line on stderr (`error: ...`, printed once),
exit status 2, and no file changed — nothing written before the error, nothing existing altered.

Damaged and unfinished checkpoints are refused the same way; those cases live in test_checkpoint.py."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from boostmpi.data.shards import write_shard
from tests.support.train_helpers import REPO, assert_refused, file_digests, read_metrics, run_train, train_argv, write_text_shards


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_text_shards(tmp_path_factory.mktemp("text"), max_bytes=60_000)


# (--set overrides, fragments the message must hold): the configuration is refused before any work
BAD_SETTINGS = {
    "unknown key": (["model.d_modle=64"], ["model.d_modle", "model.d_model"]),  # with the suggestion
    "unknown section": (["modle.d_model=64"], ["[modle]"]),
    "wrong type": (["train.steps=ten"], ["train.steps", "integer"]),
    "wrong type, float for int": (["model.n_layers=2.5"], ["model.n_layers"]),
    "override without a value": (["train.steps"], ["train.steps"]),
    "d_model not divisible by n_heads": (["model.d_model=30"], ["model.d_model = 30", "model.n_heads = 4"]),
    "n_heads not divisible by n_kv_heads": (["model.n_kv_heads=3"], ["model.n_heads = 4", "model.n_kv_heads = 3"]),
    "rank zero": (["model.rank=0"], ["model.attn_rank", "model.rank"]),
    "rank negative": (["model.rank=-4"], ["model.attn_rank", "model.rank"]),
    # k and v map d_model 32 to n_kv_heads * head_dim = 16
    "rank above min(d_in, d_out)": (["model.rank=17"], ["model.attn_rank", "17", "16"]),
    "mlp rank above min(d_in, d_out)": (["model.mlp_rank=33"], ["model.mlp_rank", "33", "32"]),
    "odd head dim": (["model.d_model=36"], ["head dim", "9"]),
    "layout larger than the ranks started": (["parallel.tp=2"], ["parallel.tp", "1 MPI rank"]),
    "seed beyond 64 bits": (["train.seed=18446744073709551616"], ["train.seed", "does not fit in 64 bits"]),
    "a count beyond int64": (["train.steps=9223372036854775808"], ["train.steps", "does not fit in 64 bits"]),
    # refused from an estimate, before anything is allocated (the embedding alone would be 119 GiB)
    "vocabulary too large for memory": (["model.vocab_size=1000000000"],
                                        ["needs about", "GiB per rank", "of host memory here", "model.vocab_size"]),
}


@pytest.mark.parametrize("overrides,fragments", list(BAD_SETTINGS.values()), ids=list(BAD_SETTINGS))
def test_bad_configuration_is_refused_before_any_work(overrides, fragments, shards, tmp_path, capfd):
    run_dir = tmp_path / "run"
    assert_refused(capfd, train_argv(run_dir, *shards, *overrides), tmp_path, *fragments)
    assert not run_dir.exists()


BAD_FILES = {
    "unknown key": ("[model]\nd_model = 32\n\n[train]\nstepz = 3\n", ["train.stepz", "train.steps"]),
    "wrong type": ('[model]\nd_model = "32"\n', ["model.d_model", "integer"]),
    "unknown section": ("[modle]\nd_model = 32\n", ["[modle]"]),
    "key outside a section": ("d_model = 32\n", ["model.d_model"]),
    "not TOML": ("[model\nd_model = 32\n", ["bad.toml", "not valid TOML"]),
}


@pytest.mark.parametrize("text,fragments", list(BAD_FILES.values()), ids=list(BAD_FILES))
def test_bad_configuration_file_is_refused(text, fragments, shards, tmp_path, capfd):
    config = tmp_path / "bad.toml"
    config.write_text(text)
    assert_refused(capfd, train_argv(tmp_path / "run", *shards, config=config), tmp_path, *fragments)


def test_missing_configuration_file_is_refused(shards, tmp_path, capfd):
    missing = tmp_path / "nowhere.toml"
    assert_refused(capfd, train_argv(tmp_path / "run", *shards, config=missing), tmp_path, missing, "not found")


def write_bad_shard(folder, kind):
    """A file that must not be accepted as training or validation data; its path."""
    path = folder / f"{kind}.bin"
    if kind == "id_beyond_vocab":
        write_shard(path, np.r_[np.arange(200), 300, np.arange(200)])  # the tiny model has 256 ids
    elif kind == "shorter_than_a_window":
        write_shard(path, np.arange(16))  # one window needs seq_len + 1 = 17 tokens
    elif kind == "not_a_shard":
        path.write_text("print('hello')\n" * 200)
    elif kind == "truncated_shard":
        write_shard(path, np.arange(2000) % 256)
        path.write_bytes(path.read_bytes()[:-100])
    return path


@pytest.mark.parametrize("split", ["train", "val"])
@pytest.mark.parametrize("kind,fragments", [
    ("id_beyond_vocab", ["300", "256"]),
    ("shorter_than_a_window", ["seq_len + 1 = 17"]),
    ("not_a_shard", ["not an llm.c token shard"]),
    ("truncated_shard", ["truncated"]),
    ("missing", ["no token shards match"]),
])
def test_bad_data_is_refused_by_name(split, kind, fragments, shards, tmp_path, capfd):
    data = tmp_path / "data"
    data.mkdir()
    bad = write_bad_shard(data, kind)
    train, val = (bad, shards[1]) if split == "train" else (shards[0], bad)
    run_dir = tmp_path / "run"
    line = assert_refused(capfd, train_argv(run_dir, train, val), tmp_path, bad.name, *fragments)
    if kind == "shorter_than_a_window":  # the training stream counts windows, validation tokens
        assert ("holds 0 windows" if split == "train" else "holds 16 tokens") in line
    assert not run_dir.exists()


@pytest.mark.parametrize("left", [["train_000000.bin", "train_000001.bin"], ["train_000000.bin", "val_000000.bin"]])
def test_an_unfinished_data_set_is_refused(shards, tmp_path, capfd, left):
    """What an interrupted `boostmpi data` left behind before it wrote all at once: shards without the
    tokenizer record it writes last (and perhaps without a val shard)."""
    partial = tmp_path / "partial"
    partial.mkdir()
    tokens = np.fromfile(shards[0], dtype="<u2")[256 * 2:]
    for name in left:
        write_shard(partial / name, tokens[:5000])
    run_dir = tmp_path / "run"
    val = partial / "val_*.bin" if "val_000000.bin" in left else shards[1]
    missing = "no tokenizer.json" + ("" if "val_000000.bin" in left else ", no val shard")
    assert_refused(capfd, train_argv(run_dir, partial / "train_*.bin", val), tmp_path, partial, missing, "--force")
    assert not run_dir.exists()


def test_a_run_without_a_checkpoint_is_not_overwritten(shards, tmp_path, capfd):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    assert_refused(capfd, train_argv(run_dir, *shards), tmp_path, run_dir, "metrics.jsonl")


def _train_until_nan(run_dir, shards, tmp_path, steps):
    """`boostmpi train` with an absurd learning rate (no warm-up): float32 weights overflow within a few
    steps; the run must end with exit 2 and one line on stderr, which is returned."""
    argv = train_argv(run_dir, *shards, f"train.steps={steps}", "train.lr=1e30", "train.warmup_steps=0")
    env = dict(os.environ, PYTHONPATH=str(REPO), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "boostmpi", *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    return lines


def test_a_nan_loss_stops_with_one_line_and_keeps_the_last_checkpoint(shards, tmp_path):
    """In a fresh process, so that anything NumPy prints about the overflow shows on stderr too."""
    run_dir = tmp_path / "run"
    assert run_train(run_dir, *shards, "train.steps=2") == 0
    kept = file_digests(run_dir / "checkpoints")
    rows = read_metrics(run_dir)

    # an absurd learning rate (no warm-up) overflows float32 weights within a step after the resume
    lines = _train_until_nan(run_dir, shards, tmp_path, steps=8)
    assert lines[0].startswith("error: the loss became nan at step "), lines[0]
    diverged_at = int(lines[0].split("at step ")[1].split(";")[0])
    assert 3 < diverged_at <= 8
    assert "the last checkpoint, step_00000002, is kept intact" in lines[0], lines[0]

    # the checkpoint of step 2 is untouched and still the one to resume from; the steps that did
    # run before the divergence were logged after the existing rows
    assert file_digests(run_dir / "checkpoints") == kept
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    assert [r["step"] for r in read_metrics(run_dir)] == [r["step"] for r in rows] + list(range(3, diverged_at))
    assert read_metrics(run_dir)[: len(rows)] == rows


def test_a_nan_loss_before_any_checkpoint_says_there_is_none(shards, tmp_path):
    run_dir = tmp_path / "run"
    lines = _train_until_nan(run_dir, shards, tmp_path, steps=6)
    assert "no checkpoint was written yet" in lines[0] and "kept intact" not in lines[0], lines[0]
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").glob("step_*"))


def checkpoint_as_if_written_with(run_dir, step, **changes):
    """Rewrite checkpoint `step` of `run_dir` as if its run had been configured with `changes`."""
    from boostmpi import checkpoint as ckpt
    from boostmpi.config import load_config
    from tests.support.global_tensors import save_global
    from tests.support.train_helpers import h5_datasets

    folder = run_dir / "checkpoints" / f"step_{step:08d}"
    cfg = load_config(run_dir / "config.toml").replace(**changes)
    model, optim = h5_datasets(folder / "model.h5"), h5_datasets(folder / "optim.h5")
    moments = tuple({k.split("/", 1)[1]: v for k, v in optim.items() if k.startswith(f"{which}/")} for which in "mv")
    state = ckpt.read_state(folder)
    shutil.rmtree(folder)
    save_global(str(run_dir), step, cfg, model, moments, step, state)


def test_resuming_with_another_dp_that_would_change_the_global_batch_is_refused(shards, tmp_path, capfd):
    run_dir = tmp_path / "run"
    assert run_train(run_dir, *shards, "train.steps=2") == 0
    # the checkpoint of a run on dp = 2 ranks: 2 x 2 sequences per step; resumed here on dp = 1
    checkpoint_as_if_written_with(run_dir, 2, **{"parallel.dp": 2, "train.global_batch_size": 4})
    assert_refused(capfd, train_argv(run_dir, *shards, "train.steps=4"), run_dir / "checkpoints",
                   "parallel.dp = 1 instead of 2", "global batch from 4 to 2 sequences", "train.global_batch_size=4")
    # saying what the global batch is to be goes on, and says so
    assert run_train(run_dir, *shards, "train.steps=4", "train.global_batch_size=4") == 0
    out = capfd.readouterr().out
    assert "resumed from" in out and "global batch" not in out  # 4 = 2 x grad_accum 2 on dp 1: unchanged
    assert read_metrics(run_dir)[-1]["step"] == 4


def test_a_resume_over_a_cut_off_last_metrics_row_drops_it_and_says_so(shards, tmp_path, capfd):
    """A crash while step 3's row was written left half of it; every retry failed with a JSONDecodeError."""
    run_dir = tmp_path / "run"
    assert run_train(run_dir, *shards, "train.steps=2") == 0
    metrics_file = run_dir / "metrics.jsonl"
    whole = metrics_file.read_text()
    metrics_file.write_text(whole + '{"step": 3, "loss": 5.4')
    capfd.readouterr()
    assert run_train(run_dir, *shards, "train.steps=3") == 0
    out = capfd.readouterr().out
    assert f"dropped the last row of {metrics_file}: it was cut off" in out, out
    assert [row["step"] for row in read_metrics(run_dir)] == [1, 2, 3]
    # a damaged row that is not the last one is not guessed at: one line naming it
    lines = metrics_file.read_text().splitlines(keepends=True)
    metrics_file.write_text(lines[0] + "{not json\n" + "".join(lines[1:]))
    assert_refused(capfd, train_argv(run_dir, *shards, "train.steps=4"), run_dir, f"{metrics_file} line 2")


def test_a_gpu_run_without_cupy_is_one_line(shards, tmp_path, capfd, monkeypatch):
    """The memory check at start-up imported CuPy itself: a traceback where the device is checked."""
    from boostmpi import backend

    monkeypatch.setattr(backend, "_cupy", None)
    monkeypatch.setattr(backend, "_cupy_import_error", ImportError("No module named 'cupy'"))
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` fails, as where it is not installed
    assert_refused(capfd, train_argv(tmp_path / "run", *shards, "train.device=gpu"), tmp_path,
                   'train.device = "gpu" but CuPy is not importable', 'device = "cpu"')
    assert not (tmp_path / "run").exists()


def test_resuming_on_other_shards_says_to_start_a_new_run(shards, tmp_path, capfd):
    run_dir = tmp_path / "run"
    assert run_train(run_dir, *shards, "train.steps=2") == 0
    other = tmp_path / "other.bin"
    write_shard(other, np.asarray(np.fromfile(shards[0], dtype=np.uint16)[256 * 2:][:5000]))
    assert_refused(capfd, train_argv(run_dir, other, shards[1], "train.steps=4"), run_dir / "checkpoints",
                   "saved data position", "set a new train.run_dir", f"remove {run_dir}")


def run_boostmpi(*argv, cwd=REPO):
    env = dict(os.environ, PYTHONPATH=str(REPO), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "boostmpi", *map(str, argv)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_ctrl_c_while_a_command_is_imported_exits_130_without_a_traceback(monkeypatch, capfd):
    """Ctrl-C can come before the command runs: while its modules (NumPy, MPI, h5py) are imported."""
    import importlib

    from boostmpi import cli

    real = importlib.import_module

    def interrupted(name, *args, **kwargs):
        if name == cli.COMMANDS["sim"]:
            raise KeyboardInterrupt
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", interrupted)
    assert cli.main(["sim", "--help"]) == 130
    assert "Traceback" not in capfd.readouterr().err


def test_help_goes_to_stdout_with_a_line_per_command_and_exits_0():
    from boostmpi.cli import COMMANDS

    for argv in (["--help"], ["-h"], ["help"]):
        done = run_boostmpi(*argv)
        assert done.returncode == 0 and done.stderr == "", (argv, done.stderr)
        lines = done.stdout.splitlines()
        for name in COMMANDS:  # each command on a line of its own, with what it does
            line = next((line for line in lines if line.split()[:1] == [name]), None)
            assert line is not None and len(line.split()) > 2, (name, done.stdout)
        assert "exit status" in done.stdout
    done = run_boostmpi("train", "--help")
    assert done.returncode == 0 and "Train the configured model" in done.stdout and "75 stopped early" in done.stdout
    assert "(`python -m boostmpi.config` prints them all" in " ".join(done.stdout.split())  # the keys, FORMATS.md's
    done = run_boostmpi("generate", "--help")
    assert done.returncode == 0 and "keeps its last" in " ".join(done.stdout.split())
    done = run_boostmpi("nosuch")
    assert done.returncode == 2 and done.stderr.startswith("error: unknown command 'nosuch'")
    assert len(done.stderr.splitlines()) == 1


# ---------------------------------------------------------------- filesystem errors: one line, exit 2

def test_a_run_dir_that_is_a_file_or_below_a_file_is_refused(shards, tmp_path, capfd):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder\n")
    assert_refused(capfd, train_argv(a_file, *shards), tmp_path, "train.run_dir", str(a_file), "is a file, not a folder")
    below = a_file / "runs" / "x"
    assert_refused(capfd, train_argv(below, *shards), tmp_path, "train.run_dir", str(below), "cannot be created",
                   f"{a_file} is a file, not a folder")


def test_a_run_dir_on_a_read_only_filesystem_is_refused(shards, tmp_path):
    from tests.support.train_helpers import run_on_a_private_tmpfs

    mount = tmp_path / "ro"
    mount.mkdir()
    argv = " ".join(f"'{a}'" for a in train_argv(mount / "run", *shards))
    done = run_on_a_private_tmpfs(mount, "ro,size=1m", f"exec {sys.executable} -m boostmpi {argv}",
                                  env=dict(os.environ, PYTHONPATH=str(REPO), OPENBLAS_NUM_THREADS="1"))
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0] == f"error: train.run_dir {mount / 'run'} is on a read-only filesystem ({mount})", lines[0]


# ---------------------------------------------------------------- the other commands' bad input

@pytest.fixture(scope="module")
def trained(shards, tmp_path_factory):
    """A run directory with checkpoints of steps 1 and 2."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    assert run_train(run_dir, *shards, "train.steps=2", "checkpoint.every=1") == 0
    return run_dir


def test_generate_refuses_a_seed_numpy_cannot_take(trained, tmp_path, capfd):
    for seed in ("-1", str(2**64)):
        assert_refused(capfd, ["generate", str(trained), "--prompt", "def ", "--seed", seed], trained,
                       "--seed must be between 0 and 2**64 - 1", seed)


def test_a_latest_that_is_not_utf8(trained, shards, tmp_path, capfd):
    """Named itself it is refused, naming what it holds; through the run directory it reads as no valid
    name, like a stale one: the newest complete checkpoint is used (eval, and train resumes)."""
    import shutil

    from boostmpi.cli import main

    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    latest = run_dir / "checkpoints" / "latest"
    latest.write_bytes(b"\xff\xfestep_\x80\n")
    assert_refused(capfd, ["eval", str(latest), "--data", str(shards[1])], run_dir, str(latest),
                   "does not name a checkpoint folder")
    capfd.readouterr()
    assert main(["eval", str(run_dir), "--data", str(shards[1]), "--max-windows", "2"]) == 0
    assert '"step": 2' in capfd.readouterr().out
    assert run_train(run_dir, *shards, "train.steps=3", "checkpoint.every=1") == 0
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000002'} (step 2)" in capfd.readouterr().out


def test_sim_sweep_over_a_huge_device_count_answers_at_once(tmp_path, capfd):
    """10**12 devices: the layouts come from the count's 169 divisors, found in a million steps, not
    10**12; none fits the tiny model's batch, which is one line and exit 2."""
    import time

    from tests.support.train_helpers import TINY_CONFIG

    t0 = time.monotonic()
    assert_refused(capfd, ["sim", "--config", str(TINY_CONFIG), "--machine", "a100-80gb", "--sweep", "--gpus",
                           "1000000000000"], tmp_path, "no layout of this model fits on 1000000000000 x")
    assert time.monotonic() - t0 < 30
    for bad in ("0", "-4"):
        assert_refused(capfd, ["sim", "--config", str(TINY_CONFIG), "--machine", "a100-80gb", "--sweep", "--gpus", bad],
                       tmp_path, f"--gpus must be positive, got {bad}")


def test_the_dp_change_hint_names_the_micro_batch_when_it_must_change_too(shards, tmp_path, capfd):
    """A global batch of 6 (3 x 1 x dp 2) resumed on dp 1 with micro-batches of 4: keeping 6 needs a
    micro-batch that divides it, and the hint says which; following it works."""
    run_dir = tmp_path / "run"
    assert run_train(run_dir, *shards, "train.steps=2") == 0
    checkpoint_as_if_written_with(run_dir, 2, **{"parallel.dp": 2, "train.micro_batch_size": 3,
                                                 "train.global_batch_size": 6})
    line = assert_refused(capfd, train_argv(run_dir, *shards, "train.steps=3", "train.micro_batch_size=4"),
                          run_dir / "checkpoints", "global batch from 6 to 4 sequences",
                          "train.global_batch_size=6", "and train.micro_batch_size=3", "4 x 1 does not divide 6")
    assert line.endswith("or set train.global_batch_size=4 to change it"), line
    assert run_train(run_dir, *shards, "train.steps=3", "train.micro_batch_size=3", "train.global_batch_size=6") == 0


def test_a_lone_copy_of_model_h5_is_refused_naming_the_missing_rank_files(trained, shards, tmp_path, capfd):
    """model.h5's tensors are views of the rank files: copied alone, HDF5 reads NaN. Every command that
    takes a checkpoint says so instead."""
    lone = tmp_path / "copy" / "model.h5"
    lone.parent.mkdir()
    shutil.copy(trained / "checkpoints" / "step_00000002" / "model.h5", lone)
    for argv in (["eval", str(lone), "--data", str(shards[1])], ["inspect", str(lone.parent)],
                 ["generate", str(lone), "--prompt", "a"]):
        assert_refused(capfd, argv, tmp_path, f"{lone} is not a checkpoint by itself", "rank-tp0-pp0-dp0.h5",
                       "--to h5")


# ---------------------------------------------------------------- refused before any weight is drawn

@pytest.fixture
def engines_built(monkeypatch):
    """The engines built in this test (each one draws its weights as it is built)."""
    from boostmpi.parallel.engine import Engine

    built, real = [], Engine.__init__

    def counted(self, *args, **kwargs):
        built.append(args)
        real(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "__init__", counted)
    return built


def refusals_after_a_run(shards, tmp_path):
    """{case: (argv, fragments)}: a bad run directory, a bad configuration, bad data, and a checkpoint
    the configuration or the data cannot continue; `tmp_path/done` holds a finished 2-step run to resume."""
    done = tmp_path / "done"
    assert run_train(done, *shards, "train.steps=2") == 0
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder\n")
    no_checkpoint = tmp_path / "no_checkpoint"
    no_checkpoint.mkdir()
    (no_checkpoint / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    data = tmp_path / "data"
    data.mkdir()
    bad = write_bad_shard(data, "id_beyond_vocab")
    other_train = data / "fewer_windows.bin"
    write_shard(other_train, np.arange(3000) % 256)
    return {
        "run dir is a file": (train_argv(a_file, *shards), ["a_file", "is a file"]),
        "run dir holds a run without a checkpoint": (train_argv(no_checkpoint, *shards), ["metrics.jsonl"]),
        "bad configuration": (train_argv(tmp_path / "run", *shards, "model.d_model=30"), ["model.d_model = 30"]),
        "bad data": (train_argv(tmp_path / "run", bad, shards[1]), [bad.name, "300"]),
        "checkpoint of another model": (train_argv(done, *shards, "train.steps=4", "model.d_model=64"),
                                        ["cannot resume from", "d_model"]),
        "checkpoint of other data": (train_argv(done, other_train, shards[1], "train.steps=4"),
                                     ["cannot resume", "windows"]),
    }


def test_bad_run_dir_data_or_checkpoint_is_refused_before_any_weight_is_drawn(shards, tmp_path, capfd,
                                                                              engines_built):
    cases = refusals_after_a_run(shards, tmp_path)
    engines_built.clear()  # the run made to resume
    for case, (argv, fragments) in cases.items():
        assert_refused(capfd, argv, tmp_path, *fragments)
        assert engines_built == [], f"{case}: an engine (its weights) was built before the refusal"


def test_the_check_sees_weights_drawn_before_a_refusal(shards, tmp_path, capfd, engines_built, monkeypatch):
    """Mutant: the trainer builds its engine (draws the weights) right after the process grid, before
    the checks; the refusal is the same line, and the count of engines built shows the difference."""
    import inspect
    import textwrap

    from boostmpi.train import trainer

    source = textwrap.dedent(inspect.getsource(trainer.Trainer.__init__))
    build = "        self.engine = Engine(cfg, self.grid)  # the weights are drawn here, after every check\n"
    grid = "    self.grid = process_grid(cfg, world, local_rank)\n"
    assert build in source and grid in source, "Trainer.__init__ no longer reads as this mutant expects"
    mutant = source.replace(build, "").replace(grid, grid + build.replace("        ", "    ", 1))
    namespace = {}
    exec(compile(mutant, trainer.__file__, "exec"), vars(trainer), namespace)  # noqa: S102 - the mutant
    monkeypatch.setattr(trainer.Trainer, "__init__", namespace["__init__"])
    data = tmp_path / "data"
    data.mkdir()
    bad = write_bad_shard(data, "id_beyond_vocab")
    assert_refused(capfd, train_argv(tmp_path / "run", bad, shards[1]), tmp_path, bad.name, "300")
    assert len(engines_built) == 1
