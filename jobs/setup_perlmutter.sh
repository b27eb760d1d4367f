#!/bin/bash
# NERSC Perlmutter GPU nodes, run once on a login node from the repository root:
#   bash jobs/setup_perlmutter.sh
# Builds the venv that jobs/perlmutter.sbatch uses (BOOSTMPI_VENV, default .venv-perlmutter): NERSC's
# Python, mpi4py compiled against Cray MPICH, CuPy for CUDA 12 (cupy-cuda12x) and ml_dtypes, without
# the [mpich] extra (the PyPI MPICH has no Slingshot support) and without an NCCL wheel: the nccl
# module's NCCL, the one built with the Slingshot plugin, is the only NCCL the ranks load.
# jobs/perlmutter.sbatch sources this file for perlmutter_environment only (the same modules at run time).

# NERSC pages: of the pages this script follows, the stored copies read for it hold NERSC "Node Types"
# (docs.nersc.gov/beginner-guide/nodetypesfig), "Jobs" (docs.nersc.gov/jobs/), the introduction of
# "QOSes and Charges" (docs.nersc.gov/jobs/policy/) and "Perlmutter Readiness"
# (docs.nersc.gov/performance/readiness/). NERSC's module pages (the cudatoolkit, nccl and python
# modules and their current versions), "Using Python at NERSC" and the GPU-affinity page were not
# among them: no module version is pinned below, each module loads NERSC's default, and the
# versions the emulated site of testing/site_emu gives these defaults are placeholders, not NERSC's.
perlmutter_environment() {
  # NERSC "Using Python at NERSC": the python module is NERSC's supported Python; cudatoolkit and
  # craype-accel-nvidia80 give the CUDA runtime and Cray MPICH's GPU transfer library (needed when
  # MPI carries device buffers); the nccl module is NERSC's NCCL build with the Slingshot
  # (aws-ofi-nccl) plugin on its library path.
  module load PrgEnv-gnu cudatoolkit craype-accel-nvidia80 nccl "${BOOSTMPI_PYTHON_MODULE:-python}" || return 2
}

main() {
  set -euo pipefail
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  perlmutter_environment || exit 2
  # shellcheck source=jobs/setup_env.sh
  source jobs/setup_env.sh
  # no [gpu] extra: it brings nvidia-nccl-cu12, which CuPy would load instead of the nccl module's
  boostmpi_cray_site_venv perlmutter ""
  "$PY" -m pip install -q --disable-pip-version-check cupy-cuda12x ml_dtypes
  boostmpi_check_one_nccl
  echo "venv ready: $VENV (cupy-cuda12x $("$PY" -c 'import importlib.metadata as m; print(m.version("cupy-cuda12x"))'))"
  echo "next: bash jobs/submit.sh perlmutter -A <project>_g   (docs/OPERATIONS.md, 'First run on Perlmutter')"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
