#!/bin/bash
# The real-GPU check, for anyone with a GPU node (an interactive job: salloc / qsub -I), from the
# repository root:
#
#   bash jobs/gpu_check.sh            # BOOSTMPI_VENV: the environment to use (default .venv-<site> found, else .venv)
#
# It runs, in order, and prints one summary to paste into a report:
#   1. (no GPU needed) the environment: Python, boostmpi, mpi4py's MPI, the kernel sources, CuPy's build;
#   2. whether CuPy reaches a GPU; without one (or on the test suite's CuPy stand-in) it stops here,
#      status 2, with one line saying so;
#   3. the GPU kernels compiled for this node's GPU (NVRTC or hipRTC), with the device's name;
#   4. the GPU test suite on the real CuPy (tests/test_gpu.py, tests/test_kernels.py; BOOSTMPI_CUPY_STANDIN=0);
#   5. a few bfloat16 training steps of configs/tiny.toml on one GPU;
#   6. with two GPUs or more, two ranks through NCCL/RCCL (parallel.comm=nccl, tp=2), under the
#      launcher named by BOOSTMPI_GPU_CHECK_LAUNCH (default: the mpiexec of mpi4py's MPI; on a
#      Slurm node e.g. "srun -n 2 --gpus-per-task=1").
# Exit status: 0 all passed, 1 a check failed, 2 no CuPy or no GPU (nothing past step 2 was run).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1

venv="${BOOSTMPI_VENV:-}"
if [ -z "$venv" ]; then
  for candidate in .venv-frontier .venv-perlmutter .venv-polaris .venv; do
    [ -x "$candidate/bin/python" ] && { venv="$PWD/$candidate"; break; }
  done
fi
PY="${venv:-$PWD/.venv}/bin/python"
[ -x "$PY" ] || { echo "error: no Python environment (set BOOSTMPI_VENV, or run jobs/setup_<site>.sh or jobs/local.sh first)" >&2; exit 2; }
WORK="$(mktemp -d "${TMPDIR:-/tmp}/boostmpi-gpu-check.XXXXXX")" || exit 1
trap 'rm -rf "$WORK"' EXIT

declare -a SUMMARY=()
failed=0
record() {  # NAME STATUS DETAIL
  SUMMARY+=("$(printf '%-22s %-4s %s' "$1" "$2" "$3")")
  [ "$2" = FAIL ] && failed=1
  echo "gpu_check: $1: $2 $3"
}
summary() {
  echo
  echo "==== boostmpi gpu_check summary ($(date -u '+%F %T') UTC, $(hostname), $(git rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
  printf '%s\n' "${SUMMARY[@]}"
}

# ---- 1. the environment (no GPU needed)
if env_line="$("$PY" -c '
import platform, boostmpi
from boostmpi.gpu.kernels import kernels_dir
from mpi4py import MPI
print(f"Python {platform.python_version()} | boostmpi {boostmpi.__version__} | {MPI.Get_library_version().splitlines()[0].strip()} | kernels {kernels_dir()}")' 2>&1)"; then
  record environment ok "$env_line"
else
  record environment FAIL "${env_line##*$'\n'}"
fi
cupy_line="$("$PY" -c '
import importlib.metadata
import cupy
installed = {d.metadata["Name"] for d in importlib.metadata.distributions()}
dists = ", ".join(d for d in ("cupy-cuda12x", "cupy-cuda13x", "cupy-rocm-7-0", "amd-cupy", "cupy") if d in installed)
dists = dists or "built from source"
standin = "stand-in " if "cupy_standin" in (cupy.__file__ or "") else ""
print(f"{standin}CuPy {cupy.__version__} ({dists}) at {cupy.__file__}")' 2>&1)" ||
  { record cupy none "${cupy_line##*$'\n'}"; summary
    echo "error: no CuPy in ${venv:-$PWD/.venv}: the GPU checks need the environment of jobs/setup_<site>.sh on a GPU node" >&2; exit 2; }
