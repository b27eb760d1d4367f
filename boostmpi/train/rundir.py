"""The run directory of a training run, owned by one object: its lock (one run per run directory), the
choice of the checkpoint a run continues from, `checkpoints/latest` and the checkpoints of timelines a
run does not continue (moved aside, never loaded or deleted), and the files that say how a run ended.

Rank 0 does all of it; the trainer calls each step through its `_root_decides`, so that a refusal
found here is one line on every rank (docs/OPERATIONS.md, "One run per run directory" and "Resuming
from an older checkpoint"). The checkpoint
folder's own rules (what is complete, `resolve`, moving aside, pruning) are checkpoint/runs.py's; the
lock's mechanism (flock, or a lease where the filesystem has no locks) is files.py's `RunLock`.
"""

import contextlib
import json
import os
import time
from typing import Callable

from boostmpi import checkpoint as ckpt
from boostmpi.checkpoint.pins import Pin
from boostmpi.errors import UserError
from boostmpi.files import RunLock, atomic_file, check_dir_creatable, fs_error, make_dirs
from boostmpi.preemption import FINAL_RECORD, STOPPED_MARKER
from boostmpi.train import metrics

WHAT = "train.run_dir"  # how messages name the run directory


class RunDirectory:
    """`path` (`train.run_dir`) as one training run holds it; `log` prints a line on rank 0. Every method
    but `release` runs on rank 0 alone."""

    def __init__(self, path: str, log: Callable[[str], None]) -> None:
        self.path = path
        self.log = log
        self.resumed_from: str | None = None  # the checkpoint this run continues, once loaded
        self.start_step = 0  # its step (0 for a fresh run)
        self._lock: RunLock | None = None
        self._made = False  # this run created the folder (removed again if the run is refused)
        self._resume_pin: Pin | None = None

    # ------------------------------------------------------------------ before the weights exist
    def check_creatable(self) -> None:
        """Refuse a run directory that cannot be made or written, before anything is read or created."""
        check_dir_creatable(self.path, WHAT)

    def lock(self) -> None:
        """Hold the run directory's lock (files.RunLock) until `release`; a stale lock is taken over."""
        self._made = not os.path.isdir(self.path)
        make_dirs(self.path, WHAT)
        lock = RunLock(self.path).acquire()
        self._lock = lock
        if lock.stale:
            self.log(f"the lock of {self.path} was stale ({lock.stale}: that run is gone); this run takes it over")
        # a stop marker left by an earlier run says nothing about this one (written again if this one stops)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(self.path, STOPPED_MARKER))

    def choose_resume(self, resume: str | None) -> str | None:
        """The complete checkpoint to continue from: `resume` (anything `checkpoint.resolve` takes) or the
        run's latest; None for a fresh run. A checkpoint of a newer format is refused here, before its
        files are read; one outside this run directory is pinned against its own run's pruning until
        `release_resume_pin`."""
        metrics.cut_off_row(self.path)  # damaged metrics are refused before anything is changed
        path = resume or ckpt.find_latest(self.path)
        if path is None:
            if metrics.has_rows(self.path):
                raise UserError(f"{self.path} already holds a run (metrics.jsonl) but no complete checkpoint to resume "
                                f"(its first checkpoint was never written); choose another train.run_dir or remove it")
            return None
        path = ckpt.resolve(path)
        newer = ckpt.newer_format(path)
        if newer is not None:
            raise newer
        if not self._own(path):
            # another run's checkpoint, which that run may prune while the ranks read it: pinned until they have
            self._resume_pin = Pin(path).acquire()
        return path

    def release_resume_pin(self) -> None:
        if self._resume_pin is not None:
            self._resume_pin.release()
            self._resume_pin = None

    def continues(self, path: str, step: int) -> None:
        """Record that this run continues checkpoint `path` of step `step` (every rank has loaded it)."""
        self.resumed_from, self.start_step = path, step

    def _own(self, checkpoint: str) -> bool:
        """Whether `checkpoint` (a step folder) lies in this run directory's checkpoints/."""
        return os.path.realpath(os.path.dirname(checkpoint)) == os.path.realpath(ckpt.checkpoints_dir(self.path))

    def started_from_another_run(self) -> bool:
        """True when this run continues a checkpoint outside its own run directory."""
        return self.resumed_from is not None and not self._own(self.resumed_from)

    # ------------------------------------------------------------------ before the first step
    def prepare(self, config_toml: str) -> None:
        """Create the run directory, remove what a killed writer left, move another timeline's
        checkpoints aside, record the configuration (`config_toml`), trim the metrics."""
        make_dirs(self.path, WHAT)
        try:
            with contextlib.suppress(FileNotFoundError):  # written again when this run reaches train.steps
                os.remove(os.path.join(self.path, FINAL_RECORD))
            for path in ckpt.remove_stale_temporaries(self.path):
                self.log(f"removed {path}, left by a writer that stopped before finishing it")
            cut = metrics.drop_cut_off_row(self.path)
            if cut is not None:
                self.log(f"dropped the last row of {metrics.path(self.path)}: it was cut off ({cut[:60]!r}...), "
                         f"a crash while it was written; its step is trained again")
            # on resume, rows past the checkpoint's step (all of them when starting from another run's
            # checkpoint) are dropped: they will be produced again
            dropped = metrics.trim(self.path, None if self.started_from_another_run() else self.start_step)
            self._abandon_other_timelines(dropped)
            with atomic_file(os.path.join(self.path, "config.toml")) as f:
                f.write(config_toml)
        except OSError as exc:
            raise fs_error(exc, "cannot write into train.run_dir", self.path) from exc

    def _abandon_other_timelines(self, dropped_rows: list[str]) -> None:
        """Checkpoints of this run directory that this run will not continue (past the step it starts
        from, or all of them when it starts from another run's checkpoint) are moved aside, never
        reused or deleted, and `latest` names the checkpoint this run continues from."""
        root = ckpt.checkpoints_dir(self.path)
        resumed = self.resumed_from
        own = not self.started_from_another_run()
        others = [p for p in ckpt.complete_checkpoints(self.path)
                  if not own or ckpt.checkpoint_step(p) > self.start_step]
        if not others:
            return
        start = f"step {self.start_step} of {resumed}" if resumed else "scratch"
        dest = ckpt.move_aside(self.path, others, f"checkpoints of a timeline abandoned when a run started from {start}",
                               metrics.set_aside(dropped_rows))
        if own and resumed is not None:
            ckpt.write_latest(self.path, os.path.basename(resumed))
        elif os.path.exists(os.path.join(root, "latest")):
            os.remove(os.path.join(root, "latest"))
        names = ", ".join(os.path.basename(p) for p in others)
        rows = f" and {len(dropped_rows)} metrics rows" if dropped_rows else ""
        self.log(f"starting from {start}: the checkpoints {names}{rows} of the abandoned timeline are moved to {dest} "
                 f"(kept, never loaded)")

    # ------------------------------------------------------------------ how the run ended
    def kept_checkpoint(self) -> str:
        """What a stopped run leaves to resume from, in words: its newest complete checkpoint, or none."""
        latest = ckpt.find_latest(self.path)
        if latest is None:
            return "no checkpoint was written yet, so there is none to resume from"
        return f"the last checkpoint, {os.path.basename(latest)}, is kept intact"

    def write_final_record(self, step: int, steps: int) -> None:
        """Once the last step is trained and its checkpoint published: the run's own record that it is
        finished (FINAL_RECORD), from which alone the job scripts write DONE."""
        record = {"step": step, "steps": steps, "checkpoint": ckpt.find_latest(self.path),
                  "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        path = os.path.join(self.path, FINAL_RECORD)
        try:
            with atomic_file(path) as f:
                json.dump(record, f)
                f.write("\n")
        except OSError as exc:
            raise fs_error(exc, "cannot write the run's final record", path) from exc

    def write_stop_marker(self, text: str) -> None:
        """The marker (STOPPED_MARKER) that tells the job scripts the run stopped on a signal, with `text`."""
        with atomic_file(os.path.join(self.path, STOPPED_MARKER)) as f:
            f.write(text)

    def release(self) -> None:
        """Give up the resume pin and the lock (any rank; a no-op where nothing is held). A run directory
        this run created and was refused in before writing anything is removed again."""
        self.release_resume_pin()
        if self._lock is not None:
            self._lock.release()
            self._lock = None
            if self._made:  # refused before anything was written: leave no empty folder behind
                with contextlib.suppress(OSError):
                    os.rmdir(self.path)
