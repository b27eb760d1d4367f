#!/usr/bin/env bash
# The whole test suite: sets itself up (.venv, install), then runs
#   1. the single-process tests (pytest),
#   2. the MPI tests at 1, 2, 3 and 4 ranks (pytest-mpi under mpiexec, each under timeout),
#   3. the real-Slurm test when this machine allows it (root and apt), otherwise it says why it skipped.
# Exit status is non-zero when anything failed.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=jobs/setup_env.sh
source jobs/setup_env.sh
setup_venv test,plot,mpich
MPIEXEC="$(boostmpi_mpiexec)" || exit 1

export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1
status=0
step() { echo; echo "=== $*"; }

step "single-process tests"
timeout 1200 "$PY" -m pytest -q -p no:cacheprovider tests "$@" || status=1

for n in 1 2 3 4; do
  step "MPI tests at $n ranks"
  timeout 600 "$MPIEXEC" -n "$n" "$PY" -m pytest -q -p no:cacheprovider --with-mpi -m mpi tests || status=1
done

step "real Slurm test"
if [ -x tests/slurm/run_slurm_test.sh ] || [ -f tests/slurm/run_slurm_test.sh ]; then
  timeout 600 bash tests/slurm/run_slurm_test.sh || status=1
else
  echo "skipped: tests/slurm/run_slurm_test.sh is not present"
fi

echo
if [ "$status" -eq 0 ]; then echo "ALL TESTS PASSED"; else echo "SOME TESTS FAILED"; fi
exit "$status"
