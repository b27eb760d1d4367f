"""Named ranges (NVTX on CUDA, roctx on ROCm, through CuPy) around the step's layers and collectives.

A profile of a real node (Nsight Systems, rocprof) then shows `layer 3 forward`, `layer 3 backward`,
`tp allreduce`... around the kernels they launch, as `bench/gpu_trace.py` names call sites. On the
CPU path, or where CuPy has no NVTX, a range is nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from types import ModuleType
from typing import Concatenate, ParamSpec, Protocol, TypeVar

import numpy as np


class _OnAxis(Protocol):
    axis: str


S = TypeVar("S", bound=_OnAxis)
P = ParamSpec("P")
R = TypeVar("R")


def named_range(xp: ModuleType, name: str) -> AbstractContextManager[object]:
    """A context manager: the range `name` when xp is CuPy with NVTX available, else nothing."""
    nvtx = None if xp is np else getattr(getattr(xp, "cuda", None), "nvtx", None)
    if nvtx is None or not getattr(nvtx, "available", False):
        return nullcontext()
    from cupyx.profiler import time_range

    range_: AbstractContextManager[object] = time_range(name)
    return range_


def ranged(name: str, method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """`method` of a communicator wrapped in the range `<axis> <name>` (self.axis names the axis)."""
    def inner(self: S, *args: P.args, **kwargs: P.kwargs) -> R:
        import cupy  # the CuPy the group runs on

        with named_range(cupy, f"{self.axis} {name}"):
            return method(self, *args, **kwargs)

    inner.__name__, inner.__doc__ = method.__name__, method.__doc__
    return inner
