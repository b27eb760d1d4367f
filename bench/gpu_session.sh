#!/bin/bash
# One prepared GPU session on a one-GPU machine (written for one H200), from the repository root:
#
#   OUT=/some/folder bash bench/gpu_session.sh        # GPU_SESSION_DRY=1: print the commands, run nothing
#
# Steps (STEPS, default "0 1 2 3 4 5", in that order), each under its own `timeout` (T_* below), going on
# past a failure, the whole session within SESSION_S seconds (a step gets what is left when its own
# limit would pass it; the limits add up to more than 7 minutes, so a slow session cuts the last steps):
#   0. carried wheels: with a .whl/ folder, `pip install --target /tmp/site` of its wheels (no
#      network, no dependencies) and PYTHONPATH=/tmp/site:$PWD; the versions (nvidia-smi, packages);
#   1. bench/attention.py: every backend, the table's and the paper's shapes (--budget-s ATTENTION_BUDGET_S);
#   2. bench/gpu_calibrate.py --out $OUT/calibrate.toml;
#   3. bench/gpu_vs_model.py;
#   4. bench/gpu_step.py once per STEP_CASES entry (default: cudnn, torch, own, and cudnn with --graph: the
#      step replayed from a CUDA graph beside the eager one; PyTorch eager on the first only); an entry is a
#      backend and gpu_step.py's flags joined by ':' (e.g. cudnn:--profile, cudnn:--graph:--profile,
#      torch:--nondeterministic, cudnn:--batch:32);
#   5. the real-GPU kernel tests and the CUDA graph step's tests (BOOSTMPI_CUPY_STANDIN=0);
#   6. bench/torch_allocators.py (two allocators in one process against CuPy's alone);
#   7. jobs/gpu_check.sh as written (BOOSTMPI_PYTHON=$PYTHON), timed: the first-contact check on this node.
# Everything is written under $OUT, ten files at most: session.log (this script's lines, the
# versions and bench/attention.py's rows), attention.json, attention.md, calibrate.toml,
# calibrate.log, gpu_vs_model.log, gpu_step.log, tests.log, allocators.log, gpu_check.log. At the end the results are printed again,
# so that the tail of the output holds them.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

: "${OUT:?set OUT to the folder the results go to}"
DRY="${GPU_SESSION_DRY:-0}"
PY="${PYTHON:-python3}"
SESSION_S="${SESSION_S:-420}"                 # 7 minutes in all
KILL_S=10                                     # timeout -k: a step that ignores SIGTERM is killed this much later
T_SETUP="${T_SETUP:-60}"                      # 0: wheels and versions
T_ATTENTION="${T_ATTENTION:-180}"             # 1: bench/attention.py (its own budget below, plus the last shape)
ATTENTION_BUDGET_S="${ATTENTION_BUDGET_S:-150}"
T_CALIBRATE="${T_CALIBRATE:-120}"             # 2
T_VS_MODEL="${T_VS_MODEL:-60}"                # 3
T_STEP="${T_STEP:-30}"                        # 4: per backend
T_TESTS="${T_TESTS:-90}"                      # 5
T_ALLOCATORS="${T_ALLOCATORS:-90}"            # 6
T_GPU_CHECK="${T_GPU_CHECK:-360}"             # 7: the check's target is under 6 minutes on one GPU
ATTENTION_BACKENDS="${ATTENTION_BACKENDS:-cudnn,torch,own-wmma,own-fma,sdpa}"  # step 1 (bench/attention.py --backends)
ATTENTION_ARGS="${ATTENTION_ARGS:-}"          # extra words for step 1 (e.g. --queued)
STEP_CASES="${STEP_CASES:-cudnn torch own cudnn:--graph}"  # step 4 (see above)
GPU_CALIBRATE_ARGS="${GPU_CALIBRATE_ARGS:-}"  # extra words for steps 2 and 3 (split on spaces)
GPU_VS_MODEL_ARGS="${GPU_VS_MODEL_ARGS:-}"
STEPS="${STEPS:-0 1 2 3 4 5}"                 # which steps (6 and 7 only when named), in this order (e.g. "0 5 4" to run those again)

