"""`boostmpi plot RUN_DIR... --out FILE.png [--x tokens|step]`: training curves of runs, overlaid.

Three panels from each run's metrics.jsonl (one JSON object per step): loss (solid) and
validation loss (dashed, dots) against tokens or steps; throughput (tokens_per_s) per step; and
the communication per step of each process-grid axis as grouped bars, one bar per run side by
side (so runs never hide each other), its height the median bytes per step, written on it in
B/KiB/MiB/GiB, a whisker from the smallest to the largest step. An axis no run communicated on
is left out, and a panel with no communication at all says so. One colour per run, labelled by
the run directory's name. Needs matplotlib (drawn with its Agg backend).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, TypeAlias, cast

from boostmpi.errors import UserError
from boostmpi.files import atomic_file, check_writable_parent, format_bytes

if TYPE_CHECKING:
    import argparse

    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from boostmpi.cli import Subparsers

    Row: TypeAlias = dict[str, object]  # a metrics.jsonl row as read (of any version: keys are looked up)

AXES = ("tp", "pp", "dp")


def register(subparsers: Subparsers) -> None:
    p = subparsers.add_parser("plot", help="PNG of loss, throughput and communication of one or more runs",
                              description="Plot loss, validation loss, throughput and communication of runs, overlaid.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (each holds metrics.jsonl)")
    p.add_argument("--out", required=True, metavar="FILE.png", help="the PNG file to write")
    p.add_argument("--x", choices=("tokens", "step"), default="tokens", help="x axis of the loss panel (default %(default)s)")
    p.set_defaults(func=run)


def read_metrics(run_dir: str) -> list[Row]:
    """The rows of `<run_dir>/metrics.jsonl`, each a dict; an error naming the problem otherwise."""
    if not os.path.isdir(run_dir):
        raise UserError(f"run directory {run_dir} does not exist")
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise UserError(f"{run_dir} holds no metrics.jsonl: it is not a run directory, or the run never logged a step")
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise UserError(f"{path} line {number} is not JSON ({exc})") from exc
            if not isinstance(row, dict) or "step" not in row:
                raise UserError(f"{path} line {number} is not a metrics row (a JSON object with a step)")
            rows.append(row)
    if not rows:
        raise UserError(f"{path} is empty: the run logged no step yet")
    return rows


def run_labels(run_dirs: Sequence[str]) -> list[str]:
    """Each run's directory name, or the path as given where two names coincide."""
    names = [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    return [name if names.count(name) == 1 else d for name, d in zip(names, run_dirs)]


def series(rows: Sequence[Row], x_key: str, y_key: str) -> tuple[list[float], list[float]]:
    """(xs, ys) of the rows that have both keys."""
    # the columns plotted (step, tokens, loss, val_loss, tokens_per_s) hold numbers
    picked = cast("list[tuple[float, float]]",
                  [(r[x_key], r[y_key]) for r in rows if r.get(x_key) is not None and r.get(y_key) is not None])
    return [p[0] for p in picked], [p[1] for p in picked]


def _pyplot() -> ModuleType:
    try:
        import matplotlib
    except ImportError as exc:
        raise UserError(f"boostmpi plot needs matplotlib, which is not importable ({type(exc).__name__}: {exc})") from exc
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def make_figure(run_dirs: Sequence[str], x: str = "tokens") -> tuple[Figure, int]:
    """(matplotlib Figure, number of line series drawn) for the runs' metrics."""
    if x not in ("tokens", "step"):
        raise UserError(f"--x must be tokens or step, got {x!r}")
    runs = [(label, read_metrics(d), d) for label, d in zip(run_labels(run_dirs), run_dirs)]
    for _, rows, d in runs:
        if x == "tokens" and not any("tokens" in r for r in rows):
            raise UserError(f"the metrics of {d} have no tokens column; plot with --x step")
    plt = _pyplot()
    fig, (ax_loss, ax_speed, ax_comm) = plt.subplots(1, 3, figsize=(16, 4.5))
    for index, (label, rows, _) in enumerate(runs):
        color = f"C{index % 10}"
        ax_loss.plot(*series(rows, x, "loss"), color=color, label=f"{label} loss")
        xs, ys = series(rows, x, "val_loss")
        if xs:
            ax_loss.plot(xs, ys, "o--", color=color, label=f"{label} val_loss")
        ax_speed.plot(*series(rows, "step", "tokens_per_s"), color=color, label=label)
    ax_loss.set(title="loss", xlabel=x, ylabel="cross-entropy")
    ax_speed.set(title="throughput", xlabel="step", ylabel="tokens / s")
    comm_series = draw_communication(ax_comm, [(label, rows) for label, rows, _ in runs])
    for ax in (ax_loss, ax_speed):
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize="small")
    fig.tight_layout()
    return fig, len(ax_loss.get_lines()) + len(ax_speed.get_lines()) + comm_series


