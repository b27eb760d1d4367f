"""Which CuPy calls a run makes: function, operand dtypes and ranks, broadcasting (call signatures).

While `active` is a set, the stand-in adds one string per distinct call signature to it, e.g.
`matmul bfloat16[2] bfloat16[2]` or `add float32[2] py.float bcast`; when it is None (the default)
recording costs one global lookup per call. tests/test_cupy_calls.py runs the engine under
`recording()` and checks every signature against the table of calls read in CuPy's source.
BOOSTMPI_STANDIN_RECORD=FILE records from import on and appends the signatures to FILE at exit
(for runs in other processes, such as `mpiexec`).
"""

import atexit
import os

import numpy as np

active = None


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
