# shellcheck shell=bash
# Sourced by tests/integration/site/sysmpi/run_sysmpi_test.sh and tests/integration/site/slurm/run_slurm_test.sh: the system-MPI
# stand-in for a cluster's MPI on this machine.
#
#   system_mpi_venv   makes sure Debian's MPICH is installed (apt-get install mpich libmpich-dev,
#                     as root) and that .venv-sysmpi (BOOSTMPI_SYSMPI_VENV) holds boostmpi WITHOUT
#                     the [mpich] extra, with mpi4py built from source against that MPICH
#                     (MPICC=mpicc.mpich), the way jobs/setup_<site>.sh builds it against Cray MPICH.
#                     Sets PY, VENV and SYSTEM_MPIEXEC (Debian's mpiexec.mpich). Returns 1 after
#                     printing "skipped: <why>" when this machine cannot do it.
# A fresh clone (CI) builds the venv from empty (a few minutes, mostly compiling mpi4py); later
# runs reuse it until pyproject.toml changes.

system_mpi_venv() {
  if ! command -v mpicc.mpich >/dev/null || ! command -v mpiexec.mpich >/dev/null; then
    [ "$(id -u)" -eq 0 ] || { echo "skipped: Debian's MPICH is not installed and installing it needs root"; return 1; }
    command -v apt-get >/dev/null || { echo "skipped: Debian's MPICH is not installed and there is no apt-get"; return 1; }
    echo "installing mpich libmpich-dev with apt-get"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
           mpich libmpich-dev; } >/tmp/boostmpi-mpich-apt.log 2>&1; then
      tail -5 /tmp/boostmpi-mpich-apt.log
      echo "skipped: apt-get could not install mpich and libmpich-dev (log above; offline?)"
      return 1
    fi
  fi
  # shellcheck source=jobs/setup_env.sh
  source jobs/setup_env.sh
  # -O0: these tests check which MPI mpi4py links and that ranks train on it, not mpi4py's own
  # speed; unoptimised, its compile takes about 40 s of CPU instead of about 3 minutes (CI's budget).
  # The site scripts build it optimised.
  CFLAGS="${CFLAGS:-} -O0" BOOSTMPI_VENV="${BOOSTMPI_SYSMPI_VENV:-$PWD/.venv-sysmpi}" BOOSTMPI_MPICC=mpicc.mpich \
    setup_venv ""
  "$PY" -c 'import pytest, pytest_mpi' 2>/dev/null ||
    "$PY" -m pip install -q --disable-pip-version-check "pytest>=7" "pytest-mpi>=0.6" ||
    { echo "error: pip install pytest pytest-mpi into $VENV failed" >&2; return 2; }
  SYSTEM_MPIEXEC="$(BOOSTMPI_MPIEXEC=mpiexec.mpich boostmpi_mpiexec)" || return 2
  export SYSTEM_MPIEXEC
}
