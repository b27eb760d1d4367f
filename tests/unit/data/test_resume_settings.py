"""A resumed run compares every setting that changes the run with its checkpoint: a changed global batch
(through micro_batch_size, grad_accum or global_batch_size), train.seed, data.shuffle, train.steps below the
checkpoint and other shards with as many windows are refused in one line with nothing changed (config.toml
included); a global batch set explicitly is applied and logged at the checkpoint's step; the layout with
the global batch held, recompute and checkpoint settings change freely."""

import shutil

import numpy as np
import pytest

from boostmpi.data.shards import write_shard
from tests.support.train_helpers import assert_refused, read_metrics, run_train, train_argv, write_text_shards


@pytest.fixture(scope="module")
def resumable(tmp_path_factory):
    """(a run directory checkpointed at step 2 with micro_batch_size 2 x grad_accum 1, its shards)."""
    root = tmp_path_factory.mktemp("resume")
    shards = write_text_shards(root / "text", max_bytes=60_000)
    run_dir = root / "run"
    assert run_train(run_dir, *shards, "train.steps=2") == 0
    return run_dir, shards


# (overrides on resume, fragments of the one-line refusal)
REFUSED = {
    "micro_batch_size": (["train.micro_batch_size=4"],
                         ["train.micro_batch_size = 4 instead of 2", "global batch from 2 to 4 sequences",
                          "train.global_batch_size=2 to keep it", "train.global_batch_size=4 to change it"]),
    "grad_accum": (["train.grad_accum=2"], ["train.grad_accum = 2 instead of 1", "global batch from 2 to 4"]),
    "seed": (["train.seed=7"], ["train.seed = 7", "train.seed = 1337", "order of the data", "train.seed=1337"]),
    "shuffle": (["data.shuffle=false"], ["data.shuffle = false", "data.shuffle=true"]),
    "steps below the checkpoint": (["train.steps=1"], ["train.steps = 1", "already at step 2", "--resume"]),
}


@pytest.mark.parametrize("overrides,fragments", list(REFUSED.values()), ids=list(REFUSED))
def test_a_setting_that_changes_the_run_is_refused_with_nothing_changed(resumable, overrides, fragments, tmp_path,
                                                                         capfd):
    run_dir, shards = resumable
    mine = tmp_path / "run"
    shutil.copytree(run_dir, mine)
    assert_refused(capfd, train_argv(mine, *shards, "train.steps=4", *overrides), mine, *fragments)


def test_other_shards_with_as_many_windows_are_refused(resumable, tmp_path, capfd):
    run_dir, (train, val) = resumable
    mine = tmp_path / "run"
    shutil.copytree(run_dir, mine)
    tokens = np.fromfile(train, dtype=np.uint16)[256 * 2:]
    other = tmp_path / "other.bin"
    write_shard(other, tokens[::-1].copy())  # as many tokens, in another order
    assert_refused(capfd, train_argv(mine, other, val, "train.steps=4"), mine, "other training shards",
                   "fingerprint", "set a new train.run_dir")


def test_an_explicit_global_batch_is_applied_and_logged_at_the_checkpoints_step(resumable, tmp_path, capfd):
    run_dir, shards = resumable
    mine = tmp_path / "run"
    shutil.copytree(run_dir, mine)
    capfd.readouterr()
    assert run_train(mine, *shards, "train.steps=3", "train.global_batch_size=4") == 0
    assert "the global batch changes from 2 to 4 sequences at step 2 (train.global_batch_size)" in capfd.readouterr().out
    assert [row["step"] for row in read_metrics(mine)] == [1, 2, 3]


def test_layout_recompute_and_checkpoint_settings_change_without_asking(resumable, tmp_path, capfd):
    run_dir, shards = resumable
    mine = tmp_path / "run"
    shutil.copytree(run_dir, mine)
    capfd.readouterr()
    # micro_batch_size 1 x grad_accum 2 holds the global batch of 2 sequences
    assert run_train(mine, *shards, "train.steps=3", "train.micro_batch_size=1", "train.grad_accum=2",
                     "train.recompute=layer", "checkpoint.every=1", "checkpoint.keep=1") == 0
    out = capfd.readouterr().out
    assert "resumed from" in out and "global batch" not in out
    assert read_metrics(mine)[-1]["step"] == 3
