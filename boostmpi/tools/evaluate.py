"""`boostmpi eval CHECKPOINT --data SHARD [--max-windows N] [--batch-size B]`.

Prints one JSON line: `loss` (the mean over the evaluation windows of docs/FORMATS.md), `tokens`
(windows x seq_len), `windows`, `step`. Runs on one process, whatever layout wrote the checkpoint.
"""

import json

from boostmpi.data.shards import eval_windows, open_shard
from boostmpi.errors import UserError
from boostmpi.tools.loading import load_checkpoint_engine


def register(subparsers):
    p = subparsers.add_parser("eval", help="mean loss of a checkpoint on a token shard (one JSON line)",
                              description="Evaluate a checkpoint on the consecutive windows of a token shard.")
    p.add_argument("checkpoint", help="run directory (its latest checkpoint), checkpoint folder, or model.h5")
    p.add_argument("--data", required=True, metavar="SHARD", help="llm.c token shard")
    p.add_argument("--max-windows", type=int, default=None, metavar="N", help="evaluate at most N windows (default: all)")
    p.add_argument("--batch-size", type=int, default=8, metavar="B", help="windows per forward pass (default %(default)s)")
    p.set_defaults(func=run)


def evaluate_shard(engine, cfg, shard, max_windows=None, batch_size=8):
    """(mean loss over the windows, number of windows) of a shard path."""
    if batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {batch_size}")
    tokens = open_shard(shard, cfg.model.vocab_size)
    x, y = eval_windows(tokens, cfg.model.seq_len, max_windows, name=shard)
    total = 0.0
    for start in range(0, len(x), batch_size):
        total += engine.evaluate(x[start:start + batch_size], y[start:start + batch_size])
    return total / len(x), len(x)


def run(args):
    engine, cfg, step = load_checkpoint_engine(args.checkpoint)
    loss, windows = evaluate_shard(engine, cfg, args.data, args.max_windows, args.batch_size)
    print(json.dumps({"loss": loss, "tokens": windows * cfg.model.seq_len, "windows": windows, "step": step}))
    return 0