record cupy ok "$cupy_line"

# ---- 2. a GPU?
case "$cupy_line" in
  stand-in*)
    record gpu none "CuPy is the test suite's stand-in (tests/cupy_standin), not a GPU"
    summary
    echo "error: no GPU: the stand-in CuPy is on the path (unset PYTHONPATH / BOOSTMPI_CUPY_STANDIN); run this on a GPU node" >&2
    exit 2 ;;
esac
gpus="$("$PY" -c 'import cupy; print(cupy.cuda.runtime.getDeviceCount())' 2>&1)"
if ! [[ "$gpus" =~ ^[0-9]+$ ]] || [ "$gpus" -lt 1 ]; then
  record gpu none "CuPy reaches no GPU: ${gpus##*$'\n'}"
  summary
  echo "error: no GPU reachable from CuPy on $(hostname): run bash jobs/gpu_check.sh on a GPU node (an interactive job)" >&2
  exit 2
fi
device="$("$PY" -c '
import cupy
p = cupy.cuda.runtime.getDeviceProperties(0)
arch = p.get("gcnArchName", b"").decode() or "sm_%d%d" % (p["major"], p["minor"])
print(p["name"].decode(), "| arch", arch)' 2>&1)"
record gpu ok "$gpus visible; GPU 0: $device"

# ---- 3. the kernels, compiled for this GPU
if kernels="$(CUPY_CACHE_DIR="$WORK/kernel-cache" "$PY" -c '
import time
from boostmpi.gpu import kernels
t0 = time.perf_counter()
names = kernels.compile_all(0)
print("%d modules (%s) in %.1f s" % (len(names), " ".join(names), time.perf_counter() - t0))' 2>&1)"; then
  record kernels ok "$kernels"
else
  record kernels FAIL "${kernels##*$'\n'}"
fi

# ---- 4. the GPU suite on the real CuPy
if suite="$(BOOSTMPI_CUPY_STANDIN=0 timeout 3600 "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_kernels.py 2>&1)"; then
  record "gpu tests" ok "$(printf '%s\n' "$suite" | tail -1)"
else
  printf '%s\n' "$suite" | tail -30
  record "gpu tests" FAIL "$(printf '%s\n' "$suite" | tail -1)"
fi

# ---- 5. bfloat16 steps on one GPU
train=("$PY" -m boostmpi train --config configs/tiny.toml --set train.device=gpu --set train.dtype=bfloat16
       --set train.steps=5 --set checkpoint.every=0)
if one="$(timeout 900 "${train[@]}" --set "train.run_dir=$WORK/one" 2>&1)"; then
  record "bf16 steps, 1 GPU" ok "$(printf '%s\n' "$one" | grep -m1 '^done: ' || echo finished)"
else
  printf '%s\n' "$one" | tail -20
  record "bf16 steps, 1 GPU" FAIL "$(printf '%s\n' "$one" | tail -1)"
fi

# ---- 6. two ranks through NCCL/RCCL
if [ "$gpus" -ge 2 ]; then
  # shellcheck source=jobs/setup_env.sh
  source jobs/setup_env.sh
  read -r -a launch <<< "${BOOSTMPI_GPU_CHECK_LAUNCH:-$(boostmpi_mpiexec) -n 2}"
  if two="$(timeout 900 "${launch[@]}" "${train[@]}" --set parallel.tp=2 --set parallel.comm=nccl --set "train.run_dir=$WORK/two" 2>&1)"; then
    record "2 ranks, nccl" ok "$(printf '%s\n' "$two" | grep -m1 '^comm: ' || echo finished)"
  else
    printf '%s\n' "$two" | tail -20
    record "2 ranks, nccl" FAIL "$(printf '%s\n' "$two" | tail -1)"
  fi
else
  record "2 ranks, nccl" skip "one GPU on this node"
fi

summary
exit "$failed"