def communication_summary(rows: Sequence[Row]) -> dict[str, tuple[float, float, float]]:
    """{axis: (median, smallest, largest) payload bytes per step} of the axes a run communicated on."""
    import numpy as np

    per_step = [c for c in (r.get("comm_bytes") for r in rows) if isinstance(c, dict)]
    summary = {}
    for axis in AXES:
        values = np.array([float(c.get(axis) or 0) for c in per_step])
        if values.size and values.any():
            summary[axis] = (float(np.median(values)), float(values.min()), float(values.max()))
    return summary


def draw_communication(ax: Axes, runs: Sequence[tuple[str, Sequence[Row]]]) -> int:
    """Grouped bars of `communication_summary` for [(label, rows)]; returns the number of bars drawn."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    summaries = [communication_summary(rows) for _, rows in runs]
    axes = [axis for axis in AXES if any(axis in s for s in summaries)]
    ax.set(title="communication per step\n(median; whisker: min to max)", ylabel="payload bytes per step")
    if not axes:
        ax.text(0.5, 0.5, "no communication\n(single process)", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        return 0
    width = 0.8 / len(runs)
    bars = 0
    for index, ((label, _), summary) in enumerate(zip(runs, summaries)):
        where = [i for i, axis in enumerate(axes) if axis in summary]
        if not where:
            continue
        medians = [summary[axes[i]][0] for i in where]
        spread = [[m - summary[axes[i]][1] for i, m in zip(where, medians)],
                  [summary[axes[i]][2] - m for i, m in zip(where, medians)]]
        drawn = ax.bar([i - 0.4 + width * (index + 0.5) for i in where], medians, width, yerr=spread, capsize=3,
                       color=f"C{index % 10}", label=label)
        ax.bar_label(drawn, labels=[format_bytes(m) for m in medians], fontsize="x-small", padding=2)
        bars += len(where)
    ax.set_xticks(range(len(axes)), [f"{axis} axis" for axis in axes])
    # ticks at round numbers of the largest binary unit below the tallest bar (0, 1, 2, 3, 4 KiB)
    top = max(summary[axis][2] for summary in summaries for axis in summary) * 1.15
    unit = 1024 ** max(0, int(math.log(top, 1024)))
    ax.set_yticks([v * unit for v in MaxNLocator(nbins=5, steps=[1, 2, 2.5, 5, 10]).tick_values(0, top / unit)
                   if 0 <= v * unit <= top])
    ax.set_ylim(0, top)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: format_bytes(value)))
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize="small")
    return bars


def run(args: argparse.Namespace) -> int:
    check_writable_parent(args.out, "--out")
    fig, n_series = make_figure(args.run_dirs, args.x)
    try:
        with atomic_file(args.out, "wb") as f:
            fig.savefig(f, format="png", dpi=100)
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    print(f"wrote {args.out}: {len(args.run_dirs)} run(s), {n_series} series")
    return 0
