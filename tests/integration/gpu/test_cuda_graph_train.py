"""`boostmpi train` with `train.cuda_graph = true` on the GPU path (the CuPy stand-in's capture where no GPU
is reached): the run's metrics and checkpoints are bitwise those of the eager run, a run resumed from one
of its checkpoints warms up, captures again and ends where the uninterrupted run ends, and validation and
checkpoints between the replays see the replayed step's weights."""

import os
import signal

import pytest

from boostmpi import preemption
from boostmpi.train import metrics
from tests.integration.test_checkpoint import assert_same_checkpoint, step_dir
from tests.support.train_helpers import read_metrics, reproducible, run_train, write_text_shards

pytestmark = pytest.mark.gpu

# six steps: two eager, the capture, three replays (a resume from step 2: two eager, the capture, one
# replay); validation after steps 3 and 6 and checkpoints every two steps fall between replays
SETTINGS = ("train.device=gpu", "train.attention=own", "train.steps=6", "train.warmup_steps=2",
            "train.grad_clip=0.5", "checkpoint.every=2", "train.val_every=3", "train.val_windows=2")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_text_shards(tmp_path_factory.mktemp("text"), 60_000)


@pytest.fixture(scope="module")
def eager(shards, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("eager") / "run"
    assert run_train(run_dir, *shards, *SETTINGS) == 0
    return run_dir


def test_a_graph_run_and_its_resume_are_bitwise_the_eager_run(shards, eager, tmp_path):
    from boostmpi.train import graph_step

    graph, resumed = tmp_path / "graph", tmp_path / "resumed"
    captured = []
    real = graph_step.GraphStep._capture
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(graph_step.GraphStep, "_capture", lambda self: (captured.append(self), real(self))[1])
        assert run_train(graph, *shards, *SETTINGS, "train.cuda_graph=true") == 0
        assert run_train(resumed, *shards, *SETTINGS, "train.cuda_graph=true", resume=step_dir(graph, 2)) == 0
    assert len(captured) == 2 and all(g.graph is not None for g in captured)
    want = reproducible(read_metrics(eager))
    assert any(row["grad_norm"] > 0.5 for row in want), "clipping active in some step"
    assert reproducible(read_metrics(graph)) == want
    assert reproducible(read_metrics(resumed)) == want[2:]
    for step in (2, 4, 6):
        assert_same_checkpoint(step_dir(eager, step), step_dir(graph, step))
    assert_same_checkpoint(step_dir(eager, 6), step_dir(resumed, 6))


def test_a_stop_signal_before_a_launch_drops_that_step_and_the_rerun_is_bitwise(shards, eager, tmp_path, monkeypatch):
    """A stop signal that arrives after step 5's launch (while its metrics row is made; step 5 neither
    validates nor checkpoints, which would agree on the signal at once) is read before step 6's launch:
    step 6 is dropped before it changes a weight, the checkpoint is step 5's, and the rerun ends bitwise
    where the eager run ends."""
    run_dir = tmp_path / "run"
    make_row = metrics.step_row

    def signalling_row(at, *args, **kwargs):
        if at == 5:
            os.kill(os.getpid(), signal.SIGUSR1)
        return make_row(at, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(metrics, "step_row", signalling_row)
        assert run_train(run_dir, *shards, *SETTINGS, "train.cuda_graph=true") == preemption.STOPPED_EARLY_EXIT
    assert [row["step"] for row in read_metrics(run_dir)] == [1, 2, 3, 4, 5]
    assert_same_checkpoint(step_dir(eager, 4), step_dir(run_dir, 4))
    assert run_train(run_dir, *shards, *SETTINGS, "train.cuda_graph=true") == 0
    assert reproducible(read_metrics(run_dir)) == reproducible(read_metrics(eager))
    assert_same_checkpoint(step_dir(eager, 6), step_dir(run_dir, 6))