export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT" || exit 1
LOG="$OUT/session.log"
START=$(date +%s)

say() {
  local line
  line="[$(date -u +%H:%M:%S) +$(( $(date +%s) - START ))s] $*"
  echo "$line"
  echo "$line" >>"$LOG"
}

# step NAME LIMIT_S LOGFILE COMMAND...: COMMAND under `timeout`, its output appended to LOGFILE
step() {
  local name="$1" limit="$2" log="$3" left rc arg shown=""
  shift 3
  for arg in "$@"; do  # a program text given with -c is shown as <program>
    [[ "$arg" == *$'\n'* ]] && arg="<program>"
    shown+=" $arg"
  done
  left=$(( SESSION_S - ($(date +%s) - START) - KILL_S ))
  if (( left < 5 )); then
    say "$name: skipped: the session's ${SESSION_S} s are spent"
    return 0
  fi
  (( limit > left )) && limit=$left
  say "$name (timeout ${limit} s, output in ${log#"$OUT"/}):$shown"
  [ "$DRY" = 1 ] && return 0
  echo "=== $name: $* (timeout ${limit} s, $(date -u '+%F %T') UTC)" >>"$log"
  timeout -k "$KILL_S" "$limit" "$@" >>"$log" 2>&1
  rc=$?
  case $rc in
    0) say "$name: done" ;;
    124|137) say "$name: TIMED OUT after ${limit} s (exit $rc)" ;;
    *) say "$name: FAILED (exit $rc)" ;;
  esac
  return 0
}

# a script another change adds: a line saying it is missing instead of a Python traceback
have() {
  [ -f "$1" ] && return 0
  if [ "$DRY" = 1 ]; then
    say "$1 is not in this checkout (a dry run shows its step anyway)"
    return 0
  fi
  say "$1 is not in this checkout: skipped"
  return 1
}

say "gpu_session: $(hostname), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), OUT=$OUT, dry=$DRY"

