#!/usr/bin/env bash
# The system-MPI path, proven on this machine as it is meant to run on a cluster: boostmpi
# installed without the [mpich] extra, mpi4py built from source against the machine's MPI
# (Debian's MPICH standing in for Cray MPICH), ranks started by that MPI's own launcher
# (mpiexec.mpich standing in for srun/PALS). Checks that
#   1. the venv holds no MPICH wheel and mpi4py is linked against Debian's libmpich;
#   2. the start-up checks' MPI tests pass on that MPI at 2 ranks (pytest-mpi);
#   3. two ranks train configs/tiny.toml through the production job body (jobs/common.sh) to DONE,
#      and the start-up line names Debian's library file and its ch4 transport, not a wheel.
# Skips (exit 0, saying why) where Debian's MPICH is absent and cannot be installed (not root, no
# apt-get, offline). Exit status 1 when a check fails. tests/integration/site/slurm/run_slurm_test.sh uses the same venv.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../../.." || exit 1
# shellcheck source=tests/integration/site/sysmpi/system_mpi.sh
source tests/integration/site/sysmpi/system_mpi.sh
system_mpi_venv || exit $(($? == 1 ? 0 : 1))
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
# compiled modules go to tests/run.sh's folder for them when it set one, else nowhere
[ -n "${PYTHONPYCACHEPREFIX:-}" ] || export PYTHONDONTWRITEBYTECODE=1
fail() { echo "FAILED: $*"; exit 1; }

# 1. what was installed
( boostmpi_check_site_venv "/usr/lib/*/libmpich.so*" ) || fail "the system-MPI venv is not built against Debian's MPICH"
echo "[${SECONDS} s] $VENV: no MPICH wheel; mpi4py linked against $(boostmpi_mpi4py_library)"

# 2. the MPI tests of the start-up checks, on this MPI
timeout 300 "$SYSTEM_MPIEXEC" -n 2 "$PY" -m pytest -q -p no:cacheprovider --with-mpi -m mpi tests/unit/parallel/test_startup.py ||
  fail "the start-up checks' MPI tests under $SYSTEM_MPIEXEC"

# 3. two ranks through the production job body
WORK="$(mktemp -d /tmp/boostmpi-sysmpi.XXXXXX)"
LOG="$WORK/job.out"
(
  source jobs/common.sh || exit 1
  CONFIG=configs/tiny.toml RUN_DIR="$WORK/run" TP=2 PP=1 NRANKS=2
  EXTRA_SETS=(train.steps=6 checkpoint.every=3)
  LAUNCH=(timeout 300 "$SYSTEM_MPIEXEC" -n "$NRANKS")
  RESUBMIT=()
  STOP_SIGNAL=TERM
  boostmpi_job
) > "$LOG" 2>&1
status=$?
show() { tail -30 "$LOG"; echo "(files kept in $WORK)"; }
[ "$status" -eq 0 ] || { show; fail "training with $SYSTEM_MPIEXEC ended with status $status"; }
grep -q "job: finished all 6 steps" "$LOG" && [ -f "$WORK/run/DONE" ] || { show; fail "the run did not finish (DONE)"; }
mpi_line="$(grep -m1 '^mpi: ' "$LOG")" || { show; fail "no start-up line 'mpi: ...'"; }
case "$mpi_line" in
  *"MPICH Version"*"/libmpich.so"*"transport ch4:"*"2 rank(s) on 1 node(s)"*) ;;
  *) show; fail "the start-up line does not name Debian's MPICH: $mpi_line" ;;
esac
case "$mpi_line" in *"PyPI wheel"*) show; fail "the start-up line says PyPI wheel: $mpi_line" ;; esac
rm -rf "$WORK"
echo "system-MPI test passed in ${SECONDS} s: $mpi_line"
