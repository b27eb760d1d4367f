"""Pricing an op trace of the engine's own GPU step with a machine profile.

A trace is what one training step launches, op by op, as recorded on the CuPy stand-in
(`bench/gpu_trace.py`): every GEMM with its shape and dtype, every other kernel (elementwise
ufunc, reduction, copy, gather, fused RawKernel) with the bytes it reads and writes, every
collective with its bytes. Each op is priced as the analytical model prices its own ops
(`costs.py`): a GEMM by the same roofline with tile/wave quantisation, any other kernel as a
stream of its bytes at `memory.bandwidth x elementwise_efficiency` plus `kernel_launch_s`, a
collective by the same ring/hierarchical formulas over the tensor-parallel group. The difference
to the analytical model is then what the implementation does that the model does not assume:
extra passes, unfused elementwise chains, copies, more launches.
"""

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from boostmpi.sim.attention_rates import attention_rate
from boostmpi.sim.costs import (ITEMSIZE, gemm_seconds, group_allreduce_seconds, group_link, p2p_seconds,
                                pointwise_seconds)
from boostmpi.sim.operations import Attention, Collective, Gemm, Pointwise, Shape
from boostmpi.sim.plans import layer_plan, recompute_plan

if TYPE_CHECKING:
    from boostmpi.sim.machines import Machine


@dataclass
class TracedOp:
    kind: str  # "gemm", "elementwise", "reduction", "copy", "kernel" (a fused RawKernel), "attention", "collective"
    name: str  # ufunc / kernel / collective name
    site: str  # the boostmpi function that issued it (module.function)
    nbytes: int  # bytes read + written (collectives: the payload each rank contributes)
    dtype: str = "float32"
    gemm: tuple[int, int, int, int] | None = None  # (batch, m, n, k) for GEMMs
    flops: float = 0.0  # "attention": its share of the call's causal FLOPs (attention_rates.causal_flops)
    cublas: tuple[int, int, int, int] | None = None  # GEMMs: (Atype, Btype, Ctype, compute type) of the cuBLAS call
    # "attention": the backend that ran it, the own kernels' variant ("wmma", "fma"; None: by dtype, WMMA
    # for bfloat16), the head dim (0: the kernel's head tile, 64 for a "_hd64" entry, else 128) and the
    # direction ("forward", "backward"; None: by the kernel's name)
    backend: str = "own"
    variant: str | None = None
    head_dim: int = 0
    direction: str | None = None


def attention_op_rate(op: TracedOp, machine: "Machine") -> tuple[float, str]:
    """(FLOP/s, source) the profile gives the attention launch `op` (attention_rates.attention_rate)."""
    variant = op.variant or ("wmma" if op.dtype == "bfloat16" else "fma")
    head_dim = op.head_dim or (64 if "_hd64" in op.name else 128)
    direction = op.direction or ("forward" if "forward" in op.name else "backward")
    return attention_rate(machine, op.backend, variant, head_dim, direction)


def op_seconds(op: TracedOp, machine: "Machine", tp: int) -> float:
    if op.kind == "gemm":
        assert op.gemm is not None  # a GEMM carries its shape
        batch, m, n, k = op.gemm
        dtype = op.dtype if op.dtype in ITEMSIZE else "float32"
        return gemm_seconds(m, n, k, batch, ITEMSIZE[dtype], machine, dtype)
    if op.kind == "collective":
        if op.name == "send" or op.name == "recv":
            return p2p_seconds(op.nbytes, group_link(machine, 2, tp))
        fraction = 0.5 if op.name == "allGather" else 1.0
        size = op.nbytes * (tp if op.name == "allGather" else 1)
        return group_allreduce_seconds(size, tp, 1, machine, fraction=fraction)
    if op.kind == "attention":  # its FLOPs at its backend's rate in the profile, or its bytes if slower
        compute = op.flops / attention_op_rate(op, machine)[0]  # a measured call's rate: its launches included
        return max(compute, pointwise_seconds(op.nbytes, 1, 1, machine) - machine.kernel_launch_s)
    return pointwise_seconds(op.nbytes, 1, 1, machine)  # nbytes already counts every pass


OPTIMIZER_SITE = "train.optim."


def price(ops: Sequence[TracedOp], machine: "Machine", tp: int = 1) -> dict[str, float]:
    """Seconds of a trace in the model's breakdown categories ("gemm", "elementwise", "tp_comm",
    "pp_p2p": point-to-point sends and receives, "optimizer": what the optimizer module issues),
    plus the kernel launches and bytes of the non-GEMM kernels outside the optimizer."""
    out = {"gemm": 0.0, "elementwise": 0.0, "tp_comm": 0.0, "pp_p2p": 0.0, "optimizer": 0.0, "launches": 0,
           "gemm_launches": 0, "elementwise_bytes": 0}
    for op in ops:
        seconds = op_seconds(op, machine, tp)
        if op.site.startswith(OPTIMIZER_SITE):
            out["optimizer"] += seconds
            continue
        if op.kind == "gemm":
            out["gemm"] += seconds
        elif op.kind == "collective":
            out["pp_p2p" if op.name in ("send", "recv") else "tp_comm"] += seconds
        else:
            out["elementwise"] += seconds
            out["elementwise_bytes"] += op.nbytes
        out["launches"] += op.kind != "collective"
        out["gemm_launches"] += op.kind == "gemm"
    return out


def plan_launches_and_bytes(s: Shape, strategy: str, recompute: str, itemsize: int) -> tuple[int, int, float]:
    """Kernels, GEMMs and non-GEMM bytes of one layer (forward, backward, recompute) as the analytical
    model counts them: a GEMM is one kernel forward (none inside a batched launch) and 1 + dw_split
    backward, an elementwise op and the
    fused attention the kernels their plan states each way, a replayed op once more; the fused
    attention's bytes are FlashAttention-2's traffic for its shape (`operations.flash2_traffic`)."""
    ops = layer_plan(s, strategy)
    again = recompute_plan(ops, recompute) or []
    launches, gemms, moved = 0, 0, 0.0
    for op, backward in [(o, False) for o in ops + again] + [(o, True) for o in ops]:
        if isinstance(op, Gemm):
            n = 1 + op.dw_split if backward else int(not op.batched_fwd)
            launches += n
            gemms += n
        elif isinstance(op, Pointwise):
            launches += op.bwd_kernels if backward else op.fwd_kernels
            moved += (op.bwd_passes if backward else op.fwd_passes) * op.elements * itemsize
        elif isinstance(op, Attention):  # FlashAttention-2's traffic: what a fused kernel moves at best
            launches += op.bwd_kernels if backward else 1
            moved += op.traffic(itemsize)[int(backward)]
        elif isinstance(op, Collective):
            continue
    return launches, gemms, moved


def by_site(ops: Sequence[TracedOp], machine: "Machine", tp: int = 1) -> list[tuple[str, str, float, float, float]]:
    """[(site, kind, launches, bytes, seconds)] of the kernels (collectives aside), grouped by the
    function that issued them and their kind, most seconds first."""
    groups: defaultdict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])
    for op in ops:
        if op.kind == "collective":
            continue
        g = groups[(op.site, op.kind)]
        g[0] += 1
        g[1] += op.nbytes
        g[2] += op_seconds(op, machine, tp)
    return sorted(((site, kind, n, b, s) for (site, kind), (n, b, s) in groups.items()),
                  key=lambda row: -row[4])
