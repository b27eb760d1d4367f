"""The wrappers of kernels/adamw.cu: AdamW's fused update of float32 master weights (its per-step numbers
by value, or read from the device, for a step a CUDA graph replays) and the gradient's squared norm over
ranges of the flat buffer. The loader, the launch and the argument checks are boostmpi.gpu.kernels'.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from boostmpi.arrays import Array
from boostmpi.gpu import kernels  # the loader; its launch looked up at each call (the tests wrap it)
from boostmpi.gpu.arguments import check_contiguous as _check_contiguous
from boostmpi.gpu.arguments import check_elementwise as _check_elementwise
from boostmpi.gpu.launch_plan import ELEMENTWISE_BLOCK_THREADS
from boostmpi.gpu.launch_plan import elementwise_grid as _elementwise_grid


def adamw_scalars(lr: float, beta1: float, beta2: float, weight_decay: float, t: int) -> np.ndarray:
    """[lr * weight_decay, lr / bc1, sqrt(bc2)] in float32, bias corrections bc = 1 - beta^t for update
    number t: the numbers of an AdamW update that change from step to step."""
    bc1, bc2 = 1.0 - beta1 ** t, 1.0 - beta2 ** t
    return np.array([lr * weight_decay, lr / bc1, math.sqrt(bc2)], dtype=np.float32)


def _adamw_launch(entry: str, p: Array, g: Array, m: Array, v: Array, decay_bounds: Array, beta1: float,
                  beta2: float, eps: float, decays: bool, per_step: Sequence[object]) -> None:
    suffix = _check_elementwise("p", p, g=g, m=m, v=v)
    if suffix != "f32":
        raise TypeError(f"adamw_step updates float32 master weights, got {p.dtype}")
    if decay_bounds.dtype != np.int64 or decay_bounds.ndim != 1 or decay_bounds.size % 2:
        raise ValueError("decay_bounds must be a 1-D int64 array of (start, stop) pairs")
    _check_contiguous("decay_bounds", decay_bounds)
    if p.size > 0:
        grid = _elementwise_grid(p.size, p.itemsize, kernels._current_device().sm_count)
        kernels._launch(kernels._kernel("adamw", entry), grid, ELEMENTWISE_BLOCK_THREADS,
                (p, g, m, v, np.int64(p.size), decay_bounds, np.int32(decay_bounds.size if decays else 0),
                 np.float32(beta1), np.float32(1.0 - beta1), np.float32(beta2), np.float32(1.0 - beta2), np.float32(eps),
                 *per_step))


def adamw_step(p: Array, g: Array, m: Array, v: Array, decay_bounds: Array, lr: float, beta1: float, beta2: float,
               eps: float, weight_decay: float, grad_scale: float, t: int) -> None:
    """One AdamW update of the flat float32 arrays p, m, v (in place) from the gradient g, weight
    decay on the ranges [decay_bounds[2i], decay_bounds[2i+1]) (int64 on the device; empty: none),
    bias corrections for update number t (boostmpi.train.optim.AdamW.step is the specification)."""
    decay, step_size, sqrt_bc2 = adamw_scalars(lr, beta1, beta2, weight_decay, t)
    _adamw_launch("adamw_step_f32", p, g, m, v, decay_bounds, beta1, beta2, eps, bool(weight_decay),
                  (decay, np.float32(grad_scale), step_size, sqrt_bc2))


def adamw_step_device(p: Array, g: Array, m: Array, v: Array, decay_bounds: Array, beta1: float, beta2: float,
                      eps: float, weight_decay: float, scalars: Array, grad_sq: Array, max_norm: float) -> None:
    """`adamw_step` with what changes per step read from the device when the kernel runs (a launch a CUDA
    graph replays): `scalars`, float32 [3], holds `adamw_scalars` of this step; the gradient scale is
    the clipping coefficient of the norm sqrt(grad_sq) (a 0-d float64 device array) to `max_norm` (0: off)."""
    if scalars.dtype != np.float32 or scalars.shape != (3,) or grad_sq.dtype != np.float64 or grad_sq.size != 1:
        raise TypeError("adamw_step_device reads float32 scalars [3] and a float64 squared norm")
    _adamw_launch("adamw_step_device_f32", p, g, m, v, decay_bounds, beta1, beta2, eps, bool(weight_decay),
                  (scalars, grad_sq, np.float64(max_norm)))


def sum_squares_ranges(g: Array, bounds: Array) -> Array:
    """The sum of g[i]^2 over the ranges [bounds[2j], bounds[2j+1]) of the flat float32 g (bounds int64
    on the device, each range within g): a 0-d float64 device array, from one kernel over every range
    and the sum of its per-block partials (the engine's `_grad_sq` is the specification)."""
    _check_contiguous("g", g)
    if g.dtype != np.float32 or g.ndim != 1:
        raise TypeError(f"sum_squares_ranges sums a flat float32 buffer, got {g.dtype} of shape {tuple(g.shape)}")
    if bounds.dtype != np.int64 or bounds.ndim != 1 or bounds.size % 2:
        raise ValueError("bounds must be a 1-D int64 array of (start, stop) pairs")
    _check_contiguous("bounds", bounds)
    cupy = kernels._import_cupy()
    grid = _elementwise_grid(max(g.size, 1), g.itemsize, kernels._current_device().sm_count)
    partial = cupy.empty(grid, dtype=np.float32)
    kernels._launch(kernels._kernel("adamw", "sum_squares_ranges_f32"), grid, ELEMENTWISE_BLOCK_THREADS,
            (g, bounds, np.int32(bounds.size // 2), partial))
    return partial.sum(dtype=np.float64)
