#!/bin/bash -l
# ALCF Polaris, run once on a login node from the repository root:   bash jobs/setup_polaris.sh
# Builds the venv that jobs/polaris.pbs uses (BOOSTMPI_VENV, default .venv-polaris) the way ALCF's
# Python page recommends: a venv on top of the conda module's base environment, with
# --system-site-packages, whose mpi4py (ALCF's build, against Cray MPICH) the venv uses as it is;
# CuPy for CUDA 12 and ml_dtypes; no NCCL wheel (the conda module's NCCL is the one ALCF tuned with
# the aws-ofi-nccl plugin) and never the [mpich] extra (PyPI's MPICH brings a Hydra mpiexec that
# shadows PALS). ALCF's current conda module loads PrgEnv-gnu itself (argonne-lcf/conda_install_scripts,
# alcf_polaris/modulefiles/conda/2025-09-25.lua: depends_on("PrgEnv-gnu")), so the base's mpi4py
# normally is on the loaded Cray MPICH. Only if it is not, mpi4py is built into the venv under
# PrgEnv-gnu (loaded first if another PrgEnv is: PrgEnv-nvidia's `cc` is the NVIDIA compiler, which
# rejects the GCC flags of Python's build configuration), and the build is checked against the
# MPICH of that same PrgEnv, the one it linked (each PrgEnv's MPICH_DIR is its own libmpi), with no
# swap back: the jobs run under the conda module, that is under PrgEnv-gnu, too.
# jobs/polaris.pbs sources this file for polaris_environment and POLARIS_NCCL_PLUGIN_DIR.

# ALCF "NCCL" page (Polaris libraries): the aws-ofi-nccl plugin build ALCF tested, and hwloc
POLARIS_NCCL_PLUGIN_DIR="${BOOSTMPI_NCCL_PLUGIN_DIR:-/soft/libraries/aws-ofi-nccl/v1.9.1-aws/lib}"
# shellcheck disable=SC2034  # used by jobs/polaris.pbs
POLARIS_HWLOC_DIR="${BOOSTMPI_HWLOC_DIR:-/soft/libraries/hwloc/lib}"

# polaris_environment: ALCF "Python" page (Polaris data science): module use /soft/modulefiles;
# module load conda; conda activate base. craype-accel-nvidia80: ALCF "Using GPUs": the GPU transfer
# library that MPICH_GPU_SUPPORT_ENABLED=1 needs. conda's activation scripts read variables that may
# be unset, so it runs without `set -u` whatever the caller set.
polaris_environment() {
  local had_u=0
  case $- in *u*) had_u=1; set +u ;; esac
  module use /soft/modulefiles && module load conda craype-accel-nvidia80 && conda activate base
  local status=$?
  [ "$had_u" = 1 ] && set -u
  return "$status"
}

# polaris_site_mpi: the glob of the loaded Cray MPICH's libraries (MPICH_DIR follows the PrgEnv).
polaris_site_mpi() {
  echo "${MPICH_DIR:?the cray-mpich module did not set MPICH_DIR}/lib/libmpi*.so*"
}

main() {
  set -eo pipefail
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  polaris_environment || { echo "error: loading ALCF's conda module failed (module use /soft/modulefiles; module load conda; conda activate base)" >&2; exit 2; }
  export BOOSTMPI_VENV_OPTIONS="--system-site-packages"   # ALCF "Python": a venv on top of conda base
  export BOOSTMPI_VENV="${BOOSTMPI_VENV:-$PWD/.venv-polaris}"
  # shellcheck source=jobs/setup_env.sh
  source jobs/setup_env.sh
  : "${MPICH_DIR:?the cray-mpich module did not set MPICH_DIR}"
  setup_venv ""                                          # mpi4py: the conda base's, if it is on the site MPI
  if ! (boostmpi_check_site_venv "$(polaris_site_mpi)"); then
    echo "the conda base's mpi4py is not on $MPICH_DIR: building mpi4py into $VENV under PrgEnv-gnu"
    if [ "${PE_ENV:-}" != GNU ]; then
      module load PrgEnv-gnu || { echo "error: module load PrgEnv-gnu failed" >&2; exit 2; }
    fi
    install_mpi4py_from_source "cc -shared"
  fi
  boostmpi_check_site_venv "$(polaris_site_mpi)"         # the MPICH of the PrgEnv loaded now, the one built with
  "$PY" -m pip install -q --disable-pip-version-check cupy-cuda12x ml_dtypes
  boostmpi_check_one_nccl
  [ -d "$POLARIS_NCCL_PLUGIN_DIR" ] ||
    echo "warning: $POLARIS_NCCL_PLUGIN_DIR does not exist; set BOOSTMPI_NCCL_PLUGIN_DIR to the aws-ofi-nccl lib folder"
  echo "venv ready: $VENV"
  echo "next: bash jobs/submit.sh polaris -A <project>   (docs/OPERATIONS.md, 'First run on Polaris')"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
