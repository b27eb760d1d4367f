# shellcheck shell=bash
# The job body shared by jobs/local.sh, jobs/frontier.sbatch, jobs/perlmutter.sbatch, jobs/polaris.pbs
# and the real-Slurm test (tests/integration/site/slurm/run_slurm_test.sh): one attempt of a resume-until-done chain.
#
# A script sets these, sources this file and calls `boostmpi_job`:
#   CONFIG        the TOML configuration
#   RUN_DIR       the run directory (passed as --set train.run_dir, so the checkpoints and DONE are found)
#   TP PP NRANKS  the layout: tensor and pipeline sizes and the number of ranks; dp = NRANKS / (TP * PP).
#                 An empty TP or PP takes the config's [parallel] tp / pp (so configs/paper_*.toml run
#                 with their own layouts), else SITE_TP (the site's choice) / 1
#   PY            the Python in which boostmpi is installed
#   LAUNCH        array: the launcher and its options, up to the program (srun ..., mpiexec ...)
#   EXTRA_SETS    array (optional): more section.key=value overrides
#   RESUBMIT      array (optional): the command that queues the next job of the chain; empty = none
#   STOP_SIGNAL   (optional) the signal forwarded to the launcher when the job is told to stop (default USR1)
#   STOP_AFTER_S  (optional) seconds after the start at which the job tells the ranks to stop by itself,
#                 for schedulers that give no warning before the time limit (PBS)
# and may set BOOSTMPI_DRY_RUN=1 to print the commands (launch, resubmit, env) instead of running them.
# Helpers for the site scripts: boostmpi_site_launcher (the site's srun/mpiexec, never the venv's),
# boostmpi_network_plugin (NCCL_NET on multi-node runs, and the plugin it will load, checked),
# boostmpi_compile_kernels (the GPU kernels compiled once into a per-job cache before the ranks start),
# boostmpi_run_dir_filesystem (where RUN_DIR lives, its Lustre layout), boostmpi_env_summary.
#
# One attempt: exit at once if RUN_DIR/DONE exists; otherwise train (resuming from the latest
# complete checkpoint, which `boostmpi train` does by itself). SIGTERM, SIGUSR1 or SIGINT to this
# shell is forwarded to the launcher as STOP_SIGNAL: the ranks checkpoint at the next step boundary
# and exit. Afterwards the run is finished only when this attempt's trainer wrote the run's final record
# (RUN_DIR/final.json, after the last step and its checkpoint; removed before the launch, so an earlier
# attempt's never counts): then DONE is written. It stopped on a signal when the trainer left its marker file
# (RUN_DIR/STOPPED_ON_SIGNAL, written once that checkpoint is complete), whatever status the
# launcher returned (srun --kill-on-bad-exit may give 128 + the signal): if it made progress,
# RESUBMIT queues the next attempt. Anything else (a failure, an attempt without progress) ends the chain.

# boostmpi_require_job VAR HOW: stop with status 2 unless VAR is set (we are inside a batch job).
boostmpi_require_job() {
  if [ -z "${!1:-}" ]; then
    echo "error: $1 is not set: this script runs inside a batch job; submit it with: $2" >&2
    exit 2
  fi
}

# boostmpi_site_launcher NAME [PART]: prints the absolute path of the site's launcher NAME (srun,
# PALS mpiexec) from PATH, never the one in the venv of $PY (a PyPI MPICH's Hydra, which rejects
# the site's options and runs the wrong MPI); with PART, the first NAME whose path contains PART
# (/pals/: PALS's mpiexec, not a conda environment's). Stops with status 2 when there is none.
boostmpi_site_launcher() {
  local name="$1" part="${2:-}" dir venv_bin real
  venv_bin="$(cd "$(dirname "$PY")" 2>/dev/null && pwd -P)"
  local -a dirs
  IFS=: read -r -a dirs <<< "$PATH"
  for dir in "${dirs[@]}"; do
    [ -n "$dir" ] && [ -x "$dir/$name" ] && [ ! -d "$dir/$name" ] || continue
    real="$(cd "$dir" && pwd -P)"
    [ "$real" = "$venv_bin" ] && continue
    case "$real/$name" in *"$part"*) ;; *) continue ;; esac
    printf '%s\n' "$real/$name"
    return 0
  done
  echo "error: no $name${part:+ with $part in its path} on PATH outside ${venv_bin:-the venv}:" \
       "load the site's modules first (the job script does)" >&2
  exit 2
}

