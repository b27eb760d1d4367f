"""Helpers for tests that run on every rank of an MPI job (pytest-mpi, `mpiexec -n N python -m pytest
--with-mpi`). The rule they serve: a failure on any rank fails the test on every rank, naming the
rank, and never leaves the other ranks waiting in a collective (a hang).

- `assert_all_ranks(ok, message)`: every rank passes its own outcome; all raise if any failed.
- `collectively(fn)`: runs rank-local code (no communication inside) and reports its exception,
  if any, on every rank.
- `abort_on_error()`: around code that communicates, where the other ranks may already be inside
  a collective: an exception prints its rank and traceback and aborts the whole job.

mpi4py is imported only when a helper is called, so that collecting tests without MPI does not
initialise it.
"""

import sys
import traceback
from contextlib import contextmanager


def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def assert_all_ranks(ok, message="", comm=None):
    """Collective: raise AssertionError on every rank of `comm` when `ok` is false on any of them."""
    comm = world() if comm is None else comm
    outcomes = comm.allgather((bool(ok), "" if ok else str(message)))
    failed = [f"rank {rank}: {text}" for rank, (passed, text) in enumerate(outcomes) if not passed]
    if failed:
        raise AssertionError(f"failed on {len(failed)} of {comm.Get_size()} ranks; " + "; ".join(failed))


def collectively(fn, *args, comm=None, **kwargs):
    """Collective: `fn(*args, **kwargs)` on this rank; if it raised anywhere, every rank raises."""
    try:
        result, error = fn(*args, **kwargs), None
    except Exception as exc:  # noqa: BLE001 - reported on every rank below
        result, error = None, f"{type(exc).__name__}: {exc}"
    assert_all_ranks(error is None, error, comm)
    return result


def on_root(fn, *args, **kwargs):
    """Collective: `fn` runs on world rank 0 only (None elsewhere); its failure fails every rank."""
    return collectively(lambda: fn(*args, **kwargs) if world().Get_rank() == 0 else None)


@contextmanager
def abort_on_error():
    """An exception inside the block, where other ranks may wait in a collective, aborts the job."""
    try:
        yield
    except Exception:  # noqa: BLE001
        comm = world()
        sys.stderr.write(f"rank {comm.Get_rank()} of {comm.Get_size()}: exception in communicating code, "
                         f"aborting every rank\n{traceback.format_exc()}")
        sys.stderr.flush()
        comm.Abort(1)
