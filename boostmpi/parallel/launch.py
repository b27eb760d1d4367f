"""Start-up that works under any launcher (mpiexec, srun --mpi=pmi2, PALS) and abort semantics.

Rank, world size and local rank come from MPI itself (a shared-memory split), never from a
launcher's environment variables; start-up (`startup.process_grid`) picks the GPU by local rank.
An unhandled exception on any rank ends the whole job with MPI_Abort after printing the rank and
traceback; bad input (UserError) is printed once. A hung collective is ended by the watchdog in
parallel/comm.py.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import sys
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO, cast

from boostmpi.errors import UserError

if TYPE_CHECKING:
    from mpi4py import MPI


def init_mpi() -> tuple[MPI.Comm | None, int, int, int]:
    """(world communicator or None when alone, world rank, world size, local rank).

    Also: from here on a stop signal is recorded (boostmpi.preemption) instead of killing the rank,
    a crash in native code prints the Python stack, and SIGUSR2 prints every rank's stack without stopping it (`scancel --signal=USR2 JOB` shows where a job waits).
    """
    from boostmpi import preemption
    from boostmpi.parallel.startup import set_host_threads

    set_host_threads()  # in time only if NumPy is not loaded yet: `boostmpi` itself sets them first (cli.main)
    preemption.stage("launch")  # a signal here meets its default action (SIGTERM ends the process)
    preemption.install()
    preemption.stage("handlers")
    try:
        faulthandler.register(signal.SIGUSR2, file=cast(TextIO, sys.__stderr__), all_threads=True, chain=False)
    except (ValueError, AttributeError, OSError):  # not the main thread, or no real stderr: leave it be
        pass
    try:
        faulthandler.enable(file=cast(TextIO, sys.__stderr__), all_threads=True)
    except (AttributeError, OSError, ValueError):  # stderr replaced by something without a file descriptor
        pass
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    size, rank = world.Get_size(), world.Get_rank()
    local = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank = local.Get_rank()
    local.Free()
    preemption.stage("mpi")
    return (world if size > 1 else None), rank, size, local_rank


def find_mpiexec(python: str | None = None) -> str:
    """The `mpiexec` that starts ranks of `python` (default: this interpreter) on this machine.

    In order: $BOOSTMPI_MPIEXEC (a command name or path); the `mpiexec` next to the interpreter (a
    venv with the [mpich] extra has MPICH's); `mpiexec` on PATH (a venv whose mpi4py was built
    against the system MPI). Batch jobs never use this: they call the site's launcher (jobs/).
    """
    chosen = os.environ.get("BOOSTMPI_MPIEXEC")
    if chosen:
        found = shutil.which(chosen)
        if found is None:
            raise UserError(f"BOOSTMPI_MPIEXEC={chosen} is not an executable command")
        return found
    beside = os.path.join(os.path.dirname(python or sys.executable), "mpiexec")
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("mpiexec")
    if found is None:
        raise UserError(f"no mpiexec next to {python or sys.executable} or on PATH; install boostmpi[mpich] "
                        "or the system MPI (apt-get install mpich), or set BOOSTMPI_MPIEXEC")
    return found


def mpi_library() -> str:
    from mpi4py import MPI

    return MPI.Get_library_version().strip().splitlines()[0].strip()


def abort_job(world: MPI.Comm, code: int) -> None:
    """End every rank. The pause first lets the launcher forward what this rank just printed:
    an abort tears the job down at once, and a message still in a pipe would be lost."""
    import time

    sys.stderr.flush()
    sys.stdout.flush()
    time.sleep(1.0)
    world.Abort(code)


def run_guarded(body: Callable[[], int | None], world: MPI.Comm | None, rank: int) -> int:
    """Run `body()`; on failure print once (bad input) or with rank and traceback, and end every rank."""
    try:
        return int(body() or 0)
    except UserError as exc:
        # bad input found identically on every rank before any collective: each exits 2, rank 0 prints
        if getattr(exc, "all_ranks", True) and rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        elif not getattr(exc, "all_ranks", True):
            print(f"error (rank {rank}): {exc}", file=sys.stderr, flush=True)
        if world is not None and not getattr(exc, "all_ranks", True):
            abort_job(world, exc.exit_code)
        return exc.exit_code
    except BaseException as exc:  # noqa: BLE001 - any other failure ends the whole job, never a hang
        from boostmpi.preemption import StoppedDuringStartup

        if isinstance(exc, StoppedDuringStartup):  # a stop signal before the first step: the caller ends at once
            raise
        if isinstance(exc, SystemExit) and not exc.code:
            return 0
        print(f"rank {rank}: unhandled {type(exc).__name__}: {exc}\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        if world is not None:
            abort_job(world, 1)
        return 1