# boostmpi_network_plugin NNODES NAME: the job's first line about NCCL/RCCL's network plugin. It
# lists the plugin libraries the loader will find (NCCL_NET_PLUGIN, LD_LIBRARY_PATH) and opens each,
# so a plugin whose own libraries are missing is caught here, not by the first collective. On more
# than one node a plugin is required: without one the job stops (status 2) with one line; with one,
# NCCL_NET=NAME (the name the plugin registers) makes NCCL/RCCL fail at start-up instead of falling
# back to TCP sockets. One node needs no plugin (the network is not used).
boostmpi_network_plugin() {
  local nodes="$1" name="$2" found
  if [ "${BOOSTMPI_DRY_RUN:-0}" = 1 ]; then  # nothing is loaded in a dry run: only the setting
    [ "$nodes" -gt 1 ] && export NCCL_NET="$name"
    return 0
  fi
  found="$(PYTHONPATH="${REPO:-$PWD}${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c '
import ctypes, os, sys
from boostmpi.parallel.startup import net_plugins
for path in net_plugins(os.environ):
    try:
        ctypes.CDLL(path)
    except OSError as exc:
        print(f"error: the network plugin {path} does not load: {exc}", file=sys.stderr)
        sys.exit(2)
    print(os.path.realpath(path))')" || exit 2
  found="$(printf '%s' "$found" | tr '\n' ' ')"
  if [ "$nodes" -gt 1 ]; then
    if [ -z "$found" ]; then
      echo "error: no NCCL/RCCL network plugin (lib*ccl-net*.so) on LD_LIBRARY_PATH or NCCL_NET_PLUGIN for this $nodes-node job: between nodes NCCL would fall back to TCP sockets; load the site's plugin module (see the job script)" >&2
      exit 2
    fi
    export NCCL_NET="$name"
    echo "job: network plugin: ${found% } (NCCL_NET=$NCCL_NET, required on $nodes nodes)"
  else
    echo "job: network plugin: ${found:-none found} (one node: not used)"
  fi
}

# boostmpi_compile_kernels: with train.device=gpu, compile every GPU kernel once, here on the batch
# node, into a cache of this job (CUPY_CACHE_DIR under RUN_DIR, on the parallel file system the
# ranks of every node read), before any rank starts: the ranks then load the compiled kernels
# instead of each compiling the same sources at once (OLCF "Installing CuPy": CuPy caches compiled
# kernels in CUPY_CACHE_DIR; its default $HOME/.cupy is not reachable from compute nodes).
boostmpi_compile_kernels() {
  local seconds
  export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-$RUN_DIR/.kernel-cache/job-${SLURM_JOB_ID:-${PBS_JOBID:-$$}}}"
  mkdir -p "$CUPY_CACHE_DIR" || { echo "error: cannot create the kernel cache $CUPY_CACHE_DIR" >&2; exit 2; }
  seconds="$(PYTHONPATH="${REPO:-$PWD}${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c '
import time
t0 = time.perf_counter()
from boostmpi.gpu import kernels
kernels.compile_all(0)  # the loader the ranks use, for GPU 0 of this node
print(f"{time.perf_counter() - t0:.1f}")')" ||
    { echo "error: compiling the GPU kernels on $(hostname) failed (the message above); no rank was started" >&2; exit 1; }
  echo "job: GPU kernels compiled once into $CUPY_CACHE_DIR in $seconds s, before the ranks start"
}

# boostmpi_run_dir_filesystem PREFIX WHY: where RUN_DIR lives (its file system type and, on Lustre,
# its stripe layout, which files created in it inherit); a warning when it is not below PREFIX, the
# file system the centre names for job output (WHY says which page).
boostmpi_run_dir_filesystem() {
  local prefix="$1" why="$2" abs fstype layout=""
  mkdir -p "$RUN_DIR" 2>/dev/null
  abs="$(cd "$RUN_DIR" 2>/dev/null && pwd -P)" || abs="$RUN_DIR"
  fstype="$(stat -f -c %T "$abs" 2>/dev/null || echo unknown)"
  if command -v lfs >/dev/null && [ "$fstype" = lustre ]; then
    layout=" | $(lfs getstripe -d "$abs" 2>&1 | tr -s ' \n' ' ')"
  fi
  echo "job: run directory $abs on $fstype$layout"
  case "$abs/" in
    "$prefix"/*) ;;
    *) echo "job: warning: $RUN_DIR is not below $prefix, where $why" ;;
  esac
}

# boostmpi_env_summary: the job's communication and threading settings, one NAME=value word each.
boostmpi_env_summary() {
  local name
  local -a words=()
  for name in $(compgen -e | LC_ALL=C sort); do
    case "$name" in
      NCCL_*|FI_*|MPICH_*|HSA_*|ROCM_HOME|CUPY_*|CUDA_DEVICE_ORDER|OMP_NUM_THREADS|OPENBLAS_NUM_THREADS|BOOSTMPI_GPU_MAP_VAR|LD_LIBRARY_PATH)
        words+=("$name=${!name}") ;;
    esac
  done
  boostmpi_quote ${words[@]+"${words[@]}"}
}

# boostmpi_config_int FILE SECTION KEY DEFAULT: the integer `KEY = N` of [SECTION] in the TOML file
# FILE (a plain line, as configs/ write it), else DEFAULT.
boostmpi_config_int() {
  local value
  value="$(awk -v want="[$2]" -v key="$3" '
    { line = $0; sub(/#.*/, "", line); gsub(/[[:space:]]/, "", line) }
    line ~ /^\[/ { section = line; next }
    section == want && index(line, key "=") == 1 { print substr(line, length(key) + 2) }' "$1" 2>/dev/null | tail -1)"
  if [[ "$value" =~ ^[0-9]+$ ]]; then echo "$value"; else echo "$4"; fi
}

