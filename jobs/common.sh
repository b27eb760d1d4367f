# shellcheck shell=bash
# The job body shared by jobs/local.sh, jobs/frontier.sbatch, jobs/perlmutter.sbatch, jobs/polaris.pbs
# and the real-Slurm test (tests/slurm/run_slurm_test.sh): one attempt of a resume-until-done chain.
#
# A script sets these, sources this file and calls `boostmpi_job`:
#   CONFIG        the TOML configuration
#   RUN_DIR       the run directory (passed as --set train.run_dir, so the checkpoints and DONE are found)
#   TP PP NRANKS  the layout: tensor and pipeline sizes and the number of ranks; dp = NRANKS / (TP * PP)
#   PY            the Python in which boostmpi is installed
#   LAUNCH        array: the launcher and its options, up to the program (srun ..., mpiexec ...)
#   EXTRA_SETS    array (optional): more section.key=value overrides
#   RESUBMIT      array (optional): the command that queues the next job of the chain; empty = none
#   STOP_SIGNAL   (optional) the signal forwarded to the launcher when the job is told to stop (default USR1)
#   STOP_AFTER_S  (optional) seconds after the start at which the job tells the ranks to stop by itself,
#                 for schedulers that give no warning before the time limit (PBS)
# and may set BOOSTMPI_DRY_RUN=1 to print the commands (launch, resubmit, env) instead of running them.
# Helpers for the site scripts: boostmpi_site_launcher (the site's srun/mpiexec, never the venv's),
# boostmpi_require_net (NCCL_NET on multi-node runs), boostmpi_env_summary.
#
# One attempt: exit at once if RUN_DIR/DONE exists; otherwise train (resuming from the latest
# complete checkpoint, which `boostmpi train` does by itself). SIGTERM, SIGUSR1 or SIGINT to this
# shell is forwarded to the launcher as STOP_SIGNAL: the ranks checkpoint at the next step boundary
# and exit 0. Afterwards the run is finished when its newest complete checkpoint is at
# train.steps: then DONE is written; if it stopped early but made progress, RESUBMIT queues the
# next attempt; a failure (non-zero status) or an attempt without progress ends the chain.

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

# boostmpi_require_net NNODES NAME: on more than one node, NCCL/RCCL must use the network NAME
# (the name its Slingshot plugin registers): NCCL_NET makes a missing or broken plugin an error at
# start-up instead of a silent fall-back to TCP sockets. One node needs no network plugin.
boostmpi_require_net() {
  if [ "$1" -gt 1 ]; then
    export NCCL_NET="$2"
  fi
}

# boostmpi_env_summary: the job's communication and threading settings, one NAME=value word each.
boostmpi_env_summary() {
  local name
  local -a words=()
  for name in $(compgen -e | LC_ALL=C sort); do
    case "$name" in
      NCCL_*|FI_*|MPICH_*|HSA_*|ROCM_HOME|CUPY_*|OMP_NUM_THREADS|OPENBLAS_NUM_THREADS|BOOSTMPI_GPU_MAP_VAR|LD_LIBRARY_PATH)
        words+=("$name=${!name}") ;;
    esac
  done
  boostmpi_quote ${words[@]+"${words[@]}"}
}

# boostmpi_layout: sets DP from NRANKS, TP and PP, or stops with status 2.
boostmpi_layout() {
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

# boostmpi_progress: prints "<step of the newest complete checkpoint, 0 if none> <train.steps, 0 if never started>".
boostmpi_progress() {
  "$PY" - "$RUN_DIR" <<'EOF'
import os
import sys
import tomllib

from boostmpi.train.checkpoint import find_latest, read_state

run_dir = sys.argv[1]
latest = find_latest(run_dir)
try:  # the resolved configuration of the last attempt, written by the trainer
    with open(os.path.join(run_dir, "config.toml"), "rb") as f:
        steps = tomllib.load(f)["train"]["steps"]
except OSError:
    steps = 0
print(read_state(latest)["step"] if latest else 0, steps)
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
  local before after steps status
  read -r before steps < <(boostmpi_progress) || { echo "error: cannot read the progress of $RUN_DIR with $PY" >&2; return 1; }
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

  read -r after steps < <(boostmpi_progress) || { echo "error: cannot read the progress of $RUN_DIR" >&2; return 1; }
  # 75: the trainer stopped early on a signal and wrote a checkpoint (0: it finished train.steps)
  if [ "$status" -ne 0 ] && [ "$status" -ne 75 ]; then
    echo "job: training failed with status $status at checkpoint step $after; the chain stops here" \
         "(fix the cause and submit again: it resumes from $RUN_DIR/checkpoints/latest)" >&2
    return "$status"
  fi
  if [ "$steps" -gt 0 ] && [ "$after" -ge "$steps" ]; then
    printf 'finished step %s of %s on %s (job %s)\n' "$after" "$steps" "$(date '+%F %T')" \
      "${SLURM_JOB_ID:-${PBS_JOBID:-local}}" > "$RUN_DIR/DONE"
    echo "job: finished all $steps steps; wrote $RUN_DIR/DONE"
    return 0
  fi
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
