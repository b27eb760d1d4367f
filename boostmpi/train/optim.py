"""AdamW over flat buffers, the learning-rate schedule and global-norm clipping.

Weight decay (decoupled, scaled by the learning rate as in Loshchilov & Hutter) applies to every
matrix: embedding, LM head, W, A and B. Norm weights are not decayed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from boostmpi.arrays import Array
from boostmpi.backend import prefaulted
from boostmpi.model.params import FlatBuffer

if TYPE_CHECKING:
    from boostmpi.config import TrainConfig
    from boostmpi.model.params import ParamSpec


def learning_rate(step: int, tr: TrainConfig) -> float:
    """Linear warm-up to `lr` over `warmup_steps`, then cosine decay to `lr * min_lr_ratio` at the last step."""
    if step < tr.warmup_steps:
        return tr.lr * (step + 1) / tr.warmup_steps
    span = max(1, tr.steps - 1 - tr.warmup_steps)
    progress = min(1.0, (step - tr.warmup_steps) / span)
    floor = tr.lr * tr.min_lr_ratio
    return floor + 0.5 * (tr.lr - floor) * (1.0 + math.cos(math.pi * progress))


def clip_coefficient(grad_norm: float, max_norm: float) -> float:
    if max_norm <= 0 or not math.isfinite(grad_norm) or grad_norm <= max_norm:
        return 1.0
    return max_norm / (grad_norm + 1e-6)


class AdamW:
    """One update over a slice of the flat parameter buffer per step (four vector operations, no loop
    over tensors). `shard = (lo, hi)` is the slice this rank updates: the whole buffer, or under ZeRO-1
    its data-parallel share; the moments `m`, `v` exist for that slice only (flat arrays of hi - lo)."""

    def __init__(self, params: FlatBuffer, specs: Sequence[ParamSpec], tr: TrainConfig, xp: ModuleType = np,
                 shard: Sequence[int] | None = None, master: Array | None = None) -> None:
        self.params, self.tr, self.xp = params, tr, xp
        if master is None and np.dtype(params.data.dtype).itemsize < 4:
            raise ValueError(f"AdamW over {np.dtype(params.data.dtype).name} parameters would keep its moments and "
                             f"updates in that precision: pass the master weights (master=engine.master)")
        self.shard = (0, params.size) if shard is None else tuple(shard)
        lo, hi = self.shard
        # the master weights it updates: the slice of `params`, or (mixed precision under ZeRO-1) the
        # engine's own master-dtype array of that slice
        self.master = params.data[lo:hi] if master is None else master
        dtype = self.master.dtype
        self.m = prefaulted(xp.empty(hi - lo, dtype=dtype))
        self.v = prefaulted(xp.empty(hi - lo, dtype=dtype))
        # where weight decay applies: [a, b) ranges of the slice (neighbouring ones merged), instead of
        # a mask as large as the slice
        ranges: list[tuple[int, int]] = []
        for s in specs:
            if s.decay:
                a, b = params.spans[s.name]  # its block (a grouped block holds only decayed matrices)
                a, b = max(a, lo) - lo, min(b, hi) - lo
                if a < b:
                    ranges.append((a, b))
        self.decay_ranges: list[tuple[int, int]] = []
        for a, b in sorted(set(ranges)):
            if self.decay_ranges and a <= self.decay_ranges[-1][1]:
                self.decay_ranges[-1] = (self.decay_ranges[-1][0], max(b, self.decay_ranges[-1][1]))
            else:
                self.decay_ranges.append((a, b))
        self.t = 0  # updates taken (for bias correction)
        self._decay_bounds: Array | None = None  # the decay ranges as device int64 bounds, for the GPU kernel
        # on a GPU with float32 master weights one kernel does the whole update (the gradient scale
        # included) and needs no buffer of its own; the array operations of the other paths need a
        # scratch buffer and, to clip, the scaled gradient (made now, not inside the first step)
        self.fused = fused_update(xp, dtype)
        self._scratch = None if self.fused else prefaulted(xp.empty_like(self.m))
        self._scaled = prefaulted(xp.empty_like(self.m)) if tr.grad_clip > 0 and not self.fused else None

    @property
    def nbytes(self) -> int:
        """Bytes of optimizer state this rank holds (the two moments of its slice)."""
        return int(self.m.nbytes + self.v.nbytes)

    def step(self, grads: FlatBuffer | Array, lr: float, grad_scale: float = 1.0) -> None:
        """`grads`: a FlatBuffer laid out like the parameters, or the flat gradient of the slice."""
        xp, tr = self.xp, self.tr
        self.t += 1
        lo, hi = self.shard
        g = grads.data[lo:hi] if isinstance(grads, FlatBuffer) else grads
        p, m, v, tmp = self.master, self.m, self.v, self._scratch
        if self.fused and g.dtype == np.float32:  # the GPU: one fused kernel
            from boostmpi.gpu import adamw_kernels

            adamw_kernels.adamw_step(p, g, m, v, self.decay_bounds(), lr, tr.beta1, tr.beta2, tr.adam_eps, tr.weight_decay,
                               grad_scale, self.t)
            return
        # every operation in place or into the scratch buffer: no full-size temporary per step (a large
        # one is a fresh mmap every time, whose pages fault in again); the same roundings as the
        # textbook expressions in the comments
        if tmp is None:  # a fused optimizer handed a gradient the kernel does not take
            tmp = self._scratch = prefaulted(xp.empty_like(m))
        if grad_scale != 1.0:  # g = g * scale
            if self._scaled is None:
                self._scaled = prefaulted(xp.empty_like(m))
            g = xp.multiply(g, g.dtype.type(grad_scale), out=self._scaled)
        b1, b2 = tr.beta1, tr.beta2
        m *= b1  # m = b1 m + (1 - b1) g
        xp.multiply(g, 1.0 - b1, out=tmp)
        m += tmp
        v *= b2  # v = b2 v + (1 - b2) g^2
        xp.multiply(g, g, out=tmp)
        tmp *= 1.0 - b2
        v += tmp
        bc1 = 1.0 - b1 ** self.t
        bc2 = 1.0 - b2 ** self.t
        # p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)   (decoupled decay, matrices only)
        if tr.weight_decay:  # p -= (lr wd) p, where decay applies
            for a, b in self.decay_ranges:
                xp.multiply(p[a:b], lr * tr.weight_decay, out=tmp[a:b])
                p[a:b] -= tmp[a:b]
        xp.sqrt(v, out=tmp)
        tmp /= math.sqrt(bc2)
        tmp += tr.adam_eps
        xp.divide(m, tmp, out=tmp)
        tmp *= lr / bc1
        p -= tmp


    def decay_bounds(self) -> Array:
        """The decay ranges as device int64 bounds, for the fused kernel (made on first use)."""
        if self._decay_bounds is None:
            self._decay_bounds = self.xp.asarray(np.array(self.decay_ranges, np.int64).reshape(-1))
        return self._decay_bounds

    def device_scalars(self, lr: float) -> np.ndarray:
        """Counts the next update (`t`) and returns its numbers that change per step, for `step_on_device`
        to read from a device buffer they are copied into: float32 [lr wd, lr / bc1, sqrt(bc2)], the
        values `step` hands the fused kernel."""
        from boostmpi.gpu import adamw_kernels

        self.t += 1
        return adamw_kernels.adamw_scalars(lr, self.tr.beta1, self.tr.beta2, self.tr.weight_decay, self.t)

    def step_on_device(self, grad: Array, scalars: Array, grad_sq: Array, max_norm: float) -> None:
        """The fused update of `step` (a GPU, float32 master weights) with nothing of the step on the host:
        `scalars` is the device copy of `device_scalars(lr)`, and the gradient is clipped to `max_norm`
        by its norm sqrt(grad_sq) (a 0-d float64 device array) on the device, by `clip_coefficient`'s
        rule. Given the same numbers its result is bitwise that of `step`."""
        from boostmpi.gpu import adamw_kernels

        if not self.fused:
            raise ValueError("AdamW.step_on_device is the fused kernel's update: float32 master weights on a GPU")
        tr = self.tr
        adamw_kernels.adamw_step_device(self.master, grad, self.m, self.v, self.decay_bounds(), tr.beta1, tr.beta2,
                                  tr.adam_eps, tr.weight_decay, scalars, grad_sq, max_norm)


def fused_update(xp: ModuleType, dtype: np.dtype) -> bool:
    """Whether AdamW's update of master weights of `dtype` on `xp` is the one fused kernel
    (kernels/adamw.cu): on a GPU, float32."""
    return xp is not np and dtype == np.float32
