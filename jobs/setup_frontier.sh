#!/bin/bash
# OLCF Frontier, run once on a login node from the repository root:   bash jobs/setup_frontier.sh
# Builds the venv that jobs/frontier.sbatch uses (BOOSTMPI_VENV, default .venv-frontier):
#   Cray's Python, mpi4py compiled against Cray MPICH, CuPy compiled for ROCm (gfx90a), boostmpi
#   without the [mpich] extra (the PyPI MPICH has no Slingshot support) and without [gpu] (CUDA).
# jobs/frontier.sbatch sources this file for frontier_environment only (the same modules at run time).
# Put the venv on Orion (BOOSTMPI_VENV=/lustre/orion/<project>/...) for faster start-up at scale:
# OLCF "PyTorch on Frontier" page, "Environment Location" (NVMe > Orion >> NFS).

frontier_environment() {
  # OLCF "PyTorch on Frontier", batch script and "RCCL Network Plugin": load rccl-net-plugin after
  # rocm; the module points RCCL at the aws-ofi plugin and sets HPE's FI_CXI_* / NCCL_* settings.
  # craype-accel-amd-gfx90a: the GPU target of the Cray compiler wrappers (and Cray MPICH's GPU
  # transfer library when MPI carries device buffers). cray-python: the site's Python 3.
  module load PrgEnv-gnu rocm craype-accel-amd-gfx90a rccl-net-plugin "${BOOSTMPI_PYTHON_MODULE:-cray-python}"
  # OLCF "Installing CuPy" page: CuPy for ROCm finds ROCm through ROCM_HOME; it compiles kernels
  # at run time too, so the job needs it as well as the build
  export ROCM_HOME="${ROCM_PATH:?the rocm module did not set ROCM_PATH}"
}

main() {
  set -euo pipefail
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  frontier_environment
  # shellcheck source=jobs/setup_env.sh
  source jobs/setup_env.sh
  boostmpi_cray_site_venv frontier ""   # no [gpu]: that is CuPy for CUDA
  # OLCF "Installing CuPy", Frontier tab: CuPy built from source for HIP; 12.3.0 is the version
  # OLCF tested (it notes that 13.x does not work properly on Frontier)
  if ! "$PY" -c 'import cupy' 2>/dev/null; then
    echo "building CuPy ${BOOSTMPI_CUPY_VERSION:-12.3.0} for ROCm (gfx90a); OLCF says 10-20 minutes"
    CUPY_INSTALL_USE_HIP=1 HCC_AMDGPU_TARGET=gfx90a CC=gcc CXX=g++ \
      "$PY" -m pip install --no-cache-dir --no-binary=cupy "cupy==${BOOSTMPI_CUPY_VERSION:-12.3.0}"
  fi
  "$PY" -m pip install -q ml_dtypes   # bfloat16 arrays for CuPy
  echo "next: sbatch -A <project> jobs/frontier.sbatch   (docs/OPERATIONS.md, 'First run on Frontier')"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
