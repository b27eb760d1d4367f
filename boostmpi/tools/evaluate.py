"""`boostmpi eval CHECKPOINT --data SHARD|GLOB [--max-windows N] [--batch-size B]`.

Prints one JSON line: `loss` (the mean over the evaluation windows of every shard: consecutive
windows x = tok[kT : kT+T], y = tok[kT+1 : kT+T+1]), `tokens` (windows x seq_len), `windows`,
`shards`, `step`. Runs on one process, whatever layout wrote the checkpoint.
"""

from __future__ import annotations

import glob
import json
import os
from typing import TYPE_CHECKING

from boostmpi.checkpoint import CHECKPOINT_ARG_HELP
from boostmpi.data.shards import eval_windows, open_shard, resolve_shards, window_count
from boostmpi.errors import UserError
from boostmpi.tools.loading import load_checkpoint_engine

if TYPE_CHECKING:
    import argparse

    from boostmpi.cli import Subparsers
    from boostmpi.config import Config
    from boostmpi.parallel.engine import Engine


def register(subparsers: Subparsers) -> None:
    p = subparsers.add_parser("eval", help="mean loss of a checkpoint on a token shard (one JSON line)",
                              description="Evaluate a checkpoint on the consecutive windows of a token shard.")
    p.add_argument("checkpoint", help=CHECKPOINT_ARG_HELP)
    p.add_argument("--data", required=True, metavar="SHARD",
                   help="llm.c token shard, or a glob of them in quotes (e.g. 'data/mine/val_*.bin'): the mean over all")
    p.add_argument("--max-windows", type=int, default=None, metavar="N",
                   help="evaluate at most N windows in all, the first shards' first (default: all)")
    p.add_argument("--batch-size", type=int, default=8, metavar="B", help="windows per forward pass (default %(default)s)")
    p.set_defaults(func=run)


def evaluate_shards(engine: Engine, cfg: Config, spec: str | os.PathLike[str], max_windows: int | None = None,
                    batch_size: int = 8) -> tuple[float, int, int]:
    """(mean loss over the windows, number of windows, number of shards used) of a shard path or glob.
    Of several shards, one too short for a window is passed over; a single one is an error."""
    if batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {batch_size}")
    if max_windows is not None and max_windows < 1:
        raise UserError(f"--max-windows must be at least 1, got {max_windows}")
    paths = resolve_shards(spec) if glob.has_magic(os.fspath(spec)) else [os.fspath(spec)]
    T = cfg.model.seq_len
    total, windows, used = 0.0, 0, 0
    for path in paths:
        left = None if max_windows is None else max_windows - windows
        if left == 0:
            break
        tokens = open_shard(path, cfg.model.vocab_size)
        if len(paths) > 1 and window_count(len(tokens), T) == 0:
            continue
        x, y = eval_windows(tokens, T, left, name=path)
        for summed in engine.evaluate_batches([(x[s:s + batch_size], y[s:s + batch_size])
                                               for s in range(0, len(x), batch_size)]):
            total += summed
        windows += len(x)
        used += 1
    if windows == 0:
        raise UserError(f"no shard matching {spec!r} holds a window of seq_len + 1 = {T + 1} tokens")
    return total / windows, windows, used


def run(args: argparse.Namespace) -> int:
    engine, cfg, step = load_checkpoint_engine(args.checkpoint)
    loss, windows, shards = evaluate_shards(engine, cfg, args.data, args.max_windows, args.batch_size)
    print(json.dumps({"loss": loss, "tokens": windows * cfg.model.seq_len, "windows": windows, "shards": shards,
                      "step": step}))
    return 0
