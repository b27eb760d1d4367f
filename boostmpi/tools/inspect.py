"""`boostmpi inspect CHECKPOINT [--json] [--stats]`: what a checkpoint holds.

Configuration, step, the layout that wrote it, parameter counts (actual, and dense-equivalent:
what arch = full with the same shapes would hold, each low-rank pair A [in, r], B [r, out]
counted as one in x out matrix), file sizes, whether the recorded checksums verify, and with
--stats per-tensor statistics. A checkpoint whose checksums fail is still described, then
reported as an error (exit status 2).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Literal, NotRequired, TypedDict

import numpy as np

from boostmpi import checkpoint as ckpt
from boostmpi.checkpoint import CHECKPOINT_ARG_HELP
from boostmpi.config import config_from_dict
from boostmpi.errors import CheckpointError, ConfigError
from boostmpi.tools.loading import checkpoint_dir

if TYPE_CHECKING:
    import argparse

    from numpy.typing import ArrayLike

    from boostmpi.checkpoint.reading import CheckpointState, LayoutRecord, SavedConfig
    from boostmpi.cli import Subparsers


def register(subparsers: Subparsers) -> None:
    p = subparsers.add_parser("inspect", help="describe a checkpoint: config, step, layout, parameters",
                              description="Describe a checkpoint: configuration, step, layout, parameter counts, checksums.")
    p.add_argument("checkpoint", help=CHECKPOINT_ARG_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--stats", action="store_true", help="add per-tensor statistics (mean, std, min, max, rms)")
    p.set_defaults(func=run)


StatKey = Literal["mean", "std", "min", "max", "rms"]
STAT_KEYS: tuple[StatKey, ...] = ("mean", "std", "min", "max", "rms")


class TensorStats(TypedDict):
    mean: float
    std: float
    min: float
    max: float
    rms: float


class TensorReport(TypedDict):
    """A tensor in `describe`'s report: its shape and dtype, with --stats its statistics."""

    shape: list[int]
    dtype: str
    mean: NotRequired[float]
    std: NotRequired[float]
    min: NotRequired[float]
    max: NotRequired[float]
    rms: NotRequired[float]


class ChecksumReport(TypedDict):
    ok: bool
    problem: str | None  # the first failure's line


class CheckpointReport(TypedDict):
    """What `describe` returns (and `inspect --json` prints)."""

    checkpoint: str
    step: int
    layout: LayoutRecord | None  # None: state.json records none
    config: SavedConfig
    parameters: dict[str, int]  # actual, dense_equivalent
    files: dict[str, int]  # name -> bytes
    checksums: ChecksumReport
    tensors: dict[str, TensorReport]


def tensor_stats(values: ArrayLike) -> TensorStats:
    v = np.asarray(values, dtype=np.float64)
    return {"mean": float(v.mean()), "std": float(v.std()), "min": float(v.min()), "max": float(v.max()),
            "rms": float(np.sqrt(np.mean(v * v)))}


def parameter_counts(shapes: Mapping[str, Sequence[int]]) -> tuple[int, int]:
    """(actual, dense-equivalent) parameter counts of {name: shape}."""
    actual = sum(int(np.prod(s)) for s in shapes.values())
    dense = 0
    for name, shape in shapes.items():
        if name.endswith("/A") and name[:-1] + "B" in shapes:
            dense += shape[0] * shapes[name[:-1] + "B"][1]  # d_in x d_out
        elif not name.endswith("/B"):
            dense += int(np.prod(shape))
    return actual, dense


