"""Costs: seconds of one operation of a plan, and of a forward or backward pass of a plan, on a machine.

GEMMs are a roofline with shape-dependent efficiency (tile and wave quantisation, split-K, the
fixed cost of a tile), elementwise kernels stream their passes at a fraction of the memory
bandwidth, the fused attention runs at its backend's rate from the profile
(`attention_rates.py`), and collectives are ring algorithms over the link their group runs on.
docs/SIM.md gives every formula and constant.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from boostmpi.sim.attention_rates import LIBRARY_VARIANT, attention_seconds, own_variant, resolve_backend
from boostmpi.sim.operations import Attention, Collective, Gemm, Op, Pointwise, Shape

if TYPE_CHECKING:
    from boostmpi.sim.machines import Machine

from boostmpi.precision import ITEMSIZE  # bytes per element of each train.dtype (sim/ imports it from here)


# GPU BLAS libraries pick their tile per problem: smaller output tiles for small outputs, at a
# lower fraction of peak (less reuse per loaded operand). (tile divisor m, tile divisor n, relative
# efficiency); an assumption documented in docs/SIM.md, not fitted to any measurement.
GPU_TILE_CHOICES = ((1, 1, 1.0), (2, 1, 0.92), (2, 2, 0.85), (4, 2, 0.7))


def gemm_seconds(m: int, n: int, k: int, batch: int, itemsize: int, machine: "Machine", dtype: str) -> float:
    """The fastest of the tile configurations a GPU library could pick (one fixed tile on CPUs)."""
    if machine.device != "gpu":
        return _gemm_seconds_with_tile(m, n, k, batch, itemsize, machine, dtype, 1, 1, 1.0)
    return min(_gemm_seconds_with_tile(m, n, k, batch, itemsize, machine, dtype, dm, dn, eff)
               for dm, dn, eff in GPU_TILE_CHOICES)


def _gemm_seconds_with_tile(m: int, n: int, k: int, batch: int, itemsize: int, machine: "Machine", dtype: str,
                            div_m: int, div_n: int, tile_efficiency: float) -> float:
    """Roofline of one GEMM with an efficiency that falls for small or thin shapes.

    Tile quantisation (a partial output tile costs a whole one), wave quantisation (the last wave
    of tiles leaves compute units idle; split-K fills them when the output is small and k long),
    the fixed prologue/epilogue of a tile (k/(k + k0)) and, on CPUs, packing overheads of thin
    operands (m/(m + c), n/(n + c)).
    """
    flops = 2.0 * m * n * k * batch
    tm, tn, units = machine.gemm_tile_m // div_m, machine.gemm_tile_n // div_n, machine.compute_units
    tiles = math.ceil(m / tm) * math.ceil(n / tn) * batch
    split = 1
    if tiles < units:  # split-K: several units share one output tile along k
        split = max(1, min(units // tiles, int(k // (4 * machine.gemm_k_overhead)) or 1))
    work = tiles * split
    waves = math.ceil(work / units)
    occupancy = (m * n * batch) / (tiles * tm * tn) * work / (waves * units)
    k_per_unit = k / split
    pipeline = k_per_unit / (k_per_unit + machine.gemm_k_overhead)
    c = machine.gemm_mn_overhead
    thin = (m / (m + c)) * (n / (n + c))
    rate = machine.peak(dtype) * machine.gemm_efficiency * tile_efficiency * occupancy * pipeline * thin
    # split-K's partial tiles are written and read back in the accumulation type: float32 for
    # float32/16-bit operands, float64 for float64 ones
    moved = itemsize * batch * (m * k + k * n + m * n) + (split - 1) * max(4, itemsize) * m * n * batch
    stream = machine.memory_bandwidth * machine.elementwise_efficiency
    return max(flops / rate, moved / stream) + machine.kernel_launch_s


def pointwise_seconds(elements: float, passes: float, itemsize: int, machine: "Machine", kernels: int = 1) -> float:
    stream = machine.memory_bandwidth * machine.elementwise_efficiency
    return passes * elements * itemsize / stream + kernels * machine.kernel_launch_s


def flash_seconds(op: Attention, backward: bool, machine: "Machine", dtype: str, backend: str = "auto",
                  deterministic: bool = True) -> float:
    """The fused attention core of `op` (B x local heads of T x Dh, causal) run by `backend`
    (train.attention's value; "auto" resolved for the machine) at the profile's rate: a whole call,
    its launches included in the measured rate. `deterministic` = train.deterministic (cudnn and
    torch: False prices their non-deterministic variant)."""
    backend = resolve_backend(backend, machine)
    variant = own_variant(machine, dtype) if backend == "own" else None if deterministic else LIBRARY_VARIANT
    return attention_seconds(machine, backend, variant, 1, op.heads, op.T, op.Dh,
                             "backward" if backward else "forward")


@dataclass(frozen=True)
class Link:
    bandwidth: float
    latency: float


def group_link(machine: "Machine", size: int, stride: int) -> Link:
    """The link a group of `size` ranks, `stride` world ranks apart, runs over (tp fastest-varying)."""
    if fits_in_node(machine, size, stride):
        return Link(machine.intra_node_bandwidth, machine.intra_node_latency)
    return Link(machine.inter_node_bandwidth, machine.inter_node_latency)


def fits_in_node(machine: "Machine", size: int, stride: int) -> bool:
    gpn = machine.gpus_per_node
    return size <= 1 or (size * stride <= gpn and gpn % (size * stride) == 0)


def allreduce_seconds(nbytes: float, size: int, link: Link) -> float:
    """Ring all-reduce: 2(p-1) steps, each member sends 2(p-1)/p of the buffer."""
    if size <= 1 or nbytes == 0:
        return 0.0
    return 2 * (size - 1) * link.latency + 2 * (size - 1) / size * nbytes / link.bandwidth


def p2p_seconds(nbytes: float, link: Link) -> float:
    return link.latency + nbytes / link.bandwidth


def members_per_node(machine: "Machine", size: int, stride: int) -> int:
    """How many of a group's `size` members (`stride` world ranks apart) share one node."""
    if stride >= machine.gpus_per_node:
        return 1
    return max(1, min(size, machine.gpus_per_node // stride))


def group_allreduce_seconds(nbytes: float, size: int, stride: int, machine: "Machine",
                            fraction: float = 1.0) -> float:
    """All-reduce of `nbytes` over a group, by level: a ring inside a node when the group fits in
    one; otherwise hierarchical, as NCCL runs it across nodes: reduce-scatter among the group's
    members on each node (NVLink), the cross-node all-reduce of each member's 1/local share over
    its own share of the node's NICs (`inter_node_bandwidth` per device, all local members in
    parallel), all-gather on the node. `fraction` = 0.5 gives a reduce-scatter or an all-gather
    alone (half the steps and bytes of an all-reduce)."""
    if size <= 1 or nbytes == 0:
        return 0.0
    if fits_in_node(machine, size, stride):
        return fraction * allreduce_seconds(nbytes, size, group_link(machine, size, stride))
    local = members_per_node(machine, size, stride)
    nodes = -(-size // local)
    intra = Link(machine.intra_node_bandwidth, machine.intra_node_latency)
    inter = Link(machine.inter_node_bandwidth, machine.inter_node_latency)
    return fraction * (allreduce_seconds(nbytes, local, intra)
                       + allreduce_seconds(nbytes / local, nodes, inter))


# ------------------------------------------------------------------ one stage, one micro-batch
@dataclass
class PassTimes:
    """Seconds of one pass of a set of ops, by breakdown category."""
    gemm: float = 0.0
    elementwise: float = 0.0
    tp_comm: float = 0.0
    attention: float = 0.0  # the fused attention core (flash); materialised scores are GEMMs and elementwise

    def add(self, other: "PassTimes", times: float = 1.0) -> None:
        self.gemm += other.gemm * times
        self.elementwise += other.elementwise * times
        self.tp_comm += other.tp_comm * times
        self.attention += other.attention * times

    @property
    def total(self) -> float:
        return self.gemm + self.elementwise + self.tp_comm + self.attention


def pass_times(ops: Sequence[Op], backward: bool, s: Shape, machine: "Machine", dtype: str) -> PassTimes:
    """Time of the forward (or backward) of `ops` on one tensor-parallel rank (tp ranks are
    consecutive world ranks: inside a node when the group fits, hierarchical across nodes)."""
    t = PassTimes()
    e = ITEMSIZE[dtype]
    for op in ops:
        if isinstance(op, Gemm):
            if backward:  # dx = dy @ w^T and dw = x^T @ dy (over dw_split column blocks)
                t.gemm += gemm_seconds(op.m, op.k, op.n, op.batch, e, machine, dtype)
                t.gemm += op.dw_split * gemm_seconds(op.k, op.n // op.dw_split, op.m, op.batch, e, machine, dtype)
            else:  # inside the previous GEMM's batched launch: its work without a launch of its own
                t.gemm += gemm_seconds(op.m, op.n, op.k, op.batch, e, machine, dtype) - op.batched_fwd * machine.kernel_launch_s
        elif isinstance(op, Pointwise):
            passes, kernels = (op.bwd_passes, op.bwd_kernels) if backward else (op.fwd_passes, op.fwd_kernels)
            t.elementwise += pointwise_seconds(op.elements, passes, e, machine, kernels)
        elif isinstance(op, Attention):
            t.attention += flash_seconds(op, backward, machine, dtype, s.attention_backend, s.attention_deterministic)
        elif isinstance(op, Collective) and (op.phase == "bwd") == backward:
            if op.kind == "allreduce":
                t.tp_comm += group_allreduce_seconds(op.nbytes(e), s.p, 1, machine)
            elif op.kind == "reducescatter":  # the first half of an all-reduce of the whole tensor
                t.tp_comm += group_allreduce_seconds(op.nbytes(e), s.p, 1, machine, fraction=0.5)
            else:  # an all-gather of p contributions: half an all-reduce of all of them
                t.tp_comm += group_allreduce_seconds(op.nbytes(e) * s.p, s.p, 1, machine, fraction=0.5)
    return t