# boostmpi_layout: sets TP and PP where empty (the config's, else SITE_TP and 1), then DP from NRANKS,
# TP and PP, or stops with status 2.
boostmpi_layout() {
  TP="${TP:-$(boostmpi_config_int "$CONFIG" parallel tp "${SITE_TP:-1}")}"
  PP="${PP:-$(boostmpi_config_int "$CONFIG" parallel pp 1)}"
  if [ "$NRANKS" -lt 1 ] || [ $((NRANKS % (TP * PP))) -ne 0 ]; then
    echo "error: $NRANKS ranks cannot be split into tp=$TP x pp=$PP x dp (tp * pp must divide the ranks)" >&2
    exit 2
  fi
  DP=$((NRANKS / (TP * PP)))
}

# boostmpi_train_command: sets the array TRAIN, the program each rank runs.
boostmpi_train_command() {
  boostmpi_layout
  TRAIN=("$PY" -m boostmpi train --config "$CONFIG"
         --set "parallel.tp=$TP" --set "parallel.pp=$PP" --set "parallel.dp=$DP" --set "train.run_dir=$RUN_DIR")
  local kv
  for kv in ${EXTRA_SETS[@]+"${EXTRA_SETS[@]}"}; do
    TRAIN+=(--set "$kv")
  done
}

