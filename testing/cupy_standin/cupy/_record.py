"""Which CuPy calls a run makes: function, operand dtypes and ranks, broadcasting (call signatures).

While `active` is a set, the stand-in adds one string per distinct call signature to it, e.g.
`matmul bfloat16[2] bfloat16[2]` or `add float32[2] py.float bcast`; when it is None (the default)
recording costs one global lookup per call. tests/unit/gpu/test_cupy_calls.py runs the engine under
`recording()` and checks every signature against the table of calls read in CuPy's source.
BOOSTMPI_STANDIN_RECORD=FILE records from import on and appends the signatures to FILE at exit
(for runs in other processes, such as `mpiexec`).

Every cuBLAS GEMM the stand-in carries out (`cupy.cuda.cublas`, which CuPy's own 2-D matmul reaches
through `gemmEx` as it does on a device) is also appended, one `Gemm` per call with its shapes, to
each list opened by `gemms()`: what a test reads to say which GEMMs ran on tensor cores.
"""

import atexit
import os
from typing import NamedTuple

import numpy as np

active = None
gemm_logs = []  # the lists of the open `gemms()` blocks


class Gemm(NamedTuple):
    """One cuBLAS GEMM as the binding received it (cudaDataType numbers, cuBLAS compute type)."""
    entry: str  # the cuBLAS function: gemmEx or gemmStridedBatchedEx
    Atype: int
    Btype: int
    Ctype: int
    computeType: int
    algo: int
    m: int
    n: int
    k: int
    batch: int
    beta_zero: bool  # False: C is accumulated into (beta != 0)


def note_gemm(gemm):
    for log in gemm_logs:
        log.append(gemm)


class gemms:
    """`with gemms() as log:` -- every cuBLAS GEMM made inside the block, in order."""

    def __enter__(self):
        self._log = []
        gemm_logs.append(self._log)
        return self._log

    def __exit__(self, *exc):
        gemm_logs.remove(self._log)
        return False


def note(*parts):
    active.add(" ".join(parts))


def arg(x):
    """One operand in a signature: dtype[rank] for arrays, the type for scalars."""
    dt = getattr(x, "dtype", None)
    if hasattr(x, "_a"):  # a stand-in device array
        return f"{dt.name}[{x.ndim}]"
    if isinstance(x, np.generic):
        return f"np.{dt.name}"
    if x is None:
        return "None"
    return f"py.{type(x).__name__}"


class recording:
    """`with recording() as calls:` -- the signatures of every call made inside the block."""

    def __enter__(self):
        global active
        self._previous = active
        active = set()
        return active

    def __exit__(self, *exc):
        global active
        calls = active
        active = self._previous
        if active is not None:
            active |= calls
        return False


def _dump(path):
    if active:  # one write of the whole text, so ranks appending at once do not split each other's lines
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, "".join(sig + "\n" for sig in sorted(active)).encode())
        finally:
            os.close(fd)


if os.environ.get("BOOSTMPI_STANDIN_RECORD"):
    active = set()
    atexit.register(_dump, os.environ["BOOSTMPI_STANDIN_RECORD"])
