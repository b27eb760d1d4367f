"""Named ranges (NVTX on CUDA, roctx on ROCm, through CuPy) around the step's layers and collectives.

A profile of a real node (Nsight Systems, rocprof) then shows `layer 3 forward`, `layer 3 backward`,
`tp allreduce`... around the kernels they launch, as `bench/gpu_trace.py` names call sites. On the
CPU path, or where CuPy has no NVTX, a range is nothing.
"""

from contextlib import nullcontext

import numpy as np


def named_range(xp, name):
    """A context manager: the range `name` when xp is CuPy with NVTX available, else nothing."""
    nvtx = None if xp is np else getattr(getattr(xp, "cuda", None), "nvtx", None)
    if nvtx is None or not getattr(nvtx, "available", False):
        return nullcontext()
    from cupyx.profiler import time_range

    return time_range(name)


def ranged(name, method):
    """`method` of a communicator wrapped in the range `<axis> <name>` (self.axis names the axis)."""
    def inner(self, *args, **kwargs):
        import cupy  # the CuPy the group runs on

        with named_range(cupy, f"{self.axis} {name}"):
            return method(self, *args, **kwargs)

    inner.__name__, inner.__doc__ = method.__name__, method.__doc__
    return inner