# ---- 0. carried wheels, versions
step_0() {
  local wheels
  shopt -s nullglob
  wheels=(.whl/*.whl)
  shopt -u nullglob
  if (( ${#wheels[@]} )); then
    step "0. wheels" "$T_SETUP" "$LOG" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/site "${wheels[@]}"
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
  else
    say "0. wheels: no .whl/ folder, nothing to install"
  fi
  step "0. nvidia-smi" 20 "$LOG" nvidia-smi
  step "0. versions" "$T_SETUP" "$LOG" "$PY" -c "$VERSIONS_PY"
}
VERSIONS_PY='
import importlib.metadata as md, platform, sys
print("python", platform.python_version(), sys.executable)
names = ("torch", "cupy-cuda13x", "cupy-cuda12x", "nvidia-cudnn-frontend", "nvidia-cudnn-cu13", "nvidia-cudnn-cu12",
         "cuda-bindings", "cuda-python", "nvidia-cuda-nvrtc", "nvidia-cuda-nvcc", "mpi4py", "numpy", "ml_dtypes", "pytest")
for name in names:
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} not installed")
try:
    import cupy
    print("cupy", cupy.__version__, cupy.__file__, "runtime", cupy.cuda.runtime.runtimeGetVersion(),
          "driver API", cupy.cuda.runtime.driverGetVersion())
    print("device", cupy.cuda.runtime.getDeviceProperties(0)["name"].decode())
except Exception as exc:
    print("cupy:", type(exc).__name__, exc)
try:
    import torch
    print("torch", torch.__version__, "CUDA", torch.version.cuda, "cuDNN", torch.backends.cudnn.version(),
          "available", torch.cuda.is_available())
except Exception as exc:
    print("torch:", type(exc).__name__, exc)
'

# ---- 1. attention, every backend
step_1() {
  # shellcheck disable=SC2086 # the extra words are meant to be split
  step "1. bench/attention.py" "$T_ATTENTION" "$LOG" "$PY" bench/attention.py \
    --backends "$ATTENTION_BACKENDS" --shapes table,paper --budget-s "$ATTENTION_BUDGET_S" \
    --json "$OUT/attention.json" --markdown "$OUT/attention.md" $ATTENTION_ARGS
}

# ---- 2. calibration, 3. the GPU against the model
step_2() {
  # shellcheck disable=SC2086 # the extra words are meant to be split
  have bench/gpu_calibrate.py && step "2. bench/gpu_calibrate.py" "$T_CALIBRATE" "$OUT/calibrate.log" "$PY" \
    bench/gpu_calibrate.py --out "$OUT/calibrate.toml" $GPU_CALIBRATE_ARGS
}
step_3() {
  # shellcheck disable=SC2086
  have bench/gpu_vs_model.py && step "3. bench/gpu_vs_model.py" "$T_VS_MODEL" "$OUT/gpu_vs_model.log" "$PY" \
    bench/gpu_vs_model.py $GPU_VS_MODEL_ARGS
}

# ---- 4. the training step, once per attention backend (PyTorch eager measured on the first only)
step_4() {
  local case words eager=()
  for case in $STEP_CASES; do
    IFS=: read -r -a words <<<"$case"
    step "4. bench/gpu_step.py --attention ${words[*]}" "$T_STEP" "$OUT/gpu_step.log" "$PY" bench/gpu_step.py \
      --attention "${words[@]}" ${eager[@]+"${eager[@]}"}
    eager=(--no-eager --skip-kernels)
  done
}

# ---- 5. the real-GPU kernel tests
step_5() {
  # the kernels compiled and run, and the CUDA graph step captured on the device (cuBLAS through ctypes)
  step "5. kernel tests" "$T_TESTS" "$OUT/tests.log" env BOOSTMPI_CUPY_STANDIN=0 "$PY" -m pytest -q -p no:cacheprovider \
    tests/kernels/test_kernels.py::test_compile_all_compiles_every_kernel_file tests/kernels/attention/test_attention_kernel.py \
    tests/unit/gpu/test_cublas_capture.py tests/unit/train/test_graph_step.py
}

# ---- 6. two allocators, 7. the first-contact check as written
step_6() {
  have bench/torch_allocators.py && step "6. bench/torch_allocators.py" "$T_ALLOCATORS" "$OUT/allocators.log" "$PY" \
    bench/torch_allocators.py
}
step_7() {
  step "7. jobs/gpu_check.sh" "$T_GPU_CHECK" "$OUT/gpu_check.log" env BOOSTMPI_PYTHON="$(command -v "$PY")" \
    bash jobs/gpu_check.sh
}

for s in $STEPS; do
  case "$s" in
    0) step_0 ;;
    1) step_1 ;;
    2) step_2 ;;
    3) step_3 ;;
    4) step_4 ;;
    5) step_5 ;;
    6) step_6 ;;
    7) step_7 ;;
    *) say "STEPS: unknown step $s (0-7): skipped" ;;
  esac
done

say "gpu_session: finished in $(( $(date +%s) - START )) s; files in $OUT: $(find "$OUT" -maxdepth 1 -type f -printf '%f ')"
[ "$DRY" = 1 ] && exit 0
# the results again, for whoever reads only the tail of this output (the attention table last)
for f in calibrate.log gpu_vs_model.log tests.log allocators.log gpu_check.log; do
  [ -f "$OUT/$f" ] && { echo "==== $f (last 12 lines)"; tail -n 12 "$OUT/$f"; }
done
[ -f "$OUT/gpu_step.log" ] && { echo "==== gpu_step.log (results)"
  grep -E "^(===|device|rmsnorm|bf16 GEMM|boostmpi step|attention:|pytorch eager|host:|profile: [^ ]*[0-9]+ device|profile: host waits)|Error|error" \
    "$OUT/gpu_step.log" | tail -n 40; }
[ -f "$OUT/attention.md" ] && { echo "==== attention.md"; cat "$OUT/attention.md"; }
exit 0
