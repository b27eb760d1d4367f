"""Shared pytest setup.

Under MPI (`mpiexec -n N python -m pytest --with-mpi ...`) every rank runs its own pytest session.
A test that failed on one rank only would leave that rank's exit status non-zero and the others
zero; the session-finish hook below makes every rank's status non-zero when any rank failed, so the
run fails however its ranks' statuses are combined.
"""

import sys

import pytest


def running_under_mpi(config):
    """True when pytest-mpi's --with-mpi or --only-mpi was given (then every rank runs pytest)."""
    return bool(config.getoption("--with-mpi", default=False) or config.getoption("--only-mpi", default=False))


def pytest_sessionfinish(session, exitstatus):
    if not running_under_mpi(session.config):
        return
    from mpi4py import MPI

    if MPI.Is_finalized():
        return
    comm = MPI.COMM_WORLD
    failed_here = session.testsfailed > 0 or exitstatus not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
    failed_ranks = [rank for rank, failed in enumerate(comm.allgather(failed_here)) if failed]
    if failed_ranks and not failed_here:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        sys.stderr.write(f"rank {comm.Get_rank()}: tests failed on rank(s) {failed_ranks}\n")