def describe(path: str, stats: bool = False) -> CheckpointReport:
    """Everything `inspect` reports, as a JSON-ready dict (never raises for failed checksums).

    The checkpoint is held for the whole read (checkpoint.hold). When the checksum of a rank file fails it
    is described from model.h5's metadata alone (no tensor is read, so no statistics); a damaged model.h5
    is never opened (HDF5 may crash on one) and is refused with the checksum's line."""
    directory = checkpoint_dir(path)
    try:
        held = ckpt.hold(directory)
        checksums: ChecksumReport = {"ok": True, "problem": None}
    except CheckpointError as exc:
        checksums = {"ok": False, "problem": str(exc)}
        try:  # described from model.h5's metadata, if model.h5 itself is intact: HDF5 may crash on a damaged file
            ckpt.verify(directory, files=["model.h5"])
            held = ckpt.hold(directory, check=False)
        except CheckpointError:  # the checksum's line says why
            raise exc from None
    with held:
        try:
            datasets = held.datasets()
        except (OSError, RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(checksums["problem"] or f"{held.path('model.h5')} cannot be described: {exc}") from exc
        tensors: dict[str, TensorReport] = {name: {"shape": list(d.shape), "dtype": str(d.dtype)}
                                            for name, d in datasets.items()}
        if stats and checksums["ok"]:
            for name, values in held.tensors().items():
                tensors[name].update(tensor_stats(values))
        tensors = {name: tensors[name] for name in sorted(tensors, key=_natural_key)}
        step, saved = held.step, held.config
    try:
        state: CheckpointState = ckpt.read_state(directory)
    except (OSError, ValueError):
        state = {}
    actual, dense = parameter_counts({name: t["shape"] for name, t in tensors.items()})
    files = {name: os.path.getsize(os.path.join(directory, name))
             for name in sorted(os.listdir(directory))
             if not name.startswith(".") and os.path.isfile(os.path.join(directory, name))}
    return {"checkpoint": directory, "step": step, "layout": state.get("layout"), "config": saved,
            "parameters": {"actual": actual, "dense_equivalent": dense}, "files": files,
            "checksums": checksums, "tensors": tensors}


def _natural_key(name: str) -> list[tuple[int, int, str]]:
    """layers/2 before layers/10."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in name.split("/")]


def format_report(info: CheckpointReport, stats: bool = False) -> str:
    """The human-readable report of a `describe` dict."""
    m = info["config"].get("model", {})
    layout = info["layout"]
    written_by = (f"tp {layout.get('tp')} x pp {layout.get('pp')} x dp {layout.get('dp')} ({layout.get('tp_mode')})"
                  if layout else "unknown (no state.json layout record)")
    rank = f"  rank {m.get('rank')} (attn {m.get('attn_rank')}, mlp {m.get('mlp_rank')})" if m.get("arch") != "full" else ""
    p = info["parameters"]
    ratio = p["actual"] / p["dense_equivalent"] if p["dense_equivalent"] else float("nan")
    checks = "ok" if info["checksums"]["ok"] else f"FAILED: {info['checksums']['problem']}"
    lines = [
        f"checkpoint   {info['checkpoint']}",
        f"step         {info['step']}",
        f"written by   {written_by}",
        f"model        {m.get('arch')}  vocab {m.get('vocab_size')}  d_model {m.get('d_model')}  layers {m.get('n_layers')}  "
        f"heads {m.get('n_heads')} (kv {m.get('n_kv_heads')})  d_ff {m.get('d_ff')}{rank}  seq_len {m.get('seq_len')}",
        f"parameters   {p['actual']:,} actual, {p['dense_equivalent']:,} dense-equivalent ({ratio:.3f}x)",
        "files        " + ", ".join(f"{name} {size:,} B" for name, size in info["files"].items()),
        f"checksums    {checks}",
        "",
    ]
    width = max(len(name) for name in info["tensors"]) if info["tensors"] else 0
    header = f"{'tensor':<{width}}  {'shape':<14} dtype"
    if stats:
        header += f"  {'mean':>10} {'std':>10} {'min':>10} {'max':>10} {'rms':>10}"
    lines.append(header)
    for name, t in info["tensors"].items():
        row = f"{name:<{width}}  {'x'.join(map(str, t['shape'])):<14} {t['dtype']}"
        if stats:
            row += "  " + " ".join(f"{t[k]:>10.4g}" for k in STAT_KEYS)
        lines.append(row)
    lines += ["", "configuration:", _config_toml(info["config"]).rstrip()]
    return "\n".join(lines)


def _config_toml(saved: SavedConfig) -> str:
    try:
        return config_from_dict(saved).to_toml()
    except ConfigError as exc:  # recorded by another version: show it as it is
        return json.dumps(saved, indent=1, sort_keys=True) + f"\n(not valid for this version: {exc})"


def run(args: argparse.Namespace) -> int:
    info = describe(args.checkpoint, stats=args.stats)
    print(json.dumps(info) if args.json else format_report(info, stats=args.stats))
    if not info["checksums"]["ok"]:
        raise CheckpointError(info["checksums"]["problem"])
    return 0
