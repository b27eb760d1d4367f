"""The array type of the annotations: an array of whichever backend the run uses (a NumPy
`ndarray` on the CPU path, a CuPy `ndarray` on a GPU, the stand-in's array in the tests).

It is the one place where `typing.Any` enters the package's annotations: the three array types
share no base class a checker knows, and the model code is written once for all of them
(`boostmpi.backend`). Everything else that an annotation names is a concrete type."""

from collections.abc import Callable
from typing import Any, TypeAlias

Array: TypeAlias = Any
"""An array of the run's backend (NumPy, CuPy, or the CuPy stand-in)."""

Alloc: TypeAlias = Callable[[tuple[int, ...], Any], Array]
"""`alloc(shape, dtype)`: makes an array that a caller asked to be allocated its way (on a GPU, from
the kept pool of boostmpi.gpu.pools)."""
