"""The run directory as one object (boostmpi/train/rundir.py): the lock it holds and gives back (a folder
it made for a refused run removed again), the choice of the checkpoint to resume, and the timelines it
moves aside before the first step, with `latest` naming the checkpoint the run continues. Checkpoint
folders here are empty ones with their completion marker: nothing in RunDirectory reads a tensor."""

import os

import pytest

from boostmpi import checkpoint as ckpt
from boostmpi.errors import UserError
from boostmpi.files import RunDirInUse
from boostmpi.train.rundir import RunDirectory


def complete_checkpoint(run_dir, step):
    folder = run_dir / "checkpoints" / ckpt.step_dir_name(step)
    folder.mkdir(parents=True)
    (folder / ckpt.MARKER).write_text("{}")
    return folder


def test_the_lock_is_held_once_and_a_folder_made_for_a_refused_run_is_removed(tmp_path):
    said = []
    run = RunDirectory(str(tmp_path / "run"), said.append)
    run.lock()
    assert (tmp_path / "run" / ".lock").is_file()
    with pytest.raises(RunDirInUse, match="is in use by another run"):
        RunDirectory(str(tmp_path / "run"), said.append).lock()
    assert run.choose_resume(None) is None  # a fresh run
    run.release()
    assert not (tmp_path / "run").exists() and said == []
    run.release()  # twice: nothing held, nothing done


def test_the_resume_choice_refuses_metrics_without_a_checkpoint_and_pins_another_runs(tmp_path):
    mine, other = tmp_path / "mine", tmp_path / "other"
    mine.mkdir()
    (mine / "metrics.jsonl").write_text('{"step": 1}\n')
    run = RunDirectory(str(mine), print)
    with pytest.raises(UserError, match="already holds a run .metrics.jsonl. but no complete checkpoint"):
        run.choose_resume(None)
    theirs = complete_checkpoint(other, 4)
    assert run.choose_resume(str(other)) == str(theirs)
    assert ckpt.live_pins(str(theirs))  # pinned against the other run's pruning while the ranks read it
    run.continues(str(theirs), 4)
    assert run.started_from_another_run()
    run.release()
    assert not ckpt.live_pins(str(theirs))


def test_resuming_an_earlier_checkpoint_moves_the_later_ones_aside_and_points_latest_at_it(tmp_path):
    run_dir = tmp_path / "run"
    first, *later = (complete_checkpoint(run_dir, step) for step in (1, 2, 3))
    (run_dir / "checkpoints" / "latest").write_text(later[-1].name + "\n")
    said = []
    run = RunDirectory(str(run_dir), said.append)
    assert run.choose_resume(str(first)) == str(first)
    run.continues(str(first), 1)
    assert not run.started_from_another_run()
    run.prepare("[train]\n")
    root = run_dir / "checkpoints"
    aside = [n for n in os.listdir(root) if n.startswith("abandoned-")]
    assert len(aside) == 1 and sorted(os.listdir(root / aside[0])) == ["README", *(p.name for p in later)]
    assert (root / "latest").read_text().strip() == first.name
    assert ckpt.find_latest(str(run_dir)) == str(first)
    assert (run_dir / "config.toml").read_text() == "[train]\n"
    assert said == [f"starting from step 1 of {first}: the checkpoints step_00000002, step_00000003 of the abandoned "
                    f"timeline are moved to {root / aside[0]} (kept, never loaded)"]
