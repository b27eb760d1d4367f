#!/bin/bash
# ALCF Polaris, run once on a login node from the repository root:   bash jobs/setup_polaris.sh
# Builds the venv that jobs/polaris.pbs uses (BOOSTMPI_VENV, default .venv-polaris) the way ALCF's
# Python page recommends: a venv on top of the conda module's base environment, with
# --system-site-packages; mpi4py compiled against Cray MPICH; boostmpi[gpu] (CuPy for CUDA 12 and
# NCCL); never the [mpich] extra (PyPI's MPICH brings a Hydra mpiexec that shadows PALS).
# jobs/polaris.pbs sources this file for polaris_environment and POLARIS_NCCL_PLUGIN_DIR.

# ALCF "NCCL" page (Polaris libraries): the aws-ofi-nccl plugin build ALCF tested, and hwloc
POLARIS_NCCL_PLUGIN_DIR="${BOOSTMPI_NCCL_PLUGIN_DIR:-/soft/libraries/aws-ofi-nccl/v1.9.1-aws/lib}"
# shellcheck disable=SC2034  # used by jobs/polaris.pbs
POLARIS_HWLOC_DIR="${BOOSTMPI_HWLOC_DIR:-/soft/libraries/hwloc/lib}"

polaris_environment() {
  # ALCF "Python" page (Polaris data science): module use /soft/modulefiles; module load conda;
  # conda activate base. craype-accel-nvidia80: ALCF "Using GPUs": the GPU transfer library
  # that MPICH_GPU_SUPPORT_ENABLED=1 needs.
  module use /soft/modulefiles
  module load conda craype-accel-nvidia80
  conda activate base
}

main() {
  set -euo pipefail
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  polaris_environment
  export BOOSTMPI_VENV_OPTIONS="--system-site-packages"   # ALCF "Python": a venv on top of conda base
  # shellcheck source=jobs/setup_env.sh
  source jobs/setup_env.sh
  # mpi4py built into the venv shadows any mpi4py of the base environment; [gpu]: cupy-cuda12x
  # and nvidia-nccl-cu12
  boostmpi_cray_site_venv polaris gpu
  [ -d "$POLARIS_NCCL_PLUGIN_DIR" ] ||
    echo "warning: $POLARIS_NCCL_PLUGIN_DIR does not exist; set BOOSTMPI_NCCL_PLUGIN_DIR to the aws-ofi-nccl lib folder"
  echo "next: qsub -A <project> jobs/polaris.pbs   (docs/OPERATIONS.md, 'First run on Polaris')"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
