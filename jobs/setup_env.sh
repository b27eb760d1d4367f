# shellcheck shell=bash
# Sourced by jobs/local.sh, tests/run.sh, the system-MPI test and jobs/setup_<site>.sh.
#
#   setup_venv EXTRAS        create $BOOSTMPI_VENV (default .venv) if missing, with $BOOSTMPI_VENV_PYTHON
#                            (default python3), and install boostmpi[EXTRAS] into it (again only when
#                            pyproject.toml or EXTRAS changed). Sets VENV and PY.
#                            With BOOSTMPI_MPICC set, mpi4py is first built from source with that MPI
#                            compiler wrapper, so the venv uses the machine's MPI, not a wheel's.
#   install_mpi4py_from_source MPICC
#                            build mpi4py against the MPI behind the wrapper MPICC (`mpicc.mpich`,
#                            `cc -shared` on Cray), as mpi4py's installation notes describe; with
#                            BOOSTMPI_MPI4PY_WHEELHOUSE=DIR, built once per MPI into a wheel kept there.
#   boostmpi_check_site_venv LIBRARY...
#                            stop unless mpi4py, asked itself, runs on one of the site's MPI LIBRARY files
#                            (links resolved) and no PyPI MPICH is installed (site setup, system-MPI test).
#   boostmpi_check_one_nccl  stop if the venv itself holds an NCCL wheel beside the site's NCCL.
#   boostmpi_cray_site_venv SITE EXTRAS
#                            the venv of jobs/setup_<site>.sh: mpi4py against Cray MPICH, boostmpi[EXTRAS].
#   boostmpi_mpiexec         print the mpiexec that belongs to $PY's MPI (boostmpi.parallel.launch.find_mpiexec).
# Needs only python3 with venv and pip.

