#!/bin/bash
# NERSC Perlmutter GPU nodes, run once on a login node from the repository root:
#   bash jobs/setup_perlmutter.sh
# Builds the venv that jobs/perlmutter.sbatch uses (BOOSTMPI_VENV, default .venv-perlmutter): NERSC's
# Python, mpi4py compiled against Cray MPICH, boostmpi[gpu] (CuPy for CUDA 12 and NCCL), without
# the [mpich] extra (the PyPI MPICH has no Slingshot support).
# jobs/perlmutter.sbatch sources this file for perlmutter_environment only (the same modules at run time).

perlmutter_environment() {
  # NERSC "Using Python at NERSC": the python module is NERSC's supported Python; cudatoolkit and
  # craype-accel-nvidia80 give the CUDA runtime and Cray MPICH's GPU transfer library (needed when
  # MPI carries device buffers); the nccl module is NERSC's NCCL build with the Slingshot
  # (aws-ofi-nccl) plugin on its library path.
  module load PrgEnv-gnu cudatoolkit craype-accel-nvidia80 nccl "${BOOSTMPI_PYTHON_MODULE:-python}"
}

main() {
  set -euo pipefail
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  perlmutter_environment
  # shellcheck source=jobs/setup_env.sh
  source jobs/setup_env.sh
  # [gpu]: cupy-cuda12x wheels do not carry NCCL; the extra adds nvidia-nccl-cu12. At run time
  # the nccl module's plugin (libnccl-net.so) is found through LD_LIBRARY_PATH either way.
  boostmpi_cray_site_venv perlmutter gpu
  echo "next: sbatch -A <project>_g jobs/perlmutter.sbatch   (docs/OPERATIONS.md, 'First run on Perlmutter')"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
