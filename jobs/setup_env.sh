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
#   boostmpi_check_site_venv PATTERN
#                            stop unless mpi4py is linked against the MPI library whose path has PATTERN
#                            and no PyPI MPICH is installed (the site setup scripts, the system-MPI test).
#   boostmpi_cray_site_venv SITE EXTRAS
#                            the venv of jobs/setup_<site>.sh: mpi4py against Cray MPICH, boostmpi[EXTRAS].
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

_boostmpi_hash() {
  printf '%s' "$1" | "$PY" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:16])'
}

setup_venv() {
  local extras="${1:-}"
  VENV="${BOOSTMPI_VENV:-$PWD/.venv}"
  PY="$VENV/bin/python"
  if [ ! -x "$PY" ]; then
    echo "creating $VENV"
    # shellcheck disable=SC2086  # BOOSTMPI_VENV_OPTIONS: options, one word each (--system-site-packages)
    python3 -m venv ${BOOSTMPI_VENV_OPTIONS:-} "$VENV" ||
      { echo "error: python3 -m venv failed (install python3-venv)" >&2; exit 1; }
  fi
  local spec="." stamp
  [ -n "$extras" ] && spec=".[$extras]"
  if [ -n "${BOOSTMPI_MPICC:-}" ]; then  # once per venv and compiler wrapper, not per pyproject.toml
    stamp="$VENV/.mpi4py-built-with-$(_boostmpi_hash "$BOOSTMPI_MPICC")"
    if [ ! -f "$stamp" ]; then
      install_mpi4py_from_source "$BOOSTMPI_MPICC"
      touch "$stamp"
    fi
  fi
  stamp="$VENV/.boostmpi-installed-$(_boostmpi_hash "$(cat pyproject.toml)|$extras")"
  if [ ! -f "$stamp" ]; then
    echo "installing boostmpi$([ -n "$extras" ] && echo "[$extras]") into $VENV (first run only)"
    "$PY" -m pip install -q --disable-pip-version-check -e "$spec" || { echo "error: pip install failed" >&2; exit 1; }
    touch "$stamp"
  fi
  export VENV PY
}

# boostmpi_mpi4py_library: the MPI library mpi4py's extension is linked against (ldd; MPI is not
# initialised, so it works on a login node).
boostmpi_mpi4py_library() {
  local ext
  ext="$("$PY" -c 'import importlib.util; print(importlib.util.find_spec("mpi4py.MPI").origin)')" || return 1
  ldd "$ext" | awk '$1 ~ /^lib(mpi|mpich)[._]/ && $1 !~ /fort|cxx/ {print ($3 == "not" ? $1 " (not found)" : $3); exit}'
}

# boostmpi_check_site_venv PATTERN: stop unless $PY's mpi4py is linked against an MPI whose path
# contains PATTERN and the venv holds no MPICH wheel from PyPI.
boostmpi_check_site_venv() {
  local library
  if "$PY" -m pip show -q mpich >/dev/null 2>&1; then
    echo "error: $VENV holds the MPICH wheel from PyPI (the [mpich] extra); remove it: $PY -m pip uninstall -y mpich" >&2
    exit 1
  fi
  library="$(boostmpi_mpi4py_library)"
  case "$library" in
    *"$1"*) echo "mpi4py in $VENV uses $library" ;;
    *) echo "error: mpi4py in $VENV is linked against '${library:-no MPI library}', not the site MPI ($1)" >&2; exit 1 ;;
  esac
}

# boostmpi_cray_site_venv SITE EXTRAS: the venv of a Cray site (BOOSTMPI_VENV, default .venv-SITE)
# with mpi4py built against Cray MPICH and boostmpi[EXTRAS], checked. The site's modules must be loaded.
boostmpi_cray_site_venv() {
  export BOOSTMPI_VENV="${BOOSTMPI_VENV:-$PWD/.venv-$1}"
  # mpi4py's install notes, and OLCF's and NERSC's Python pages: on Cray, MPICC="cc -shared"
  export BOOSTMPI_MPICC="cc -shared"
  setup_venv "$2"
  boostmpi_check_site_venv "/opt/cray/pe/mpich"
}

boostmpi_mpiexec() {
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
    'import sys; from boostmpi.parallel.launch import find_mpiexec; print(find_mpiexec(sys.argv[1]))' "$PY"
}
