#!/bin/bash
# The real-GPU check, for anyone with a GPU node (an interactive job: salloc / qsub -I), from the
# repository root:
#
#   bash jobs/gpu_check.sh
#
# The Python it runs: $BOOSTMPI_PYTHON; else $BOOSTMPI_VENV/bin/python; else the first of .venv-frontier,
# .venv-perlmutter, .venv-polaris, .venv that exists; else python3 on PATH (a centre's module or a
# container: a fixed environment with CuPy, mpi4py, NumPy, h5py, xxhash and pytest). boostmpi is the one
# installed there (offline: pip install --no-deps --no-build-isolation -e .), or, when it does not import,
# this checkout, put on PYTHONPATH (exported, so the ranks of steps 4 and 6 import it too).
#
# It runs, in order, and prints one summary to paste into a report:
#   1. (no GPU needed) the environment: Python, boostmpi, the kernel sources; mpi4py's MPI library
#      (steps 5 and 6 and the multi-rank tests need one that loads, one GPU included); CuPy's build;
#   2. whether CuPy reaches a GPU; without one (or on the test suite's CuPy stand-in) it stops here,
#      status 2, with one line saying so;
#   3. the GPU kernels compiled once for this node's GPU (NVRTC or hipRTC) into CuPy's kernel cache
#      (CUPY_CACHE_DIR; default a folder of this run), from which the later steps load them, and where
#      the tensor-core attention found CUDA's crt/mma.h (or the line saying which package brings it);
#   4. the single-rank GPU tests on the real CuPy (BOOSTMPI_CUPY_STANDIN=0; $BOOSTMPI_GPU_CHECK_TESTS,
#      default tests/integration/gpu/test_gpu.py tests/kernels/test_kernels.py; `-m "gpu and not multirank"`: what runs on the
#      GPU, not the compile-only tests), then the multi-rank ones (`-m "gpu and multirank"`: 4 ranks
#      under mpiexec, one GPU each) with 4 GPUs or more;
#   5. a few bfloat16 training steps of configs/tiny.toml on one GPU;
#   6. with two GPUs or more, two ranks through NCCL/RCCL (parallel.comm=nccl, tp=2), under the
#      launcher named by BOOSTMPI_GPU_CHECK_LAUNCH (default: the mpiexec of mpi4py's MPI; on a
#      Slurm node e.g. "srun -n 2 --gpus-per-task=1").
# A step that cannot run here says why in one line (skip). Exit status: 0 all passed, 1 a check failed,
# 2 no Python, no CuPy or no GPU (nothing past step 2 was run).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
# compiled modules: into the folder PYTHONPYCACHEPREFIX names where one is set, else none (nothing written
# next to the sources of a fixed environment)
[ -n "${PYTHONPYCACHEPREFIX:-}" ] || export PYTHONDONTWRITEBYTECODE=1
RANKS_OF_THE_MULTI_RANK_TESTS=4

PY="${BOOSTMPI_PYTHON:-}"
if [ -z "$PY" ] && [ -n "${BOOSTMPI_VENV:-}" ]; then
  PY="$BOOSTMPI_VENV/bin/python"
fi
if [ -z "$PY" ]; then
  for candidate in .venv-frontier .venv-perlmutter .venv-polaris .venv; do
    [ -x "$candidate/bin/python" ] && { PY="$PWD/$candidate/bin/python"; break; }
  done
fi
PY="$(command -v "${PY:-python3}")"  # a command name (BOOSTMPI_PYTHON=python3) or a path
[ -n "$PY" ] && [ -x "$PY" ] ||
  { echo "error: no Python: set BOOSTMPI_PYTHON (or BOOSTMPI_VENV), run jobs/setup_<site>.sh or jobs/local.sh, or put python3 on PATH" >&2; exit 2; }
if ! (cd / && "$PY" -c 'import boostmpi' 2>/dev/null); then  # from /: not this checkout as the current folder
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  where="this checkout on PYTHONPATH"
else
  where="installed"
fi
WORK="$(mktemp -d "${TMPDIR:-/tmp}/boostmpi-gpu-check.XXXXXX")" || exit 1
trap 'rm -rf "$WORK"' EXIT
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-$WORK/kernel-cache}"

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
import platform, sys, boostmpi
from boostmpi.gpu.kernels import kernels_dir
print(f"Python {platform.python_version()} ({sys.executable}) | boostmpi {boostmpi.__version__} at {boostmpi.__path__[0]}"
      f" | kernels {kernels_dir()}")' 2>&1)"; then
  record environment ok "$env_line ($where)"
else
  record environment FAIL "${env_line##*$'\n'}"
fi
if mpi_line="$("$PY" -c '
from mpi4py import MPI
print(MPI.Get_library_version().splitlines()[0].strip())' 2>&1)"; then
  record mpi ok "$mpi_line"
  mpi=1
else
  record mpi FAIL "mpi4py loads no MPI library (one GPU needs one too): ${mpi_line##*$'\n'}"
  mpi=0
