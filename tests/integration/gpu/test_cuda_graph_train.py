"""`boostmpi train` with `train.cuda_graph = true` on the GPU path (the CuPy stand-in's capture where no GPU
is reached): the run's metrics and checkpoints are bitwise those of the eager run, a run resumed from one
of its checkpoints warms up, captures again and ends where the uninterrupted run ends, and validation and
checkpoints between the replays see the replayed step's weights."""

import pytest

from tests.integration.test_checkpoint import assert_same_checkpoint, step_dir
from tests.support.train_helpers import read_metrics, reproducible, run_train, write_text_shards

pytestmark = pytest.mark.gpu

# six steps: two eager, the capture, three replays (a resume from step 2: two eager, the capture, one
# replay); validation after steps 3 and 6 and checkpoints every two steps fall between replays
SETTINGS = ("train.device=gpu", "train.attention=own", "train.steps=6", "train.warmup_steps=2",
            "train.grad_clip=0.5", "checkpoint.every=2", "train.val_every=3", "train.val_windows=2")


def test_a_graph_run_and_its_resume_are_bitwise_the_eager_run(tmp_path):
    from boostmpi.train import graph_step

    shards = write_text_shards(tmp_path / "data", 60_000)
    eager, graph, resumed = tmp_path / "eager", tmp_path / "graph", tmp_path / "resumed"
    assert run_train(eager, *shards, *SETTINGS) == 0
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
