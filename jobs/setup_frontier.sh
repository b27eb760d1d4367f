#!/bin/bash
# OLCF Frontier, run once on a login node from the repository root:   bash jobs/setup_frontier.sh
# Builds the environment that jobs/frontier.sbatch uses (BOOSTMPI_VENV, default .venv-frontier): a
# conda environment with Python 3.12 from OLCF's miniforge3 module, mpi4py compiled against Cray
# MPICH, CuPy's own ROCm 7 wheel (cupy-rocm-7-0, CuPy 14.2 with bfloat16), boostmpi without the
# [mpich] extra (the PyPI MPICH has no Slingshot support) and without [gpu] (that is CuPy for CUDA).
# jobs/frontier.sbatch sources this file for frontier_environment only (the same modules at run time).
# Put the environment on Orion (BOOSTMPI_VENV=/lustre/orion/<project>/...) for faster start-up at
# scale: OLCF "PyTorch on Frontier" page, "Environment Location" (NVMe > Orion >> NFS).
#
# The programming environment and ROCm are one pair from OLCF's compatibility table (Frontier User
# Guide, "Compatible ROCm & Cray MPICH versions"): cray-mpich 9.1.0 / cpe 26.03 with ROCm 7.2, 7.1
# and 7.0 (7.0 the officially supported one), the pair OLCF's "Installing CuPy" page loads
# (cpe/26.03, rocm/7.0.2). BOOSTMPI_CPE and BOOSTMPI_ROCM choose another pair of the table.
FRONTIER_CPE="${BOOSTMPI_CPE:-26.03}"
FRONTIER_ROCM="${BOOSTMPI_ROCM:-7.0.2}"
# OLCF "Installing CuPy", Frontier tab, and "Python on OLCF Systems", "Module Usage"
FRONTIER_PRGENV=PrgEnv-gnu/8.7.0
FRONTIER_PYTHON_MODULE="${BOOSTMPI_PYTHON_MODULE:-miniforge3/23.11.0-0}"

# frontier_module_problem CPE ROCM: why OLCF's table does not list this pair, or nothing. CPE below
# 24.03 and ROCm 5 are left out: OLCF removes them on July 1, 2026 (Frontier User Guide, system updates).
frontier_module_problem() {
  local cpe="$1" rocm="$2" listed
  case "$cpe" in
    24.03|24.07) listed="6.2.4 6.2.0 6.1.3 6.0.0" ;;
    24.11|25.03) listed="6.3.1 6.2.4 6.2.0 6.1.3 6.0.0" ;;
    25.09) listed="6.4 6.3 6.2 6.1 6.0" ;;
    26.03) listed="7.2 7.1 7.0" ;;
    *) echo "cpe/$cpe is not in OLCF's compatibility table (cpe 24.03 to 26.03)"; return 0 ;;
  esac
  local version
  for version in $listed; do
    case "$rocm" in "$version"|"$version".*) return 0 ;; esac
  done
  echo "rocm/$rocm is not listed with cpe/$cpe in OLCF's compatibility table (cpe/$cpe: ROCm $listed)"
}

frontier_environment() {
  local problem
  problem="$(frontier_module_problem "$FRONTIER_CPE" "$FRONTIER_ROCM")"
  if [ -n "$problem" ]; then
    echo "error: $problem; set BOOSTMPI_CPE and BOOSTMPI_ROCM to a pair the Frontier User Guide lists together" >&2
    return 2
  fi
  # OLCF "Installing CuPy" (Frontier tab): this order. rccl-net-plugin after rocm ("PyTorch on
  # Frontier", "RCCL Network Plugin"): it points RCCL at the aws-ofi plugin and sets HPE's FI_CXI_* and
  # NCCL_* settings. craype-accel-amd-gfx90a: the GPU target of the compiler wrappers and Cray MPICH's
  # GPU transfer library (GPU-aware MPI, COMM=mpi).
  module load "$FRONTIER_PRGENV" "cpe/$FRONTIER_CPE" "$FRONTIER_PYTHON_MODULE" "rocm/$FRONTIER_ROCM" \
      craype-accel-amd-gfx90a rccl-net-plugin || return 2
  # Frontier User Guide, "Compatibility with other CrayPE-provided Software": a non-default cpe needs
  # its libraries first on the library path, when building and when running
  export LD_LIBRARY_PATH="${CRAY_LD_LIBRARY_PATH:?the cpe module did not set CRAY_LD_LIBRARY_PATH}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # OLCF "Installing CuPy": CuPy for ROCm finds ROCm through ROCM_HOME, "also necessary during runtime"
  export ROCM_HOME="${ROCM_PATH:?the rocm module did not set ROCM_PATH}"
}

main() {
  set -euo pipefail
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  frontier_environment || exit 2
  # shellcheck source=jobs/setup_env.sh
  source jobs/setup_env.sh
  export BOOSTMPI_VENV="${BOOSTMPI_VENV:-$PWD/.venv-frontier}"
  if [ ! -x "$BOOSTMPI_VENV/bin/python" ]; then
    # OLCF "Installing CuPy" and "PyTorch on Frontier": a conda environment with Python 3.12 (the
    # miniforge3 base is Python 3.10, "Conda Basics", below boostmpi's 3.11)
    echo "creating the conda environment $BOOSTMPI_VENV (python=3.12, conda-forge)"
    conda create -y -q -p "$BOOSTMPI_VENV" python=3.12 -c conda-forge
  fi
  boostmpi_cray_site_venv frontier ""   # no [gpu]: that is CuPy for CUDA
  # CuPy's wheel for ROCm 7.0 from PyPI (CuPy 14.2: bfloat16, which AMD's amd-cupy 13.5 of OLCF's
  # CuPy page lacks); ml_dtypes: the bfloat16 dtype on the host
  case "$FRONTIER_ROCM" in
    7.*) ;;
    *) echo "error: cupy-rocm-7-0 needs ROCm 7; rocm/$FRONTIER_ROCM has no CuPy 14 wheel (set BOOSTMPI_ROCM=7.0.2)" >&2; exit 2 ;;
  esac
  "$PY" -m pip install -q --disable-pip-version-check "cupy-rocm-7-0==${BOOSTMPI_CUPY_VERSION:-14.2.0}" ml_dtypes
  echo "venv ready: $BOOSTMPI_VENV (cupy-rocm-7-0 $("$PY" -c 'import importlib.metadata as m; print(m.version("cupy-rocm-7-0"))'))"
  echo "next: bash jobs/submit.sh frontier -A <project>   (docs/OPERATIONS.md, 'First run on Frontier')"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
