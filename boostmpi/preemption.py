"""Stop signals: what SIGTERM, SIGUSR1 and SIGINT do to a training run (docs/OPERATIONS.md).

One handler, installed at start-up (`install`, from `parallel.launch.init_mpi`) and kept by the
trainer (`watch`), records the first stop signal in the process's `StopRequest` instead of
killing the rank. The trainer checkpoints at a step boundary and exits with `STOPPED_EARLY_EXIT`.
A second SIGINT (Ctrl-C pressed again, more than a second after the first) ends the process at
once with status 130, without a checkpoint.

The ranks agree on the request through the step's merged all-reduce, which carries two flags per
rank (`StopRequest.flags`): "a signal arrived" and "it arrived before this step began", that is
after the previous step's all-reduce, during that step's optimizer update, metrics or log. The
second flag means the previous step's boundary is where the run stops: the trainer drops the
step in progress (no optimizer update, no metrics row, the data position put back) and
checkpoints the state of the previous step, so no extra collective is needed per step.

During start-up (from `install` until the trainer's loop begins, `started`) there is nothing to
checkpoint yet, so a stop signal ends the process at once: the handler raises `StoppedDuringStartup`
in the main thread, which interrupts even a long Python loop within a second; the command prints
one line and exits 128 + the signal's number. Start-up marks its stages (`stage`); the environment
variable BOOSTMPI_SIGNAL_AT=STAGE[:SIGNAL] makes the process send itself SIGNAL (default SIGTERM)
when it reaches STAGE, so that a signal at any point of start-up can be tested deterministically.

This module imports nothing from the rest of boostmpi: start-up (parallel/) and the trainer
(train/) both use it.
"""

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from types import FrameType

# Slurm's --signal and time limit, PBS's qdel / walltime, Ctrl-C on an interactive mpiexec
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# the exit status of a run stopped early by a signal, with a checkpoint to resume from (sysexits.h's
# EX_TEMPFAIL: "try again later"); a finished run exits 0
STOPPED_EARLY_EXIT = 75
# written into train.run_dir once that checkpoint is complete: how a job script knows the run stopped on a
# signal whatever status its launcher returns (srun may report 128 + the signal instead of 75)
STOPPED_MARKER = "STOPPED_ON_SIGNAL"
# written into train.run_dir by rank 0 once the last step (train.steps) is trained and checkpointed: the
# run's own record that it is finished, from which alone a job script writes DONE
FINAL_RECORD = "final.json"
INTERRUPTED_TWICE_EXIT = 130
SIGNAL_AT = "BOOSTMPI_SIGNAL_AT"
# the start-up stages, in order: `stage(name)` is called as each is reached
STAGES = ("launch", "handlers", "mpi", "config", "memory", "data", "engine", "first-step")


class StoppedDuringStartup(KeyboardInterrupt):
    """A stop signal before the first step: nothing to checkpoint, the process ends at once."""

    def __init__(self, signum: int, stage: str) -> None:
        self.signum, self.stage = signum, stage
        self.exit_code = 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name} during start-up (at {stage}): no step was taken, "
                         f"nothing to checkpoint; run the same command again to start")


_starting = False
_stage = "launch"


class StopRequest:
    """The first stop signal this process received (None: none), and where in the step it came."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._since = time.monotonic()
        self._before_step = False  # the signal was there when the current step began

    def record(self, signum: int) -> None:
        now = time.monotonic()
        # the same Ctrl-C can arrive twice at once (from the terminal and forwarded by the launcher)
        if signum == signal.SIGINT and self.signal == signal.SIGINT and now - self._since > 1.0:
            print("interrupted again: stopping now, without a checkpoint", file=sys.stderr, flush=True)
            os._exit(INTERRUPTED_TWICE_EXIT)
        if self.signal is None:
            self.signal, self._since = signum, now

    def step_begins(self) -> None:
        """Called at each step boundary, before the step's first micro-batch is drawn."""
        self._before_step = self.signal is not None

    def flags(self) -> list[float]:
        """This rank's two floats for the step's merged all-reduce: a stop signal arrived; it arrived
        before the step began."""
        return [1.0 if self.signal is not None else 0.0, 1.0 if self._before_step else 0.0]

    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else "a signal on another rank"


_request = StopRequest()


def _handler(signum: int, frame: FrameType | None) -> None:
    _request.record(signum)
    if _starting:
        raise StoppedDuringStartup(signum, _stage)


def _take_signals() -> None:
    for sig in STOP_SIGNALS:
        try:
            signal.signal(sig, _handler)
        except ValueError:  # not the main thread: the caller's handlers stay
            pass


def install() -> None:
    """Start-up: from now on a stop signal ends start-up at once (StoppedDuringStartup), and after
    `started` it is recorded (a fresh request) for the trainer to act on, never fatal."""
    global _request, _starting
    _request = StopRequest()
    _starting = True
    _take_signals()


def started() -> None:
    """Start-up is over: the trainer's loop begins and stop signals are recorded from now on."""
    global _starting
    _starting = False


def stage(name: str) -> None:
    """Start-up reached `name` (one of STAGES); with BOOSTMPI_SIGNAL_AT naming it, send the signal it names."""
    global _stage
    _stage = name
    wanted, _, sig = os.environ.get(SIGNAL_AT, "").partition(":")
    if wanted == name:
        os.kill(os.getpid(), getattr(signal, sig or "SIGTERM"))


def watch() -> StopRequest:
    """The trainer's start: the handler (again: a test may build a trainer without start-up) and the
    process's request, which keeps a signal that arrived during start-up."""
    _take_signals()
    return _request


def release() -> None:
    """The run that watched the request is over (its signal was acted on): later runs of this process
    start with a fresh one."""
    global _request
    _request = StopRequest()


@contextlib.contextmanager
def handlers_restored() -> Iterator[None]:
    """Around start-up and training in a process that goes on afterwards (a test calling `train`): the
    caller's stop-signal handlers are put back, or `timeout` could no longer end it."""
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        started()
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)
