"""`boostmpi sim --sweep --gpus N`: every layout and arch of a model on N devices, ranked by time.

The global batch (sequences per optimizer step) and the micro-batch size stay as configured;
each layout takes the gradient accumulation that keeps the global batch, and the configured
`parallel.virtual_stages` where it has a pipeline (plain 1F1B where it has none). A layout is
dropped when the configuration validation rejects it (divisibility of heads, ranks, layers,
batch), when `train` could not run it (`Config.sim_only`; unless the configuration itself asks for
what only `sim` prices, such as `zero_stage = 3` or `sequence_parallel`) or when it does not fit in
device memory.
"""

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, TypedDict

from boostmpi.errors import UserError
from boostmpi.sim.model import predict

if TYPE_CHECKING:
    from boostmpi.config import Config, Value
    from boostmpi.sim.machines import Machine

ARCH_MODES = {"full": ("vanilla",), "svd": ("btp", "vanilla"), "cola": ("btp", "vanilla")}
RECOMPUTE = {"full": ("none", "layer"), "svd": ("none", "layer", "lowrank"),
             "cola": ("none", "layer", "lowrank")}


class SweepRow(TypedDict):
    """One layout of a sweep: what it is, its predicted step and whether it fits."""

    arch: str
    tp: int
    pp: int
    dp: int
    tp_mode: str
    virtual_stages: int
    recompute: str
    grad_accum: int
    time_s: float
    tokens_per_s: float
    mfu: float
    memory_gib: float
    fits: bool
    breakdown: dict[str, float]


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending, in O(sqrt(n)) steps (--gpus may be any size)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def layouts(gpus: int) -> Iterator[tuple[int, int, int]]:
    """(tp, pp, dp) with tp * pp * dp = gpus."""
    for tp in divisors(gpus):
        for pp in divisors(gpus // tp):
            yield tp, pp, gpus // (tp * pp)


def sweep(cfg: "Config", machine: "Machine", gpus: int, archs: Sequence[str] | None = None,
          keep_infeasible: bool = False) -> list[SweepRow]:
    """Predictions for every feasible (arch, tp mode, recompute, tp, pp, dp), fastest first."""
    if gpus < 1:
        raise UserError(f"--gpus must be positive, got {gpus}")
    global_batch = cfg.train.micro_batch_size * cfg.train.grad_accum * cfg.parallel.dp
    rows: list[SweepRow] = []
    for arch in archs or ARCH_MODES:
        for tp, pp, dp in layouts(gpus):
            per_accum = cfg.train.micro_batch_size * dp
            if global_batch % per_accum:
                continue  # this dp cannot keep the configured global batch
            modes = ARCH_MODES[arch] if tp > 1 else ARCH_MODES[arch][:1]
            for mode in modes:
                for recompute in RECOMPUTE[arch]:
                    changes: dict[str, Value] = {"model.arch": arch, "parallel.tp": tp, "parallel.pp": pp,
                               "parallel.dp": dp, "parallel.tp_mode": mode,
                               "parallel.virtual_stages": cfg.parallel.virtual_stages if pp > 1 else 1,
                               "train.recompute": recompute,
                               "train.global_batch_size": global_batch,
                               "train.grad_accum": global_batch // per_accum}
                    try:
                        candidate = cfg.replace(**changes)
                    except UserError:
                        continue  # the configuration validation rejects this layout
                    if candidate.sim_only() and not cfg.sim_only():
                        continue  # a layout to run is what the sweep ranks (unless sim-only was asked for)
                    p = predict(candidate, machine)
                    if not p.memory_bytes["fits"] and not keep_infeasible:
                        continue
                    rows.append({"arch": arch, "tp": tp, "pp": pp, "dp": dp, "tp_mode": mode,
                                 "virtual_stages": candidate.parallel.virtual_stages,
                                 "recompute": recompute, "grad_accum": global_batch // per_accum,
                                 "time_s": p.time_s, "tokens_per_s": p.tokens_per_s, "mfu": p.mfu,
                                 "memory_gib": p.memory_bytes["total"] / 2**30,
                                 "fits": bool(p.memory_bytes["fits"]), "breakdown": p.breakdown})
    rows.sort(key=lambda r: r["time_s"])
    return rows


# what a step's time is made of, for explaining the winner's margin
PARTS = {"compute": ("gemm", "elementwise", "attention", "optimizer"), "tp comm": ("tp_comm",),
         "pipeline bubble + p2p": ("pp_bubble_and_p2p",), "dp comm": ("dp_comm",)}


def parts(breakdown: Mapping[str, float]) -> dict[str, float]:
    return {name: sum(breakdown[k] for k in keys) for name, keys in PARTS.items()}


def describe(row: SweepRow) -> str:
    return (f"{row['arch']} tp={row['tp']} pp={row['pp']} dp={row['dp']} {row['tp_mode']} "
            f"recompute={row['recompute']}")


def explain_winner(rows: Sequence[SweepRow]) -> list[str]:
    """Lines on what the fastest layout is made of and where it gains over the runner-up."""
    fitting = [r for r in rows if r["fits"]]
    if not fitting:
        return []
    best = fitting[0]
    mine = parts(best["breakdown"])
    shares = ", ".join(f"{name} {seconds / best['time_s']:.0%}" for name, seconds in mine.items())
    lines = [f"fastest: {describe(best)}: {best['time_s']:.4f} s ({shares})"]
    if len(fitting) > 1:
        second = fitting[1]
        margin = second["time_s"] - best["time_s"]
        theirs = parts(second["breakdown"])
        deltas = sorted(((theirs[n] - mine[n], n) for n in PARTS), reverse=True)
        gains = ", ".join(f"{name} {delta:+.4f} s" for delta, name in deltas if abs(delta) >= 5e-5)
        lines.append(f"margin over #2 ({describe(second)}): {margin:.4f} s "
                     f"({margin / second['time_s']:.1%} of its step); #2 spends more on: {gains or 'nothing'}")
    unfit = [r for r in rows if not r["fits"] and r["time_s"] < best["time_s"]]
    if unfit:
        r = unfit[0]
        lines.append(f"faster but does not fit: {describe(r)}: {r['time_s']:.4f} s, "
                     f"needs {r['memory_gib']:.1f} GiB")
    return lines


def format_table(rows: Sequence[SweepRow], top: int = 20) -> str:
    header = f"{'#':>3} {'arch':5} {'tp':>3} {'pp':>3} {'dp':>4} {'mode':8} {'recompute':9} " \
             f"{'accum':>5} {'time_s':>9} {'tokens/s':>11} {'mfu':>6} {'mem_GiB':>8} {'fits':>4}"
    lines = [header]
    for i, r in enumerate(rows[:top], 1):
        lines.append(f"{i:>3} {r['arch']:5} {r['tp']:>3} {r['pp']:>3} {r['dp']:>4} {r['tp_mode']:8} "
                     f"{r['recompute']:9} {r['grad_accum']:>5} {r['time_s']:>9.4f} "
                     f"{r['tokens_per_s']:>11.0f} {r['mfu']:>6.1%} {r['memory_gib']:>8.1f} "
                     f"{'yes' if r['fits'] else 'NO':>4}")
    if len(rows) > top:
        lines.append(f"... {len(rows) - top} more layouts (--top to show more)")
    return "\n".join(lines)
