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
(recompute.Tape.alloc); `total_bytes` is what the device holds for both pools.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

import numpy.typing as npt

from boostmpi.arrays import Array

if TYPE_CHECKING:
    import cupy

_KEPT: cupy.cuda.MemoryPool | None = None


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
    """Device bytes held by the default pool and the kept pool."""
    held = int(xp.get_default_memory_pool().total_bytes())
    return held + (0 if _KEPT is None else int(_KEPT.total_bytes()))