# boostmpi_quote WORD...: the words as one line that a shell reads back as the same words.
boostmpi_quote() {
  [ $# -eq 0 ] && return 0
  local line
  printf -v line '%q ' "$@"
  printf '%s\n' "${line% }"
}

# boostmpi_progress: prints "<step of the newest complete checkpoint, 0 if none> <train.steps of the last
# attempt's config.toml, 0 if none (for messages only)> <the trainer's stopped-on-a-signal marker file>
# <the step of the run's final record when it says the run is finished, else -> <the final record file>".
boostmpi_progress() {
  "$PY" - "$RUN_DIR" <<'EOF'
import json
import os
import sys
import tomllib

from boostmpi.checkpoint import find_latest, read_state
from boostmpi.preemption import FINAL_RECORD, STOPPED_MARKER

run_dir = sys.argv[1]
latest = find_latest(run_dir)
try:  # the resolved configuration of the last attempt: named in messages, never what decides DONE
    with open(os.path.join(run_dir, "config.toml"), "rb") as f:
        steps = int(tomllib.load(f)["train"]["steps"])
except (OSError, ValueError, KeyError, TypeError):
    steps = 0
final = os.path.join(run_dir, FINAL_RECORD)
try:  # written by the trainer after the last step: the only sign that the run is finished
    with open(final) as f:
        record = json.load(f)
    finished = int(record["step"]) if int(record["step"]) >= int(record["steps"]) > 0 else "-"
except (OSError, ValueError, KeyError, TypeError):
    finished = "-"
print(read_state(latest)["step"] if latest else 0, steps, os.path.join(run_dir, STOPPED_MARKER), finished, final)
EOF
}

_boostmpi_forward_stop() {
  echo "job: received SIG$1; asking the ranks to checkpoint and stop (SIG$STOP_SIGNAL to the launcher)"
  kill -s "$STOP_SIGNAL" "$BOOSTMPI_LAUNCHER_PID" 2>/dev/null || true
}

boostmpi_job() {
  STOP_SIGNAL="${STOP_SIGNAL:-USR1}"
  boostmpi_train_command
  if [ "${BOOSTMPI_DRY_RUN:-0}" = 1 ]; then
    echo "launch: $(boostmpi_quote "${LAUNCH[@]}" "${TRAIN[@]}")"
    echo "resubmit: $(boostmpi_quote ${RESUBMIT[@]+"${RESUBMIT[@]}"})"
    echo "env: $(boostmpi_env_summary)"
    return 0
  fi
  if [ -f "$RUN_DIR/DONE" ]; then
    echo "job: $RUN_DIR/DONE exists: this run is finished, nothing to do (remove DONE or raise train.steps to go on)"
    return 0
  fi
  local before after steps status marker finished final
  read -r before steps marker finished final < <(boostmpi_progress) ||
    { echo "error: cannot read the progress of $RUN_DIR with $PY" >&2; return 1; }
  rm -f "$marker" "$final"   # what an earlier attempt left says nothing about this one
  echo "job: $(date '+%F %T') starting at checkpoint step $before: $(boostmpi_quote "${LAUNCH[@]}" "${TRAIN[@]}")"
  echo "job: environment: $(boostmpi_env_summary)"

  "${LAUNCH[@]}" "${TRAIN[@]}" &
  BOOSTMPI_LAUNCHER_PID=$!
  local sig timer=""
  for sig in TERM USR1 INT; do
    # shellcheck disable=SC2064  # the signal name is fixed now, on purpose
    trap "_boostmpi_forward_stop $sig" "$sig"
  done
  if [ -n "${STOP_AFTER_S:-}" ]; then
    echo "job: the ranks will be asked to stop after ${STOP_AFTER_S} s"
    (sleep "$STOP_AFTER_S" && kill -s USR1 $$) &
    timer=$!
  fi
  # `wait` returns early when a trapped signal arrives: keep waiting for the launcher itself
  while kill -0 "$BOOSTMPI_LAUNCHER_PID" 2>/dev/null; do
    wait "$BOOSTMPI_LAUNCHER_PID"
  done
  wait "$BOOSTMPI_LAUNCHER_PID"
  status=$?
  trap - TERM USR1 INT
  [ -n "$timer" ] && kill "$timer" 2>/dev/null

  read -r after steps marker finished final < <(boostmpi_progress) ||
    { echo "error: cannot read the progress of $RUN_DIR" >&2; return 1; }
  if [ "$finished" != - ]; then   # this attempt's trainer recorded the last step as done (never an older record)
    printf 'finished step %s of %s on %s (job %s)\n' "$finished" "$finished" "$(date '+%F %T')" \
      "${SLURM_JOB_ID:-${PBS_JOBID:-local}}" > "$RUN_DIR/DONE"
    echo "job: finished all $finished steps (the run's final record $final); wrote $RUN_DIR/DONE"
    return 0
  fi
  if [ ! -f "$marker" ]; then
    echo "job: training ended with status $status at checkpoint step $after without stopping on a signal" \
         "(no $marker); the chain stops here (fix the cause and submit again: it resumes from" \
         "$RUN_DIR/checkpoints/latest)" >&2
    [ "$status" -ne 0 ] && return "$status"
    return 1
  fi
  echo "job: the ranks stopped on a signal with a checkpoint ($(cat "$marker" 2>/dev/null); launcher status $status)"
  if [ "$after" -le "$before" ]; then
    echo "job: stopped at step $after of $steps without progress (checkpoint step was $before); the chain stops here" >&2
    return 1
  fi
  if [ -z "${RESUBMIT[*]:-}" ]; then
    echo "job: stopped at step $after of $steps; run it again to resume from $RUN_DIR/checkpoints/latest"
    return 0
  fi
  echo "job: stopped at step $after of $steps; queueing the next attempt: $(boostmpi_quote "${RESUBMIT[@]}")"
  "${RESUBMIT[@]}"
}
