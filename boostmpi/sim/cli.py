"""`boostmpi sim`: predict time, communication and memory of a configured model and layout.

    boostmpi sim --config FILE [--set section.key=value ...] --machine NAME|PROFILE.toml
                 [--json] [--plot out.png] [--sweep --gpus N [--top K] [--arch A] [--all]]
"""

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from boostmpi.errors import UserError
from boostmpi.files import atomic_file
from boostmpi.sim.machines import Machine, load_machine
from boostmpi.sim.model import BREAKDOWN_KEYS, Prediction, predict
from boostmpi.sim.sweep import SweepRow, explain_winner, format_table, sweep

if TYPE_CHECKING:
    from boostmpi.config import Config


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = subparsers.add_parser("sim", help="performance model: time, communication, memory",
                              description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="model/layout TOML (as for train)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a configuration key (repeatable)")
    p.add_argument("--machine", required=True,
                   help="built-in profile (a100-80gb, a100-40gb, h100-sxm, h200, mi250x-gcd, perlmutter, "
                        "polaris, frontier) or a profile .toml")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="FILE", help="write a bar chart of the time breakdown (.png, .pdf or .svg)")
    p.add_argument("--sweep", action="store_true", help="rank every feasible layout and arch")
    p.add_argument("--gpus", type=int, help="number of devices for --sweep")
    p.add_argument("--top", type=int, default=20, help="rows of the --sweep table")
    p.add_argument("--arch", action="append", choices=("full", "svd", "cola"),
                   help="--sweep only these archs (repeatable; default all three)")
    p.add_argument("--all", action="store_true",
                   help="--sweep also lists the layouts that do not fit in device memory")
    p.set_defaults(func=run)


PLOT_FORMATS = ("png", "pdf", "svg")


def run(args: argparse.Namespace) -> int:
    from boostmpi.config import load_config

    if args.plot is not None:
        ext = os.path.splitext(args.plot)[1].lstrip(".").lower()
        if ext not in PLOT_FORMATS:
            raise UserError(f"--plot {args.plot}: the file name must end in .{', .'.join(PLOT_FORMATS)} "
                            "(the chart's format)")
    machine = load_machine(args.machine)
    cfg = load_config(args.config, args.set, world_size=None)
    if args.sweep:
        if args.gpus is None:
            raise UserError("--sweep needs --gpus N")
        every = sweep(cfg, machine, args.gpus, archs=args.arch, keep_infeasible=True)
        fitting = [r for r in every if r["fits"]]
        if not fitting and not args.all:
            raise UserError(f"no layout of this model fits on {args.gpus} x {machine.name}")
        rows = every if args.all else fitting
        if args.json:
            print(json.dumps({"machine": machine.name, "gpus": args.gpus, "layouts": rows}))
        else:
            print(f"{len(fitting)} feasible layouts ({len(every) - len(fitting)} more do not fit) on "
                  f"{args.gpus} x {machine.name}, fastest first (global batch "
                  f"{cfg.train.micro_batch_size * cfg.train.grad_accum * cfg.parallel.dp} "
                  f"sequences of {cfg.model.seq_len} tokens)")
            print(format_table(rows, args.top))
            print("\n".join([""] + explain_winner(every)))
        if args.plot:
            plot_breakdowns([(_label(r), r["breakdown"]) for r in rows[:args.top]], args.plot,
                            f"{machine.name}, {args.gpus} devices")
        return 0
    if args.gpus is not None and args.gpus != cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp:
        raise UserError(f"--gpus {args.gpus} differs from parallel.tp * pp * dp = "
                        f"{cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp} (use --sweep to search)")
    prediction = predict(cfg, machine)
    if args.json:
        print(json.dumps(prediction.as_dict()))
    else:
        print(format_prediction(cfg, prediction, machine))
    if args.plot:
        plot_breakdowns([(_label_cfg(cfg), prediction.breakdown)], args.plot, machine.name)
    return 0


def _label(row: SweepRow) -> str:
    return f"{row['arch']} tp{row['tp']} pp{row['pp']} dp{row['dp']}\n{row['tp_mode']} {row['recompute']}"


def _label_cfg(cfg: "Config") -> str:
    p, t = cfg.parallel, cfg.train
    v = f"v{p.virtual_stages}" if p.virtual_stages > 1 else ""
    return f"{cfg.model.arch} tp{p.tp} pp{p.pp}{v} dp{p.dp}\n{p.tp_mode} {t.recompute}"


def format_prediction(cfg: "Config", p: Prediction, machine: Machine) -> str:
    par, t = cfg.parallel, cfg.train
    gib = 2**30
    chunks = f" x {par.virtual_stages} chunks (interleaved)" if par.virtual_stages > 1 else ""
    if par.sequence_parallel and par.tp > 1:
        chunks += ", sequence parallel"
    if par.zero_stage and par.dp > 1:
        chunks += f", ZeRO-{par.zero_stage}"
    lines = [f"{cfg.model.arch} model, tp={par.tp} ({p.details['strategy']}) pp={par.pp}{chunks} dp={par.dp}, "
             f"{t.grad_accum} x {t.micro_batch_size} sequences of {cfg.model.seq_len} per rank, "
             f"{t.dtype}, recompute={t.recompute}, on {p.details['gpus']} x {machine.name}",
             "",
             f"time per iteration   {p.time_s:10.4f} s   ({p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu:.1%})"]
    for key in BREAKDOWN_KEYS:
        share = p.breakdown[key] / p.time_s if p.time_s else 0.0
        lines.append(f"  {key:20s} {p.breakdown[key]:10.4f} s   {share:6.1%}")
    if t.val_every:
        lines.append(f"with validation       {p.details['time_with_validation_s']:10.4f} s   per iteration on average "
                     f"({t.val_windows} windows every {t.val_every} steps: {p.details['validation_s']:.4f} s a pass)")
    lines += ["", "communication per iteration (payload bytes, docs/COMMUNICATION.md)"]
    assert p.comm_bytes is not None  # predict() counts them for a configuration
    for axis in ("tp", "pp", "dp"):
        lines.append(f"  {axis:20s} {p.comm_bytes[axis]:>16,d} B")
    m = p.memory_bytes
    lines += ["", "memory per device"]
    for key in ("params", "grads", "optimizer", "activations", "total"):
        lines.append(f"  {key:20s} {m[key] / gib:10.2f} GiB")
    verdict = "fits" if m["fits"] else "does NOT fit"
    lines.append(f"  {verdict} in {m['capacity'] / gib:.1f} GiB")
    return "\n".join(lines)


def plot_breakdowns(labelled: Sequence[tuple[str, Mapping[str, float]]], path: str, title: str) -> None:
    """Stacked bars of the time breakdown, one bar per (label, breakdown)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise UserError(f"--plot needs matplotlib ({exc})") from None
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(labelled) + 2), 4.5))
    bottoms = [0.0] * len(labelled)
    for key in BREAKDOWN_KEYS:
        values = [b[key] for _, b in labelled]
        ax.bar(range(len(labelled)), values, bottom=bottoms, label=key)
        bottoms = [x + y for x, y in zip(bottoms, values)]
    ax.set_xticks(range(len(labelled)), [label for label, _ in labelled], fontsize=7)
    ax.set_ylabel("seconds per iteration")
    ax.set_title(f"boostmpi sim: {title}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    try:
        with atomic_file(path, "wb") as f:
            fig.savefig(f, format=os.path.splitext(path)[1].lstrip(".").lower(), dpi=120)
    except OSError as exc:
        raise UserError(f"cannot write plot {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