install_mpi4py_from_source() {
  local mpicc="$1" house key
  # --no-binary: a wheel from PyPI would bring its own MPI ABI stubs; --no-cache-dir: never reuse a
  # build made against another MPI; --force-reinstall: replace an mpi4py that came from a wheel
  if [ -z "${BOOSTMPI_MPI4PY_WHEELHOUSE:-}" ]; then
    echo "building mpi4py from source against the MPI of \`$mpicc\` (a few minutes)"
    MPICC="$mpicc" "$PY" -m pip install -q --disable-pip-version-check --no-cache-dir --force-reinstall \
        --no-binary mpi4py "mpi4py>=3.1" || { echo "error: building mpi4py with MPICC=$mpicc failed" >&2; exit 1; }
    return 0
  fi
  # BOOSTMPI_MPI4PY_WHEELHOUSE: one build per MPI (the wrapper, the programming environment behind it,
  # the library folder its module names, the Python, the flags), kept as a wheel for the next venv
  key="$(_boostmpi_hash "$mpicc|$(command -v "${mpicc%% *}")|${PE_ENV:-}|${MPICH_DIR:-}|${CFLAGS:-}|$("$PY" -c 'import sys; print(sys.version)')")"
  house="$BOOSTMPI_MPI4PY_WHEELHOUSE/$key"
  if ! compgen -G "$house/mpi4py-*.whl" >/dev/null; then
    echo "building an mpi4py wheel against the MPI of \`$mpicc\` into $house (a few minutes, once)"
    MPICC="$mpicc" "$PY" -m pip wheel -q --disable-pip-version-check --no-cache-dir --no-deps --no-binary mpi4py \
        -w "$house" "mpi4py>=3.1" || { echo "error: building mpi4py with MPICC=$mpicc failed" >&2; exit 1; }
  fi
  "$PY" -m pip install -q --disable-pip-version-check --no-index --force-reinstall --find-links "$house" mpi4py ||
    { echo "error: installing the mpi4py wheel of $house failed" >&2; exit 1; }
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
    "${BOOSTMPI_VENV_PYTHON:-python3}" -m venv ${BOOSTMPI_VENV_OPTIONS:-} "$VENV" ||
      { echo "error: ${BOOSTMPI_VENV_PYTHON:-python3} -m venv failed (install python3-venv)" >&2; exit 1; }
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

# boostmpi_check_site_venv LIBRARY...: stop unless the MPI that $PY's mpi4py loads is one of the site's
# library files (globs allowed). The library itself is asked, not a path pattern matched: Cray PE links
# mpi4py against /opt/cray/pe/lib64/libmpi_gnu_*.so, a farm of links into /opt/cray/pe/mpich/<version>/...,
# so the loaded file and the site's are compared after every link is resolved (readlink -f). No MPI_Init:
# it works on a login node.
boostmpi_check_site_venv() {
  local report
  if "$PY" -m pip show -q mpich >/dev/null 2>&1; then
    echo "error: $VENV holds the MPICH wheel from PyPI (the [mpich] extra); remove it: $PY -m pip uninstall -y mpich" >&2
    exit 1
  fi
  report="$(PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c '
import glob, os, sys
from mpi4py import MPI
from boostmpi.parallel.startup import loaded_mpi_library
version = MPI.Get_library_version().strip().splitlines()[0].strip()
loaded = loaded_mpi_library()
real = os.path.realpath(loaded) if loaded else None
site = {os.path.realpath(f) for pattern in sys.argv[1:] for f in glob.glob(pattern)}
where = f"{loaded} -> {real}" if loaded and real != loaded else str(loaded)
wanted = " ".join(sys.argv[1:])
if real is None or real not in site:
    print(f"runs on {where} ({version}), not on the site MPI ({wanted})")
    sys.exit(1)
print(f"{version} | {where}")' "$@" 2>&1)" ||
    { echo "error: mpi4py in $VENV ${report##*$'\n'}" >&2; exit 1; }
  echo "mpi4py in $VENV: $report"
}

# boostmpi_check_one_nccl: stop if the venv's own site-packages hold an NCCL wheel (nvidia-nccl-cu*).
# CuPy 14 loads NCCL through cuda-pathfinder, which prefers NVIDIA wheels in site-packages to the
# library path (cuda.pathfinder.load_nvidia_dynamic_lib, "Search order"): such a wheel would be
# loaded instead of the site's NCCL, whose network plugin is what a multi-node job needs.
boostmpi_check_one_nccl() {
  local wheels
  wheels="$("$PY" -c '
import importlib.metadata, sysconfig
found = []
for dist in importlib.metadata.distributions(path=[sysconfig.get_paths()["purelib"]]):
    name = dist.metadata["Name"] or ""
    if name.lower().replace("_", "-").startswith("nvidia-nccl"):
        found.append(f"{name}=={dist.version}")
print(" ".join(found))')" ||
    { echo "error: cannot list the packages of $VENV" >&2; exit 1; }
  if [ -n "$wheels" ]; then
    echo "error: $VENV holds $wheels, a second NCCL beside the site's (which has the network plugin); remove it: $PY -m pip uninstall -y ${wheels%%==*}" >&2
    exit 1
  fi
}

# boostmpi_cray_site_venv SITE EXTRAS: the venv of a Cray site (BOOSTMPI_VENV, default .venv-SITE)
# with mpi4py built against Cray MPICH and boostmpi[EXTRAS], checked. The site's modules must be
# loaded: cray-mpich sets MPICH_DIR, whose lib/ holds the library (OLCF Frontier User Guide,
# "Compatible ROCm & Cray MPICH versions": "${MPICH_DIR}/lib").
boostmpi_cray_site_venv() {
  export BOOSTMPI_VENV="${BOOSTMPI_VENV:-$PWD/.venv-$1}"
  # mpi4py's install notes, OLCF's "Installing mpi4py and h5py" and NERSC's Python pages: on Cray, MPICC="cc -shared"
  export BOOSTMPI_MPICC="cc -shared"
  setup_venv "$2"
  boostmpi_check_site_venv "${MPICH_DIR:?the cray-mpich module did not set MPICH_DIR}/lib/libmpi*.so*"
}

boostmpi_mpiexec() {
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
    'import sys; from boostmpi.parallel.launch import find_mpiexec; print(find_mpiexec(sys.argv[1]))' "$PY"
}
