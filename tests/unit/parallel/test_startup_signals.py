"""Stop signals during start-up, delivered deterministically: BOOSTMPI_SIGNAL_AT=STAGE[:SIGNAL] makes
the process send itself the signal when start-up reaches STAGE (boostmpi/preemption.py, STAGES).

Before the first step there is nothing to checkpoint: a stop signal ends the process at once with
one line and 128 + the signal's number, never running the steps (before the handlers exist, at
"launch", the signal's default action ends it). At "first-step" the run is past start-up: it takes
its first step and stops with a checkpoint (exit 75). A Ctrl-C in the middle of a long pure-Python
start-up walk ends it at once, and a model whose weights alone cannot fit is refused in closed form.
"""

import math
import os
import signal
import subprocess
import sys
import time

import pytest

from boostmpi import preemption
from boostmpi.config import load_config
from boostmpi.model.params import param_specs
from boostmpi.parallel.startup import size_problem, weights_lower_bound
from tests.support.mpi_helpers import MPIEXEC
from tests.support.train_helpers import REPO, TINY_CONFIG, train_argv, write_text_shards

ENV = dict(os.environ, PYTHONPATH=str(REPO), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_text_shards(tmp_path_factory.mktemp("text"), max_bytes=60_000)


def _train(run_dir, shards, signal_at, launcher=(), timeout=120, *sets):
    argv = train_argv(run_dir, *shards, "train.steps=3", "checkpoint.every=0", *sets)
    env = dict(ENV, **{preemption.SIGNAL_AT: signal_at})
    return subprocess.run([*launcher, sys.executable, "-m", "boostmpi", *argv], env=env, cwd=run_dir.parent,
                          capture_output=True, text=True, timeout=timeout)


def _steps_written(run_dir):
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) if (run_dir / "checkpoints").exists() else []


# "memory" follows "config" in the same function, and "engine" runs at two ranks below: both with the slow tests.
# Ids "at-<stage>": a bare "mpi" id is a keyword pytest-mpi takes for its marker, which skipped that case.
@pytest.mark.parametrize("stage", [pytest.param(s, marks=pytest.mark.slow) if s in ("memory", "engine") else s
                                   for s in preemption.STAGES], ids=lambda s: f"at-{s}")
def test_sigterm_at_each_start_up_stage_is_never_lost(shards, tmp_path, stage):
    run_dir = tmp_path / "run"
    done = _train(run_dir, shards, stage)
    assert "done:" not in done.stdout, (stage, done.stdout)
    if stage == "launch":  # before the handlers: SIGTERM's default action
        assert done.returncode == -signal.SIGTERM, done.stderr
    elif stage == "first-step":  # start-up is over: one step, then a checkpoint to resume from
        assert done.returncode == preemption.STOPPED_EARLY_EXIT, done.stderr
        assert _steps_written(run_dir) == ["step_00000001"]
    else:
        lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
        assert done.returncode == 128 + signal.SIGTERM and len(lines) == 1, done.stderr
        assert f"stopped by SIGTERM during start-up (at {stage})" in lines[0], lines[0]
        assert _steps_written(run_dir) == [] and not (run_dir / "metrics.jsonl").exists()


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec next to the interpreter or on PATH")
def test_sigterm_at_start_up_ends_every_rank_of_an_mpi_job(shards, tmp_path):
    run_dir = tmp_path / "run"
    started = time.monotonic()
    done = _train(run_dir, shards, "engine", ("timeout", "90", MPIEXEC, "-n", "2"), 120, "parallel.dp=2")
    assert done.returncode not in (0, 124) and "done:" not in done.stdout, (done.returncode, done.stderr)
    assert done.stderr.count("stopped by SIGTERM during start-up (at engine)") == 2, done.stderr
    assert _steps_written(run_dir) == [] and time.monotonic() - started < 60


def test_ctrl_c_in_a_long_start_up_walk_ends_it_at_once(monkeypatch):
    """The walk over a million layers' parameters (what start-up did for n_layers = 10^6) is
    interrupted by the handler within a second of the signal, not at its end. The signal is sent
    from inside the walk, at its 1,000th layer (deterministic: a timer thread may not be scheduled
    on a loaded machine before the walk is over)."""
    from boostmpi.model import params

    cfg = load_config(TINY_CONFIG, ["model.n_layers=1000000"])
    sent = []
    walk = params.stage_layers

    def signalling_walk(*args, **kwargs):
        for n, layer in enumerate(walk(*args, **kwargs)):
            if n == 1000:
                sent.append(time.monotonic())
                os.kill(os.getpid(), signal.SIGINT)
            yield layer

    monkeypatch.setattr(params, "stage_layers", signalling_walk)
    try:
        with preemption.handlers_restored():
            preemption.install()
            with pytest.raises(preemption.StoppedDuringStartup) as stopped:
                params.param_specs(cfg)
            assert sent and time.monotonic() - sent[0] < 1.0
    finally:
        preemption.release()  # no recorded signal left for later tests of this process
    assert stopped.value.exit_code == 130 and "SIGINT" in str(stopped.value)


def test_after_start_up_a_signal_is_recorded_not_raised():
    with preemption.handlers_restored():
        preemption.install()
        preemption.started()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption.watch().signal == signal.SIGUSR1
    preemption.release()


def test_weights_that_cannot_fit_are_refused_in_closed_form():
    cfg = load_config(TINY_CONFIG, ["model.n_layers=1000000000"])
    started = time.monotonic()
    need = weights_lower_bound(cfg)
    problem = size_problem(cfg, 2**40, "a 1 TiB node", "host")
    assert time.monotonic() - started < 0.1 and need > 2**40
    assert "1,000,000,000 layers" in problem and "\n" not in problem
    small = load_config(TINY_CONFIG)  # one rank, float32: the closed form is the walked count x 16 bytes exactly
    walked = sum(math.prod(spec.global_shape) for spec in param_specs(small) if spec.layer is not None)
    assert weights_lower_bound(small) == walked * 16
    assert size_problem(small, 2**30, "a 1 GiB node", "host") is None
