"""Data parallelism of one rank: the gradient summed over the dp axis bucket by bucket, and ZeRO stage 1.

With `zero_stage = 0` every dp rank all-reduces the whole gradient and updates the whole flat
buffer. With `zero_stage = 1` (ZeRO stage 1) dp rank r owns the contiguous slice `shard` of the flat
buffer (`zero_slices(size, dp)[r]`): each bucket's gradient is reduce-scattered as soon as it is
final, so rank r receives the summed gradient of its slice only (`grad_shard`); AdamW keeps moments
for that slice only and updates it; `gather_update` then all-gathers the updated slices so every
rank holds the whole buffer again. Under GPU mixed precision the float32 master weights exist for
the slice only (`weight_buffers`): the updated slice is rounded into the bf16 compute buffer, and
that buffer is what is all-gathered (docs/COMMUNICATION.md).

A bucket is one layer, the embedding or the head: its gradient is final once the last micro-batch's
backward has left it, and with `parallel.overlap` its reduction starts then, behind the backward of
the layers below it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Literal, cast, overload

import numpy as np
import numpy.typing as npt

from boostmpi.arrays import Array
from boostmpi.backend import prefaulted
from boostmpi.model.params import FlatBuffer, ParamSpec, split_range
from boostmpi.parallel.comm import Communicator, Request
from boostmpi.precision import separate_master


def zero_slices(size: int, dp: int) -> list[tuple[int, int]]:
    """The ZeRO split: [lo, hi) of each of `dp` data-parallel ranks in a flat buffer of `size` elements,
    contiguous and near-equal (the first ones one larger). Its one statement: ZeRO-1's optimizer slices
    (`DataParallel.ranges`), the elements each dp rank writes to a checkpoint (checkpoint/layout.py
    `write_range`) and the part of the initial weights each draws (`Engine.init_params`)."""
    return [split_range(size, dp, r) for r in range(dp)]


def bucket_ranges(specs: Sequence[ParamSpec], spans: Mapping[str, tuple[int, int]]) -> dict[int | str, tuple[int, int]]:
    """{bucket: (a, b)}: the flat range of each layer's parameters, of the embedding's and of the head's."""
    buckets: dict[int | str, tuple[int, int]] = {}
    for s in specs:
        key = s.layer if s.layer is not None else ("embed" if s.name == "embed" else "head")
        a, b = spans[s.name]
        lo, hi = buckets.get(key, (a, b))
        buckets[key] = (min(lo, a), max(hi, b))
    return buckets


