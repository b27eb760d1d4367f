"""Device memory of the GPU path: CuPy's default pool for everything, and a second pool for what a
lowrank forward keeps until its backward.

Why two. CuPy's pool hands a request the smallest free chunk that fits and splits it. In one pool,
each layer's kept arrays (the rank-R activations of its collectives, their statistics, its output)
would land in the chunks the previous layer's transients freed (the grouped gate/up products, the
SwiGLU output, the attention output) and split them; the next layer's transients would then need new
device memory, and what is left of the split chunks would stay free but too small for anything
(docs/MEMORY.md, "Two device pools", has what both arrangements hold). In a pool of their own, the
kept arrays of a step are new chunks one after another, freed in the backward and taken again, size
for size, by the next step; the default pool sees only transients, which every layer asks for in the
same sizes and order.

`kept_empty` is the allocator the recompute tape hands the code that makes a kept array
(recompute.Tape.alloc); `total_bytes` is what the device holds for both pools, and for the private pool
of a step captured in a CUDA graph (`PrivatePool`, boostmpi/train/graph_step.py).
"""

from __future__ import annotations

import weakref
from types import ModuleType
from typing import TYPE_CHECKING

import numpy.typing as npt

from boostmpi.arrays import Array

if TYPE_CHECKING:
    import cupy

_KEPT: cupy.cuda.MemoryPool | None = None


class PrivatePool:
    """A pool only its owner allocates from (`cupy.cuda.using_allocator(private.pool.malloc)`): no other
    allocation takes its free chunks, and no other pool's fallback on a failed cudaMalloc, which frees
    every free chunk of that pool (CuPy v14.2.0, cupy/cuda/memory.pyx `_try_malloc`), frees them. Counted
    in `total_bytes` while its owner keeps it."""

    def __init__(self) -> None:
        import cupy

        self.pool = cupy.cuda.MemoryPool()
        _PRIVATE.add(self)


_PRIVATE: weakref.WeakSet[PrivatePool] = weakref.WeakSet()


def kept_pool() -> cupy.cuda.MemoryPool:
    """The pool of what recompute keeps (made on first use, on the current device)."""
    global _KEPT
    if _KEPT is None:
        import cupy

        _KEPT = cupy.cuda.MemoryPool()
    return _KEPT


def kept_empty(shape: tuple[int, ...], dtype: npt.DTypeLike) -> Array:
    """A new array of `shape` and `dtype` from the kept pool."""
    import cupy

    with cupy.cuda.using_allocator(kept_pool().malloc):
        return cupy.empty(shape, dtype=dtype)


def total_bytes(xp: ModuleType) -> int:
    """Device bytes held by the default pool, the kept pool and the private pools."""
    held = int(xp.get_default_memory_pool().total_bytes()) + sum(int(p.pool.total_bytes()) for p in _PRIVATE)
    return held + (0 if _KEPT is None else int(_KEPT.total_bytes()))
