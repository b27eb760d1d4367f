#!/bin/bash -l
# ALCF Polaris, run once on a login node from the repository root:   bash jobs/setup_polaris.sh
# Builds the venv that jobs/polaris.pbs uses (BOOSTMPI_VENV, default .venv-polaris) the way ALCF's
# Python page recommends: a venv on top of the conda module's base environment, with
# --system-site-packages, whose mpi4py (ALCF's build, against Cray MPICH) the venv uses as it is;
# CuPy for CUDA 12 and ml_dtypes; no NCCL wheel (the conda module's NCCL is the one ALCF tuned with
# the aws-ofi-nccl plugin) and never the [mpich] extra (PyPI's MPICH brings a Hydra mpiexec that
# shadows PALS). Only if the base's mpi4py is not on the loaded Cray MPICH, mpi4py is built into the
# venv under PrgEnv-gnu: Polaris's default PrgEnv-nvidia makes `cc` the NVIDIA compiler, which
# rejects the GCC flags of Python's build configuration.
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

main() {
  set -eo pipefail
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  polaris_environment || { echo "error: loading ALCF's conda module failed (module use /soft/modulefiles; module load conda; conda activate base)" >&2; exit 2; }
  export BOOSTMPI_VENV_OPTIONS="--system-site-packages"   # ALCF "Python": a venv on top of conda base
  export BOOSTMPI_VENV="${BOOSTMPI_VENV:-$PWD/.venv-polaris}"
  # shellcheck source=jobs/setup_env.sh
  source jobs/setup_env.sh
  setup_venv ""                                          # mpi4py: the conda base's, if it is on the site MPI
  local site_mpi="${MPICH_DIR:?the cray-mpich module did not set MPICH_DIR}/lib/libmpi*.so*"
  if ! (boostmpi_check_site_venv "$site_mpi"); then
    echo "the conda base's mpi4py is not on $MPICH_DIR: building mpi4py into $VENV under PrgEnv-gnu"
    module swap PrgEnv-nvidia PrgEnv-gnu
    install_mpi4py_from_source "cc -shared"
    module swap PrgEnv-gnu PrgEnv-nvidia
  fi
  boostmpi_check_site_venv "$site_mpi"
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
