"""Stop signals (boostmpi/preemption.py) on one process, in this process: a signal that arrives after
a step's merged all-reduce (during the optimizer update, the metrics or the log) stops the run at
that step's boundary, with a checkpoint of that step, and the rerun continues bit for bit as if the
run had never stopped. Each check is also run against a mutant of the trainer's text that it must
catch. (tests/integration/test_faults.py holds the same under mpiexec, with the signal on one rank only.)"""

import inspect
import json
import os
import signal
import textwrap

import pytest

from boostmpi import preemption
from boostmpi import checkpoint
from boostmpi.train import metrics, trainer
from tests.support.train_helpers import h5_datasets, read_metrics, reproducible, run_train, write_text_shards

STEPS, SIGNAL_AT = 7, 3
SETTINGS = (f"train.steps={STEPS}", "checkpoint.every=5", "train.val_every=0")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_text_shards(tmp_path_factory.mktemp("text"), max_bytes=60_000)


@pytest.fixture(scope="module")
def uninterrupted(shards, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    assert run_train(run_dir, *shards, *SETTINGS) == 0
    return reproducible(read_metrics(run_dir)), h5_datasets(run_dir / "checkpoints" / f"step_{STEPS:08d}" / "model.h5")


def signal_after_the_all_reduce_of(step, monkeypatch):
    """SIGUSR1 to this process while the trainer makes the metrics row of `step`: after its merged
    all-reduce and its optimizer update."""
    make_row = metrics.step_row

    def signalling_row(at, *args, **kwargs):
        if at == step:
            os.kill(os.getpid(), signal.SIGUSR1)
        return make_row(at, *args, **kwargs)

    monkeypatch.setattr(metrics, "step_row", signalling_row)


def mutant_train(monkeypatch, old, new):
    """Trainer.train with `old` replaced by `new` in its source text."""
    source = textwrap.dedent(inspect.getsource(trainer.Trainer.train))
    assert source.count(old) == 1, old
    namespace = {}
    exec(compile(source.replace(old, new), trainer.__file__, "exec"), vars(trainer), namespace)
    monkeypatch.setattr(trainer.Trainer, "train", namespace["train"])


def stopped_at_and_resumed(run_dir, shards, monkeypatch, capfd):
    """(the step the signalled run checkpointed and stopped at, the rerun's metrics, its last model)."""
    with monkeypatch.context() as m:
        signal_after_the_all_reduce_of(SIGNAL_AT, m)
        assert run_train(run_dir, *shards, *SETTINGS) == preemption.STOPPED_EARLY_EXIT
    out = capfd.readouterr().out
    assert out.count("stopped by signal at step") == 1, out
    stopped = int(out.split("stopped by signal at step ")[1].split(":")[0])
    assert checkpoint.find_latest(str(run_dir)) == str(run_dir / "checkpoints" / f"step_{stopped:08d}")
    assert (run_dir / preemption.STOPPED_MARKER).read_text() == f"stopped on SIGUSR1 at step {stopped}\n"
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, stopped + 1))
    assert run_train(run_dir, *shards, *SETTINGS) == 0
    model = h5_datasets(run_dir / "checkpoints" / f"step_{STEPS:08d}" / "model.h5")
    return stopped, reproducible(read_metrics(run_dir)), model


def same_run(a, b):
    rows_a, model_a = a
    rows_b, model_b = b
    return rows_a == rows_b and model_a.keys() == model_b.keys() and all(
        model_a[k].tobytes() == model_b[k].tobytes() for k in model_a)


def test_a_signal_after_the_all_reduce_stops_at_that_step_and_resumes_bitwise(shards, uninterrupted, tmp_path,
                                                                             monkeypatch, capfd):
    stopped, rows, model = stopped_at_and_resumed(tmp_path / "run", shards, monkeypatch, capfd)
    assert stopped == SIGNAL_AT
    assert same_run((rows, model), uninterrupted)


def test_the_mutant_that_does_not_look_back_stops_one_step_late(shards, tmp_path, monkeypatch, capfd):
    """Without the "arrived before this step" flag the next step runs to its end: a checkpoint one step late."""
    mutant_train(monkeypatch, "if stopped_before and steps_done:", "if False:")
    stopped, _, _ = stopped_at_and_resumed(tmp_path / "run", shards, monkeypatch, capfd)
    assert stopped == SIGNAL_AT + 1


def test_the_mutant_that_keeps_the_dropped_steps_batches_resumes_elsewhere(shards, uninterrupted, tmp_path,
                                                                           monkeypatch, capfd):
    """The dropped step's micro-batches must go back to the data stream: the mutant that leaves them drawn
    saves a data position one batch ahead, and the rerun trains on other batches."""
    mutant_train(monkeypatch, "self.loader.load_state_dict(position)", "pass")
    stopped, rows, model = stopped_at_and_resumed(tmp_path / "run", shards, monkeypatch, capfd)
    assert stopped == SIGNAL_AT
    assert not same_run((rows, model), uninterrupted)


def test_a_signal_just_before_the_first_step_runs_one_step_first(shards, tmp_path, capfd):
    """A signal recorded after start-up but before the first step of a run is not "after the previous
    step": that run has none. The first step runs and is checkpointed (there is nothing else to resume
    from). A signal during start-up itself ends the process at once (tests/unit/parallel/test_startup_signals.py)."""
    from boostmpi.config import load_config
    from tests.support.train_helpers import TINY_CONFIG, train_settings

    run_dir = tmp_path / "run"
    cfg = load_config(str(TINY_CONFIG), overrides=train_settings(run_dir, *shards, *SETTINGS))
    with preemption.handlers_restored():
        preemption.install()
        preemption.started()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption.watch().signal == signal.SIGUSR1
        result = trainer.Trainer(cfg).train()
    assert result["preempted"] and result["step"] == 1
    assert checkpoint.find_latest(str(run_dir)) == str(run_dir / "checkpoints" / "step_00000001")


def test_a_signal_in_the_last_step_still_leaves_the_final_record(shards, tmp_path, monkeypatch):
    """The run stops on the signal (exit 75) at train.steps, which it has trained and checkpointed: it is
    finished, and says so in final.json, from which the job scripts write DONE without another attempt."""
    run_dir = tmp_path / "run"
    signal_after_the_all_reduce_of(STEPS, monkeypatch)
    assert run_train(run_dir, *shards, *SETTINGS) == preemption.STOPPED_EARLY_EXIT
    assert (run_dir / preemption.STOPPED_MARKER).exists()
    assert json.loads((run_dir / preemption.FINAL_RECORD).read_text())["step"] == STEPS