fi
needs_mpi() {  # NAME: one line for a step that needs MPI when there is none
  [ "$mpi" = 1 ] && return 0
  record "$1" skip "needs a loadable MPI library (see the mpi line)"
  return 1
}
cupy_line="$("$PY" -c '
import importlib.metadata
import cupy
installed = {d.metadata["Name"] for d in importlib.metadata.distributions()}
dists = ", ".join(d for d in ("cupy-cuda12x", "cupy-cuda13x", "cupy-rocm-7-0", "amd-cupy", "cupy") if d in installed)
dists = dists or "built from source"
standin = "stand-in " if "cupy_standin" in (cupy.__file__ or "") else ""
print(f"{standin}CuPy {cupy.__version__} ({dists}) at {cupy.__file__}")' 2>&1)" ||
  { record cupy none "${cupy_line##*$'\n'}"; summary
    echo "error: no CuPy for $PY: the GPU checks need the environment of jobs/setup_<site>.sh (or one with CuPy) on a GPU node" >&2; exit 2; }
record cupy ok "$cupy_line"

# ---- 2. a GPU?
case "$cupy_line" in
  stand-in*)
    record gpu none "CuPy is the test suite's stand-in (testing/cupy_standin), not a GPU"
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

# ---- 3. the kernels, compiled once for this GPU into CUPY_CACHE_DIR
if kernels="$("$PY" -c '
import time
from boostmpi.gpu import kernels, tensor_cores
t0 = time.perf_counter()
names = kernels.compile_all(0)
header = tensor_cores.mma_include()
header = f"crt/mma.h in {header[2:]}" if header else tensor_cores.header_missing()
print("%d modules (%s) in %.1f s; %s" % (len(names), " ".join(names), time.perf_counter() - t0, header))' 2>&1)"; then
  record kernels ok "$kernels"
else
  record kernels FAIL "${kernels##*$'\n'}"
fi

# ---- 4. the GPU tests on the real CuPy: single-rank ones on GPU 0, multi-rank ones with a GPU per rank
read -r -a tests <<< "${BOOSTMPI_GPU_CHECK_TESTS:-tests/integration/gpu/test_gpu.py tests/kernels/test_kernels.py}"
gpu_tests() {  # NAME MARK TIMEOUT
  local out rc
  # pytest's progress goes to the terminal as it runs (a long step shows how far it got) and to a log
  BOOSTMPI_CUPY_STANDIN=0 timeout "$3" "$PY" -m pytest -q -p no:cacheprovider --durations=5 -m "$2" "${tests[@]}" \
    2>&1 | tee "$WORK/pytest.log"
  rc=${PIPESTATUS[0]}
  out="$(cat "$WORK/pytest.log")"
  if [ "$rc" = 0 ]; then
    record "$1" ok "$(printf '%s\n' "$out" | tail -1)"
  elif [ "$rc" = 5 ]; then
    record "$1" skip "no test of ${tests[*]} is marked '$2'"
  else
    record "$1" FAIL "$([ "$rc" = 124 ] && echo "timed out after $3 s: ")$(printf '%s\n' "$out" | tail -1)"
  fi
}
gpu_tests "gpu tests, 1 rank" "gpu and not multirank" 900
if [ "$gpus" -lt "$RANKS_OF_THE_MULTI_RANK_TESTS" ]; then
  record "gpu tests, 4 ranks" skip "the multi-rank GPU tests start $RANKS_OF_THE_MULTI_RANK_TESTS ranks, one GPU each; this node has $gpus"
elif needs_mpi "gpu tests, 4 ranks"; then
  gpu_tests "gpu tests, 4 ranks" "gpu and multirank" 1200
fi

# ---- 5. bfloat16 steps on one GPU
train=("$PY" -m boostmpi train --config configs/tiny.toml --set train.device=gpu --set train.dtype=bfloat16
       --set train.steps=5 --set checkpoint.every=0)
if needs_mpi "bf16 steps, 1 GPU"; then
  if one="$(timeout 900 "${train[@]}" --set "train.run_dir=$WORK/one" 2>&1)"; then
    record "bf16 steps, 1 GPU" ok "$(printf '%s\n' "$one" | grep -m1 '^done: ' || echo finished)"
  else
    printf '%s\n' "$one" | tail -20
    record "bf16 steps, 1 GPU" FAIL "$(printf '%s\n' "$one" | tail -1)"
  fi
fi

# ---- 6. two ranks through NCCL/RCCL
if [ "$gpus" -lt 2 ]; then
  record "2 ranks, nccl" skip "two ranks need two GPUs; this node has $gpus"
elif needs_mpi "2 ranks, nccl"; then
  # the mpiexec of the chosen Python's MPI (boostmpi.parallel.launch.find_mpiexec), not jobs/setup_env.sh's python3
  if launcher="${BOOSTMPI_GPU_CHECK_LAUNCH:-$("$PY" -c '
import sys
from boostmpi.parallel.launch import find_mpiexec
print(find_mpiexec(sys.executable), "-n 2")' 2>&1)}"; then
    read -r -a launch <<< "$launcher"
    if two="$(timeout 900 "${launch[@]}" "${train[@]}" --set parallel.tp=2 --set parallel.comm=nccl --set "train.run_dir=$WORK/two" 2>&1)"; then
      record "2 ranks, nccl" ok "$(printf '%s\n' "$two" | grep -m1 '^comm: ' || echo finished)"
    else
      printf '%s\n' "$two" | tail -20
      record "2 ranks, nccl" FAIL "$(printf '%s\n' "$two" | tail -1)"
    fi
  else
    record "2 ranks, nccl" FAIL "no launcher: ${launcher##*$'\n'} (set BOOSTMPI_GPU_CHECK_LAUNCH)"
  fi
fi

summary
exit "$failed"