class DataParallel:
    """The dp axis as this rank sees it. `group`: the grid's dp group; `dp_rank`: this rank's place in
    it; `specs`, `spans`, `size`: the flat buffer's layout; `dtype`: the gradients' (master) dtype."""

    def __init__(self, group: Communicator, dp_rank: int, dp_size: int, zero_stage: int, specs: Sequence[ParamSpec],
                 spans: Mapping[str, tuple[int, int]], size: int, xp: ModuleType, dtype: npt.DTypeLike) -> None:
        self.group, self.rank, self.size = group, dp_rank, dp_size
        self.sharded = zero_stage == 1 and dp_size > 1
        self.ranges = zero_slices(size, dp_size) if self.sharded else [(0, size)]
        self.shard = self.ranges[dp_rank] if self.sharded else (0, size)  # the slice this rank updates
        self.buckets = bucket_ranges(specs, spans)
        lo, hi = self.shard
        # the dp-summed gradient of the slice: its own buffer when reduce-scattered, else the whole
        # gradient buffer (`attach_gradients`)
        self.grad_shard: Array = prefaulted(xp.empty(hi - lo, dtype=dtype)) if self.sharded else None
        self._grads = cast(FlatBuffer, None)  # attach_gradients gives it, before any other call
        self._pending: list[Request] = []
        # what squared_norm_part sums, found once
        self._norm_ranges_cache: list[tuple[int, int]] | None = None
        self._norm_bounds: Array = None

    def attach_gradients(self, grads: FlatBuffer) -> None:
        """The flat gradient buffer (a FlatBuffer) whose buckets this object sums."""
        self._grads = grads
        if not self.sharded:
            self.grad_shard = grads.data

    def weight_buffers(self, specs: Sequence[ParamSpec], master_dtype: npt.DTypeLike, compute_dtype: npt.DTypeLike,
                       xp: ModuleType) -> tuple[FlatBuffer, FlatBuffer, Array, bool]:
        """(params, compute params, master weights of the slice, whether the master is its own array).

        Mixed precision (bf16 on GPUs) computes on a low-precision copy; gradients accumulate in the
        master dtype. Without ZeRO-1 the master weights are a whole flat buffer (`params`) and the
        compute copy is refreshed from it every step. With ZeRO-1 the master weights exist for this
        rank's slice only: the optimizer updates that array, `gather_update` rounds it into the
        compute buffer (then `params`, in the compute dtype) and all-gathers that buffer."""
        same = np.dtype(compute_dtype) == np.dtype(master_dtype)
        lo, hi = self.shard
        if separate_master(compute_dtype, master_dtype, self.sharded):
            params = FlatBuffer(specs, compute_dtype, xp)
            return params, params, prefaulted(xp.empty(hi - lo, dtype=master_dtype)), True
        params = FlatBuffer(specs, master_dtype, xp)
        compute = params if same else FlatBuffer(specs, compute_dtype, xp)
        return params, compute, params.data[lo:hi], False

    # ------------------------------------------------------------------ during a step
    def begin_step(self) -> None:
        self._pending = []

    def bucket_final(self, key: int | str) -> None:
        """The gradient of bucket `key` will not change again this step: with overlap, start its reduction."""
        if self.size > 1 and self.group.overlap and key in self.buckets:
            self._pending.append(self.reduce(*self.buckets[key]))

    def finish_step(self, params: FlatBuffer) -> None:
        """Every bucket reduced (waited for, or reduced now without overlap). Under ZeRO-1 the all-gather
        `gather_update` issues after the optimizer is counted here, as this step's traffic."""
        if self.size > 1:
            if self.group.overlap:
                for request in self._pending:
                    request.wait()
            else:
                for a, b in self.buckets.values():
                    self.reduce(a, b, blocking=True)
        self._pending = []
        if self.sharded:
            self.group.count_allgather_pieces(params.data, [e - s for s, e in self.ranges])

    @overload
    def reduce(self, a: int, b: int, blocking: Literal[False] = False) -> Request: ...

    @overload
    def reduce(self, a: int, b: int, blocking: Literal[True]) -> None: ...

    def reduce(self, a: int, b: int, blocking: bool = False) -> Request | None:
        """Sum the gradient range [a, b) over dp: all-reduced in place, or (ZeRO-1) reduce-scattered into
        the owners' `grad_shard`. Returns a request to wait on (None when blocking)."""
        group, grads = self.group, self._grads.data
        if not self.sharded:
            if blocking:
                group.allreduce(grads[a:b])
                return None
            return group.iallreduce(grads[a:b])
        lo, hi = self.shard
        counts = [max(0, min(b, e) - max(a, s)) for s, e in self.ranges]
        x0 = min(max(a, lo), hi)
        x1 = max(min(b, hi), x0)
        out = self.grad_shard[x0 - lo:x1 - lo]
        if blocking:
            group.reduce_scatter(grads[a:b], out, counts)
            return None
        return group.ireduce_scatter(grads[a:b], out, counts)

    def squared_norm_part(self, specs: Sequence[ParamSpec], tp_rank: int, xp: ModuleType) -> float | Array:
        """This rank's part of the squared norm of the dp-summed gradient, each element counted once
        whatever the layout: tp-replicated parameters on tp rank 0 only; without ZeRO on dp rank 0 only
        (every dp rank holds the whole sum), with ZeRO-1 every dp rank over its own slice. On a GPU
        one kernel sums the squares of every block (kernels/adamw.cu, `sum_squares_ranges`) and the
        result stays on the device (a float64 scalar; the engine reads it with the loss)."""
        ranges = self._norm_ranges(specs, tp_rank)
        g = self.grad_shard
        if xp is not np and ranges and g.dtype == np.float32:
            from boostmpi.gpu import adamw_kernels

            if self._norm_bounds is None:
                self._norm_bounds = xp.asarray(np.array(ranges, dtype=np.int64).reshape(-1))
            return adamw_kernels.sum_squares_ranges(g, self._norm_bounds)
        parts = [(g[a:b] * g[a:b]).sum() for a, b in ranges]
        if xp is np or not parts:
            return sum((float(p) for p in parts), 0.0)
        return xp.stack(parts).sum(dtype=np.float64)

    def _norm_ranges(self, specs: Sequence[ParamSpec], tp_rank: int) -> list[tuple[int, int]]:
        """The ranges [a, b) of `grad_shard` whose squares `squared_norm_part` sums (fixed for the run)."""
        if self._norm_ranges_cache is not None:
            return self._norm_ranges_cache
        lo, hi = self.shard
        ranges, seen = [], set()
        if self.sharded or self.rank == 0:
            for s in specs:
                if s.tp_replicated and tp_rank != 0:
                    continue
                a, b = self._grads.spans[s.name]  # its block (a grouped block holds no replicated tensor)
                if a in seen:
                    continue
                seen.add(a)
                a, b = max(a, lo), min(b, hi)
                if a < b:
                    ranges.append((a - lo, b - lo))
        self._norm_ranges_cache = ranges
        return ranges

    # ------------------------------------------------------------------ after the optimizer
    def gather_update(self, params: FlatBuffer, master: Array, master_separate: bool) -> None:
        """After the optimizer updated this rank's slice: under mixed-precision ZeRO-1 round it into the
        compute buffer, and under ZeRO-1 all-gather the slices so every rank holds the whole buffer."""
        if master_separate:
            lo, hi = self.shard
            params.data[lo:hi] = master
        if self.sharded:
            self.group.allgather_pieces(params.data, [e - s for s, e in self.ranges], counted=True)
