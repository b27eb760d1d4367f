"""`boostmpi plot RUN_DIR... --out FILE.png [--x tokens|step]`: training curves of runs, overlaid.

Three panels from each run's metrics.jsonl (docs/FORMATS.md, Runs and metrics): loss (solid) and validation loss
(dashed, dots) against tokens or steps; throughput (tokens_per_s) per step; communication bytes
per step for each process-grid axis (tp solid, pp dashed, dp dotted; an axis that never
communicated is left out, and a panel with no communication at all says so). One colour per
run, labelled by the run directory's name. Needs matplotlib (drawn with its Agg backend).
"""

import json
import os

from boostmpi.errors import UserError

AXES = ("tp", "pp", "dp")
AXIS_STYLES = {"tp": "-", "pp": "--", "dp": ":"}


def register(subparsers):
    p = subparsers.add_parser("plot", help="PNG of loss, throughput and communication of one or more runs",
                              description="Plot loss, validation loss, throughput and communication of runs, overlaid.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (each holds metrics.jsonl)")
    p.add_argument("--out", required=True, metavar="FILE.png", help="the PNG file to write")
    p.add_argument("--x", choices=("tokens", "step"), default="tokens", help="x axis of the loss panel (default %(default)s)")
    p.set_defaults(func=run)


def read_metrics(run_dir):
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


def run_labels(run_dirs):
    """Each run's directory name, or the path as given where two names coincide."""
    names = [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    return [name if names.count(name) == 1 else d for name, d in zip(names, run_dirs)]


def series(rows, x_key, y_key):
    """(xs, ys) of the rows that have both keys."""
    picked = [(r[x_key], r[y_key]) for r in rows if r.get(x_key) is not None and r.get(y_key) is not None]
    return [p[0] for p in picked], [p[1] for p in picked]


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise UserError(f"boostmpi plot needs matplotlib, which is not importable ({type(exc).__name__}: {exc})") from exc
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def make_figure(run_dirs, x="tokens"):
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
        comm_rows = [r for r in rows if isinstance(r.get("comm_bytes"), dict)]
        for axis in AXES:
            steps = [r["step"] for r in comm_rows]
            nbytes = [r["comm_bytes"].get(axis, 0) for r in comm_rows]
            if any(nbytes):
                ax_comm.plot(steps, nbytes, AXIS_STYLES[axis], color=color, label=f"{label} {axis}")
    ax_loss.set(title="loss", xlabel=x, ylabel="cross-entropy")
    ax_speed.set(title="throughput", xlabel="step", ylabel="tokens / s")
    ax_comm.set(title="communication per step", xlabel="step", ylabel="bytes")
    if ax_comm.get_lines():
        ax_comm.set_yscale("log")
    else:
        ax_comm.text(0.5, 0.5, "no communication\n(single process)", ha="center", va="center",
                     transform=ax_comm.transAxes)
    for ax in (ax_loss, ax_speed, ax_comm):
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize="small")
    fig.tight_layout()
    return fig, sum(len(ax.get_lines()) for ax in (ax_loss, ax_speed, ax_comm))


def run(args):
    parent = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(parent):
        raise UserError(f"--out {args.out}: the folder {parent} does not exist")
    fig, n_series = make_figure(args.run_dirs, args.x)
    try:
        fig.savefig(args.out, format="png", dpi=100)
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    print(f"wrote {args.out}: {len(args.run_dirs)} run(s), {n_series} series")
    return 0
