#!/usr/bin/env bash
# Quick start on one machine: sets up .venv (first run only), then trains configs/local.toml
# under mpiexec with the same job body as the cluster scripts (jobs/common.sh).
#   bash jobs/local.sh                      # 2 ranks, tp=2 (btp)
#   NPROC=1 bash jobs/local.sh              # one process
#   NPROC=4 TP=2 bash jobs/local.sh         # tp=2 x dp=2
# Ctrl-C (or SIGTERM) writes a checkpoint at the next step and stops; run it again to resume.
# A finished run leaves RUN_DIR/DONE; remove it (or set RUN_DIR) to train again.
set -uo pipefail

# ---- layout and configuration
NPROC="${NPROC:-2}"                           # MPI ranks
TP="${TP:-}"                                  # tensor-parallel size (dp = NPROC / (TP * PP)); unset: the config's
SITE_TP=$((NPROC >= 2 ? 2 : 1))               # [parallel] tp, else this
PP="${PP:-}"                                  # pipeline stages; unset: the config's [parallel] pp, else 1
TP_MODE="${TP_MODE:-btp}"                     # btp (bottleneck-aware) or vanilla
CONFIG="${CONFIG:-configs/local.toml}"
RUN_DIR="${RUN_DIR:-runs/local}"
TIMEOUT_S="${TIMEOUT_S:-7200}"                # every mpiexec runs under timeout

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
# shellcheck source=jobs/setup_env.sh
source jobs/setup_env.sh || exit 1
# shellcheck source=jobs/common.sh
source jobs/common.sh || exit 1

# ---- environment: BLAS/OpenMP threads per rank are left to boostmpi, which gives each rank the
# machine's cores divided by the ranks (MPI_LOCALNRANKS) before NumPy loads; a value set here wins

if [ "${BOOSTMPI_DRY_RUN:-0}" = 1 ]; then
  PY="${BOOSTMPI_VENV:-$PWD/.venv}/bin/python"
else
  setup_venv plot,mpich                       # [mpich]: MPICH from PyPI, for one machine only
fi
MPIEXEC="$(boostmpi_mpiexec)" || exit 2       # the mpiexec of the MPI that mpi4py uses

NRANKS="$NPROC"
EXTRA_SETS=("parallel.tp_mode=$TP_MODE")
LAUNCH=(timeout "$TIMEOUT_S" "$MPIEXEC" -n "$NRANKS")
RESUBMIT=()
STOP_SIGNAL=TERM                              # `timeout` forwards SIGTERM to mpiexec, which forwards it to the ranks
boostmpi_job
status=$?

if [ "${BOOSTMPI_DRY_RUN:-0}" != 1 ]; then
  echo
  echo "results:"
  echo "  run directory  $RUN_DIR (resolved configuration: $RUN_DIR/config.toml)"
  echo "  metrics        $RUN_DIR/metrics.jsonl (one JSON object per step)"
  echo "  checkpoints    $RUN_DIR/checkpoints/ (newest complete one: $RUN_DIR/checkpoints/latest)"
  echo "next:"
  echo "  $PY -m boostmpi inspect $RUN_DIR"
  echo "  $PY -m boostmpi generate $RUN_DIR --prompt 'def main('"
  echo "  $PY -m boostmpi plot $RUN_DIR --out $RUN_DIR/curves.png"
fi
exit "$status"
