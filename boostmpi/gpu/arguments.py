"""What the kernel wrappers (boostmpi/gpu/kernels.py) accept: dtype, shape and memory-layout checks
made before a launch, each failing with a message that names the argument."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from boostmpi.arrays import Array


def storage_suffix(name: str, arr: Array) -> str:
    """The entry-point suffix for arr's dtype."""
    if arr.dtype == np.float32:
        return "f32"
    if arr.dtype.name == "bfloat16":
        return "bf16"
    raise TypeError(f"{name} has dtype {arr.dtype}; the kernels take float32 or bfloat16")


def check_contiguous(name: str, arr: Array) -> None:
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (make it so with xp.ascontiguousarray)")


def check(name: str, arr: Array, shape: Sequence[int], dtype: npt.DTypeLike) -> None:
    if tuple(arr.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(arr.shape)}, expected {tuple(shape)}")
    if arr.dtype != dtype:
        raise TypeError(f"{name} has dtype {arr.dtype}, expected {np.dtype(dtype)}")
    check_contiguous(name, arr)


def check_matrix(name: str, arr: Array) -> tuple[int, int, str]:
    """Checks a [rows, cols] kernel input of a supported dtype; returns (rows, cols, suffix)."""
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D [rows, cols], got shape {tuple(arr.shape)}")
    suffix = storage_suffix(name, arr)
    check_contiguous(name, arr)
    return arr.shape[0], arr.shape[1], suffix


def check_elementwise(first_name: str, first: Array, **others: object) -> str:
    """Checks elementwise inputs: `first` of a supported dtype, the others of its shape and dtype."""
    suffix = storage_suffix(first_name, first)
    check_contiguous(first_name, first)
    for name, arr in others.items():
        check(name, arr, first.shape, first.dtype)
    return suffix
