"""The run's metrics: one JSON object per optimizer step in RUN_DIR/metrics.jsonl (docs/FORMATS.md).

This module owns the row (its keys and how each figure is measured), the file (appended a whole
row at a time by rank 0; trimmed on resume; rows of an abandoned timeline handed to the folder
they are moved to), and the per-step traffic figures that ride the step's merged all-reduce.

A row: `step`, `loss` (mean over the global batch), `lr`, `grad_norm`, `tokens_per_s`,
`step_time_s`, `tokens` (seen so far), `comm_bytes` and `comm_calls` (per axis tp/pp/dp: the
step's payload bytes and calls, each group counted once, summed over the groups of the axis);
on logged steps `memory` (the largest rank's bytes of each kind); on validating steps `val_loss`.
"""

import json
import os
from collections.abc import Sequence
from typing import NotRequired, TypedDict

import numpy as np

from boostmpi.errors import UserError
from boostmpi.files import FilesystemError, LineLog, atomic_file
from boostmpi.parallel.comm import AXES, CommCounter, HostCollectives

FILE = "metrics.jsonl"
MEMORY_KEYS = ("params", "grads", "optimizer", "activations_saved", "activations_in_flight", "checkpoint_snapshot",
               "peak")


def path(run_dir: str) -> str:
    return os.path.join(run_dir, FILE)


def has_rows(run_dir: str) -> bool:
    """True when the run directory's metrics hold at least one byte (a run has taken steps there)."""
    p = path(run_dir)
    return os.path.exists(p) and os.path.getsize(p) > 0


# ---------------------------------------------------------------- traffic, summed with the step's all-reduce

COUNTER_FLOATS = 2 * len(AXES)


def counter_floats(counter: CommCounter) -> list[float]:
    """This rank's payload bytes and calls per axis (a `CommCounter`), as floats to sum over all ranks."""
    return [float(counter.bytes[a]) for a in AXES] + [float(counter.calls[a]) for a in AXES]


def traffic(summed: Sequence[float] | np.ndarray) -> tuple[dict[str, int], dict[str, int]]:
    """(comm_bytes, comm_calls) of a row from the sums of `counter_floats` (each group counted once,
    by its rank 0)."""
    n = len(AXES)
    return dict(zip(AXES, map(int, summed[:n]))), dict(zip(AXES, map(int, summed[n:2 * n])))


# ---------------------------------------------------------------- the row

class MetricsRow(TypedDict):
    """One line of metrics.jsonl (docs/FORMATS.md)."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    step_time_s: float
    tokens: int
    comm_bytes: dict[str, int]  # per axis
    comm_calls: dict[str, int]
    mfu: NotRequired[float]  # on a GPU with a known profile
    memory: NotRequired[dict[str, int]]  # on logged steps: MEMORY_KEYS -> the largest rank's bytes
    val_loss: NotRequired[float]  # on validating steps


def step_row(step: int, loss: float, lr: float, grad_norm: float, step_time_s: float, tokens_per_step: int,
             summed_counters: Sequence[float] | np.ndarray, mfu: float | None = None) -> MetricsRow:
    """A step's row; `mfu` (model FLOPs utilisation, on a GPU with a known profile) only when known."""
    comm_bytes, comm_calls = traffic(summed_counters)
    row: MetricsRow = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_step / step_time_s,
           "step_time_s": step_time_s, "tokens": step * tokens_per_step, "comm_bytes": comm_bytes,
           "comm_calls": comm_calls}
    if mfu is not None:
        row["mfu"] = mfu
    return row


def memory_figures(mine: Sequence[float], host: HostCollectives) -> dict[str, int]:
    """{kind: bytes} of the largest rank for each kind, from this rank's figures in `MEMORY_KEYS` order
    (one maximum over all ranks through `host`)."""
    largest = host.max(np.array(mine, dtype=np.float64))
    return {k: int(v) for k, v in zip(MEMORY_KEYS, largest)}


# ---------------------------------------------------------------- the file

class MetricsFile:
    """Rank 0's metrics.jsonl, open for appending rows. A row the filesystem refuses (a full disk, a
    quota) is cut off again (files.LineLog) and the failure is returned, once; later rows are dropped."""

    def __init__(self, run_dir: str) -> None:
        self._log = LineLog(path(run_dir))
        self.failed = False

    def append(self, row: MetricsRow) -> FilesystemError | None:
        """Write `row`; returns the FilesystemError it met, or None."""
        if self.failed:
            return None
        try:
            self._log.append(json.dumps(row) + "\n")
        except FilesystemError as exc:
            self.failed = True
            return exc
        return None

    def close(self) -> None:
        self._log.close()


def cut_off_row(run_dir: str) -> tuple[bytes, str | None] | None:
    """A last row that is not whole JSON was cut off by a crash while it was written: (the file's bytes
    without it, the row) or None when the file ends whole. A row before the last that does not parse is
    damage this does not guess at: one line naming it (UserError). Nothing is written."""
    p = path(run_dir)
    try:
        with open(p, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    lines = data.split(b"\n")
    whole, last = lines[:-1], lines[-1]  # `last` is b"" when the file ends with a newline
    if not last.strip() and whole and not _parses(whole[-1]):
        whole, last = whole[:-1], whole[-1]
    for number, line in enumerate(whole, 1):
        if line.strip() and not _parses(line):
            raise UserError(f"{p} line {number} is not a JSON object; the metrics are damaged: repair or remove "
                            f"that line, then resume")
    if not last.strip():
        return None
    kept = b"".join(line + b"\n" for line in whole)
    if _parses(last):  # whole, only its newline is missing
        return kept + last + b"\n", None
    return kept, last.decode("utf-8", "replace")


def drop_cut_off_row(run_dir: str) -> str | None:
    """Before a resume: drop the row `cut_off_row` finds (its step is trained again) and return it, so the
    run can say so; a whole last row without its newline gets one."""
    found = cut_off_row(run_dir)
    if found is None:
        return None
    with atomic_file(path(run_dir), "wb") as f:
        f.write(found[0])
    return found[1]


def _parses(line: bytes | str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:  # not JSON, or not UTF-8
        return False


def trim(run_dir: str, past_step: int | None = None) -> list[str]:
    """On resume: drop the rows past step `past_step` (None: all of them, when the run continues another
    run's checkpoint); the rest stay in order. Returns the dropped lines."""
    p = path(run_dir)
    if not os.path.exists(p):
        return []
    with open(p) as f:
        rows = [line for line in f if line.strip()]
    past = [past_step is None or json.loads(line).get("step", 0) > past_step for line in rows]
    if any(past):
        with atomic_file(p) as f:
            f.writelines(line for line, gone in zip(rows, past) if not gone)
    return [line for line, gone in zip(rows, past) if gone]


def set_aside(dropped_lines: Sequence[str]) -> dict[str, str] | None:
    """{file name: text} of dropped rows, for the folder an abandoned timeline is moved to."""
    return {FILE: "".join(dropped_lines)} if dropped_lines else None
