"""Shared pytest setup. Importing this module does nothing; the hooks and fixtures below act.

- `pytest_configure` (before collection, so before any test module imports `cupy`, which a process
  imports once): the repository root on PYTHONPATH for child processes (tests/support/paths.py)
  and the CuPy choice (tests/support/gpu_setup.py: a real GPU, probed in a child process, or the
  stand-in). A fixture would come too late for it: collection imports boostmpi.
- `_attention_fma_on_the_standin` (session, autouse): the FMA attention kernels on the stand-in.

Under MPI (`mpiexec -n N python -m pytest --with-mpi ...`) every rank runs its own pytest session.
A test that failed on one rank only would leave that rank's exit status non-zero and the others
zero; the session-finish hook below makes every rank's status non-zero when any rank failed, so the
run fails however its ranks' statuses are combined.
"""

import os
import sys

import pytest

_FINISH_COMM = pytest.StashKey()


@pytest.fixture(scope="session", autouse=True)
def _attention_fma_on_the_standin():
    """On the execution harness the GPU tests run the attention's FMA kernels unless a test asks for the
    tensor-core ones: the emulated WMMA kernels pad the tests' head dim of 16 to 128 and made the GPU
    suite 3.5x slower (5.5 to 19 minutes on 2 cores). The default itself (tensor cores for bfloat16 on
    compute capability 8.0 and later) and whole bfloat16 steps on the tensor-core kernels (1 and 2 ranks)
    are tested in tests/kernels/attention/test_attention_tensor_cores.py, and the tests that take the
    fixture attention_gpu_default run the default here too; on a real GPU the suite runs the default.
    Set in the environment for the whole session (child processes inherit it), removed at its end."""
    from tests.support.gpu_setup import GPU

    name = "BOOSTMPI_ATTENTION_TENSOR_CORES"
    pinned = GPU.standin and name not in os.environ
    if pinned:
        os.environ[name] = "0"
    yield
    if pinned:
        os.environ.pop(name, None)


@pytest.fixture
def attention_gpu_default(monkeypatch):
    """BOOSTMPI_ATTENTION_TENSOR_CORES unset for one test: the attention kernels a real GPU runs by
    default (tensor cores where tensor_cores.use_wmma chooses them), not the FMA pin above."""
    monkeypatch.delenv("BOOSTMPI_ATTENTION_TENSOR_CORES", raising=False)


def pytest_report_header(config):
    from tests.support.gpu_setup import GPU

    return f"gpu: {GPU.describe()}"


def pytest_configure(config):
    from tests.support.gpu_setup import GPU
    from tests.support.paths import export_root

    export_root()
    GPU.choose()
    from tests.support.mpi_helpers import report_through, running_under_mpi

    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None and running_under_mpi(config):
        report_through(capture.global_and_fixture_disabled)


def pytest_sessionstart(session):
    from tests.support.mpi_helpers import checks_comm, running_under_mpi

    if running_under_mpi(session.config):
        from mpi4py import MPI

        # communicators of their own, made while every rank is in step (duplicating is collective)
        checks_comm()
        session.config.stash[_FINISH_COMM] = MPI.COMM_WORLD.Dup()


def pytest_sessionfinish(session, exitstatus):
    comm = session.config.stash.get(_FINISH_COMM, None)
    if comm is None:
        return
    failed_here = session.testsfailed > 0 or exitstatus not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
    failed_ranks = [rank for rank, failed in enumerate(comm.allgather(failed_here)) if failed]
    if failed_ranks and not failed_here:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        sys.stderr.write(f"rank {comm.Get_rank()}: tests failed on rank(s) {failed_ranks}\n")
    comm.Free()


def _slow_asked(config):
    return "slow" in (config.getoption("markexpr") or "") or os.environ.get("BOOSTMPI_SLOW") == "1"


@pytest.fixture(scope="session")
def slow_run(request):
    """True when the `slow` tests run too (a fixture that computes for several tests at once computes
    the slow ones' share only then)."""
    return _slow_asked(request.config)


def pytest_collection_modifyitems(config, items):
    """Tests marked `slow` (full matrices) run only when asked for: `-m slow` or BOOSTMPI_SLOW=1."""
    if _slow_asked(config):
        return
    skip = pytest.mark.skip(reason="a full matrix: run it with -m slow or BOOSTMPI_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _attention_backend_reset():
    """A GPU step chooses its attention backend for the whole process (`boostmpi.gpu.attention.use`);
    after each test the next one starts from the own kernels again, whatever the test chose."""
    yield
    seam = sys.modules.get("boostmpi.gpu.attention")
    if seam is not None and hasattr(seam, "OwnAttention") and getattr(seam.current(), "name", "own") != "own":
        seam.use(seam.OwnAttention())


@pytest.fixture(autouse=True)
def _stop_request_released():
    """A test that sends itself a stop signal must not leave it recorded for the trainers of later tests
    in this process (they would stop at their first step)."""
    yield
    preemption = sys.modules.get("boostmpi.preemption")
    if preemption is not None and hasattr(preemption, "release"):
        preemption.started()
        preemption.release()
