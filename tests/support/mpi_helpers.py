"""Helpers for tests that run on every rank of an MPI job (pytest-mpi, `mpiexec -n N python -m pytest
--with-mpi`). The rule they serve: a failure on any rank fails the test on every rank, naming the
rank, and never leaves the other ranks waiting in a collective (a hang).

- `assert_all_ranks(ok, message)`: every rank passes its own outcome; all raise if any failed.
- `collectively(fn)`: runs rank-local code (no communication inside) and reports its exception,
  if any, on every rank.
- `MPIEXEC`: the mpiexec for this interpreter (`boostmpi.parallel.launch.find_mpiexec`), or None
  when there is none, for tests that start MPI jobs of their own.
- `abort_on_error()`: around code that communicates, where the other ranks may already be inside
  a collective: an exception prints its rank and traceback and aborts the whole job (except the
  `AllRanksFailed` of the two above, which every rank raises together).

mpi4py is imported only when a helper is called, so that collecting tests without MPI does not
initialise it.
"""

import os
import sys
import traceback
from contextlib import contextmanager, nullcontext

import pytest

from boostmpi.errors import UserError
from boostmpi.parallel.launch import find_mpiexec

try:
    MPIEXEC = find_mpiexec()
except UserError:
    MPIEXEC = None

# what a rank-local failure raises: any error, or pytest's own (pytest.raises, pytest.fail), which
# derives from BaseException
LOCAL_FAILURES = (Exception, pytest.fail.Exception)

# pytest captures fd 2 during a test, and an aborted process never prints what it captured;
# conftest.py installs pytest's "capture suspended" context here so the abort report gets out
_uncaptured = nullcontext


def report_through(context_factory):
    global _uncaptured
    _uncaptured = context_factory


def running_under_mpi(config):
    """True when pytest-mpi's --with-mpi or --only-mpi was given (then every rank runs pytest)."""
    return bool(config.getoption("--with-mpi", default=False) or config.getoption("--only-mpi", default=False))


def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


_check_comms = {}


def checks_comm(comm=None):
    """A duplicate of `comm` (default COMM_WORLD) used only for the outcome exchanges here, so that
    an exchange can never match a collective of the code under test, or of conftest.py, if one
    rank got out of step: a mismatch then waits (and `timeout` ends it) instead of mixing data."""
    comm = world() if comm is None else comm
    key = comm.py2f()
    if key not in _check_comms:
        _check_comms[key] = comm.Dup()
    return _check_comms[key]


def _text(message):
    """The message, called if it is a callable; formatting must never raise on one rank only."""
    try:
        return str(message() if callable(message) else message)
    except Exception as exc:  # noqa: BLE001
        return f"(the failure message itself failed: {type(exc).__name__}: {exc})"


class AllRanksFailed(AssertionError):
    """Raised on every rank together: the failure is reported by each rank's pytest, nothing hangs."""


def assert_all_ranks(ok, message="", comm=None):
    """Collective: raise AssertionError on every rank of `comm` when `ok` is false on any of them.

    `message` is a string, or a callable that makes one, called only on a rank where `ok` is false.
    """
    comm = checks_comm(comm)
    outcomes = comm.allgather((bool(ok), "" if ok else _text(message)))
    failed = [f"rank {rank}: {text}" for rank, (passed, text) in enumerate(outcomes) if not passed]
    if failed:
        raise AllRanksFailed(f"failed on {len(failed)} of {comm.Get_size()} ranks; " + "; ".join(failed))


def collectively(fn, *args, comm=None, **kwargs):
    """Collective: `fn(*args, **kwargs)` on this rank; if it raised anywhere, every rank raises."""
    try:
        result, error = fn(*args, **kwargs), None
    except LOCAL_FAILURES as exc:  # reported on every rank below
        result, error = None, f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    assert_all_ranks(error is None, error, comm)
    return result


def on_root(fn, *args, **kwargs):
    """Collective: `fn` runs on world rank 0 only (None elsewhere); its failure fails every rank."""
    return collectively(lambda: fn(*args, **kwargs) if world().Get_rank() == 0 else None)


@contextmanager
def abort_on_error():
    """An exception inside the block, where other ranks may wait in a collective, aborts the job;
    an `AllRanksFailed`, raised on every rank at once, goes through as a normal test failure."""
    try:
        yield
    except AllRanksFailed:
        raise
    except LOCAL_FAILURES:
        comm = world()
        test = os.environ.get("PYTEST_CURRENT_TEST", "")
        with _uncaptured():
            sys.stderr.write(f"rank {comm.Get_rank()} of {comm.Get_size()}: exception in communicating code "
                             f"of {test}, aborting every rank\n{traceback.format_exc()}")
            sys.stderr.flush()
        comm.Abort(1)
