# shellcheck shell=bash
# Sourced by jobs/local.sh, tests/run.sh, the system-MPI test and jobs/setup_<site>.sh.
#
#   setup_venv EXTRAS        create $BOOSTMPI_VENV (default .venv) if missing and install boostmpi[EXTRAS]
#                            into it (again only when pyproject.toml or EXTRAS changed). Sets VENV and PY.
#                            With BOOSTMPI_MPICC set, mpi4py is first built from source with that MPI
#                            compiler wrapper, so the venv uses the machine's MPI, not a wheel's.
#   install_mpi4py_from_source MPICC
#                            build mpi4py against the MPI behind the wrapper MPICC (`mpicc.mpich`,
#                            `cc -shared` on Cray), as mpi4py's installation notes describe.
#   boostmpi_mpiexec         print the mpiexec that belongs to $PY's MPI (boostmpi.parallel.launch.find_mpiexec).
# Needs only python3 with venv and pip.

install_mpi4py_from_source() {
  local mpicc="$1"
  echo "building mpi4py from source against the MPI of \`$mpicc\` (a few minutes)"
  # --no-binary: a wheel would bring its own MPI ABI stubs; --no-cache-dir: never reuse a build
  # made against another MPI; --force-reinstall: replace an mpi4py that came from a wheel
  MPICC="$mpicc" "$PY" -m pip install -q --disable-pip-version-check --no-cache-dir --force-reinstall \
      --no-binary mpi4py "mpi4py>=3.1" || { echo "error: building mpi4py with MPICC=$mpicc failed" >&2; exit 1; }
}

setup_venv() {
  local extras="${1:-}"
  VENV="${BOOSTMPI_VENV:-$PWD/.venv}"
  PY="$VENV/bin/python"
  if [ ! -x "$PY" ]; then
    echo "creating $VENV"
    python3 -m venv ${BOOSTMPI_VENV_OPTIONS:-} "$VENV" ||
      { echo "error: python3 -m venv failed (install python3-venv)" >&2; exit 1; }
  fi
  local spec="." stamp key
  [ -n "$extras" ] && spec=".[$extras]"
  key="$(cat pyproject.toml)|$extras|${BOOSTMPI_MPICC:-}"
  key="$(printf '%s' "$key" | "$PY" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
  stamp="$VENV/.boostmpi-installed-$key"
  if [ ! -f "$stamp" ]; then
    [ -n "${BOOSTMPI_MPICC:-}" ] && install_mpi4py_from_source "$BOOSTMPI_MPICC"
    echo "installing boostmpi$([ -n "$extras" ] && echo "[$extras]") into $VENV (first run only)"
    "$PY" -m pip install -q --disable-pip-version-check -e "$spec" || { echo "error: pip install failed" >&2; exit 1; }
    touch "$stamp"
  fi
  export VENV PY
}

boostmpi_mpiexec() {
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
    'import sys; from boostmpi.parallel.launch import find_mpiexec; print(find_mpiexec(sys.argv[1]))' "$PY"
}
