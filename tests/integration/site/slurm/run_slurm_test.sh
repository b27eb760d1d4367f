#!/usr/bin/env bash
# The real-Slurm test. Starts a one-node Slurm cluster on this machine (Debian's slurmctld, slurmd
# and munge; proctrack/linuxproc, task/none, MpiDefault=pmi2) and submits a 2-rank job whose body
# is the production one (jobs/common.sh, launched by the site's srun found by path, as
# `srun --mpi=pmi2 --overcommit`). The ranks run on the system MPI, as on a cluster: the venv of
# tests/integration/site/sysmpi (boostmpi without the [mpich] extra, mpi4py built against Debian's MPICH). The job
# must train, be preempted by a signal to its batch shell (like `--signal=B:USR1@120`), checkpoint,
# requeue itself, resume and finish (DONE). Then it stops the daemons it started.
# Needs root, and Slurm and Debian's MPICH installed or apt-get able to install them; otherwise it
# prints why it skips and exits 0. Exit status 1 when a check fails.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../../.." && pwd)"
STEPS=200          # the tiny model; the signal comes after 10 steps, well before the end
RANKS=2            # one per core: Debian's MPICH polls while it waits; 4 ranks on 2 cores took 30 s for 300 all-reduces (PyPI wheel: 3 s)
EVERY=50           # periodic checkpoints; the preemption one falls between them
WAIT_S=300         # longest wait for any one stage (a busy machine)

skip() { echo "skipped: $*"; exit 0; }

[ "$(id -u)" -eq 0 ] || skip "the Slurm test needs root (to install and run slurmctld, slurmd and munged)"
cd "$REPO" || exit 1
# shellcheck source=tests/integration/site/sysmpi/system_mpi.sh
source tests/integration/site/sysmpi/system_mpi.sh
system_mpi_venv || exit $(($? == 1 ? 0 : 1))   # sets PY: the system-MPI venv
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null ||
   ! command -v sbatch >/dev/null; then
  command -v apt-get >/dev/null || skip "Slurm is not installed and there is no apt-get to install it"
  echo "installing slurmctld slurmd munge slurm-client with apt-get"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
         slurmctld slurmd munge slurm-client; } >/tmp/boostmpi-slurm-apt.log 2>&1; then
    tail -5 /tmp/boostmpi-slurm-apt.log
    skip "apt-get could not install slurmctld, slurmd and munge (log above; offline?)"
  fi
fi

WORK="$(mktemp -d /tmp/boostmpi-slurm.XXXXXX)"
RUN_DIR="$WORK/run"
JOB_OUT="$WORK/job.out"
mkdir -p "$WORK/munge" "$WORK/state" "$WORK/spool"
export SLURM_CONF="$WORK/slurm.conf"

show_logs() {
  local f
  for f in "$JOB_OUT" "$WORK/slurmctld.log" "$WORK/slurmd.log"; do
    [ -f "$f" ] && { echo "---- last lines of $f"; tail -25 "$f"; }
  done
}

stop_daemons() {  # only the processes this script started, by the ids in their pid files
  [ -n "${JOB_ID:-}" ] && scancel --quiet "$JOB_ID" 2>/dev/null
  local pidfile pid t
  for pidfile in "$WORK/slurmd.pid" "$WORK/slurmctld.pid" "$WORK/munge/munged.pid"; do
    pid="$(cat "$pidfile" 2>/dev/null)" || continue
    [ -n "$pid" ] || continue
    kill "$pid" 2>/dev/null
    for t in $(seq 50); do  # let it write its state and exit before its folder is removed
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.2
    done
  done
}

finish() {
  local status=$?
  stop_daemons
  if [ "$status" -eq 0 ]; then rm -rf "$WORK"; else echo "(files kept in $WORK)"; fi
}
trap finish EXIT

fail() { echo "FAILED: $*"; show_logs; exit 1; }

# wait_for SECONDS WHAT COMMAND...: poll COMMAND until it succeeds, or fail naming WHAT.
wait_for() {
  local seconds="$1" what="$2" t=0
  shift 2
  until "$@"; do
    sleep 0.5
    t=$((t + 1))
    [ "$t" -le $((2 * seconds)) ] || fail "timed out after ${seconds} s waiting for $what"
  done
}

# ---- the cluster
port=$((20000 + RANDOM % 20000))
sed -e "s|@HOST@|$(hostname -s)|g" -e "s|@CPUS@|$(nproc)|g" -e "s|@DIR@|$WORK|g" \
    -e "s|@CTLD_PORT@|$port|g" -e "s|@SLURMD_PORT@|$((port + 1))|g" \
    "$REPO/tests/integration/site/slurm/slurm.conf.in" > "$SLURM_CONF"
if [ -f /etc/munge/munge.key ]; then
  cp /etc/munge/munge.key "$WORK/munge/munge.key"
else
  dd if=/dev/urandom of="$WORK/munge/munge.key" bs=1024 count=1 status=none
fi
chmod 700 "$WORK/munge" && chmod 400 "$WORK/munge/munge.key"
munged --force --socket="$WORK/munge/munge.socket" --key-file="$WORK/munge/munge.key" \
       --pid-file="$WORK/munge/munged.pid" --log-file="$WORK/munge/munged.log" \
       --seed-file="$WORK/munge/munged.seed" || fail "munged did not start"
slurmctld -c -f "$SLURM_CONF" || fail "slurmctld did not start"
slurmd -f "$SLURM_CONF" || fail "slurmd did not start"
node_idle() { [ "$(sinfo -h -o %t 2>/dev/null)" = idle ]; }
wait_for 30 "the Slurm node to become idle" node_idle
echo "[${SECONDS} s] slurm cluster up: $(sinfo -h -o '%P %D %t %c')"

# ---- the job: RANKS ranks on this machine, the production job body
cat > "$WORK/job.sbatch" <<EOF
#!/bin/bash
#SBATCH -J boostmpi-slurm-test
#SBATCH -n $RANKS
#SBATCH --overcommit
#SBATCH -t 10
#SBATCH --signal=B:USR1@60
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH -o $JOB_OUT
set -uo pipefail
cd "$REPO" || exit 1
source jobs/common.sh || exit 1
boostmpi_require_job SLURM_JOB_ID "sbatch"
CONFIG=configs/tiny.toml
RUN_DIR="$RUN_DIR"
TP=2 PP=1 NRANKS=$RANKS
PY="$PY"
EXTRA_SETS=(train.steps=$STEPS checkpoint.every=$EVERY)
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 PYTHONPATH="$REPO"
SRUN="\$(boostmpi_site_launcher srun)" || exit 2
LAUNCH=("\$SRUN" --mpi=pmi2 --overcommit -n "\$NRANKS" --kill-on-bad-exit=1)
RESUBMIT=(scontrol requeue "\$SLURM_JOB_ID")
STOP_SIGNAL=USR1
boostmpi_job
EOF
JOB_ID="$(sbatch --parsable "$WORK/job.sbatch")" || fail "sbatch refused the job"
echo "[${SECONDS} s] submitted job $JOB_ID"

metric_rows() { [ -f "$RUN_DIR/metrics.jsonl" ] && wc -l < "$RUN_DIR/metrics.jsonl" || echo 0; }
trained_a_little() { [ "$(metric_rows)" -ge 10 ]; }
wait_for "$WAIT_S" "the job to train 10 steps" trained_a_little
echo "[${SECONDS} s] training ($(metric_rows) steps): preempting with SIGUSR1 to the batch shell"
scancel --batch --signal=USR1 "$JOB_ID" || fail "scancel --batch --signal=USR1 failed"

finished() { [ -f "$RUN_DIR/DONE" ]; }
wait_for "$WAIT_S" "the requeued job to finish (DONE)" finished
echo "[${SECONDS} s] DONE written"
job_completed() { scontrol show job "$JOB_ID" | grep -q "JobState=COMPLETED"; }
wait_for 30 "job $JOB_ID to complete" job_completed

# ---- checks
grep -q "stopped by signal at step" "$JOB_OUT" || fail "the ranks did not stop on the signal"
grep -q "queueing the next attempt" "$JOB_OUT" || fail "the job did not requeue itself"
grep -q "resumed from $RUN_DIR/checkpoints/step_" "$JOB_OUT" || fail "the second attempt did not resume from a checkpoint"
grep -q "finished all $STEPS steps" "$JOB_OUT" || fail "the second attempt did not finish"
mpi_line="$(grep -m1 '^mpi: ' "$JOB_OUT")" || fail "no start-up line 'mpi: ...' in the job's output"
case "$mpi_line" in
  *"/libmpich.so"*"$RANKS rank(s) on 1 node(s)"*) ;;
  *) fail "the ranks did not run on Debian's MPICH under srun: $mpi_line" ;;
esac
restarts="$(scontrol show job "$JOB_ID" | grep -o 'Restarts=[0-9]*')"
[ "$restarts" = "Restarts=1" ] || fail "expected one requeue, scontrol says $restarts"
"$PY" - "$RUN_DIR/metrics.jsonl" "$STEPS" <<'EOF' || fail "metrics.jsonl does not hold each step once"
import json, sys
steps = [json.loads(line)["step"] for line in open(sys.argv[1]) if line.strip()]
sys.exit(0 if steps == list(range(1, int(sys.argv[2]) + 1)) else 1)
EOF
stopped_at="$(grep -o 'stopped by signal at step [0-9]*' "$JOB_OUT" | grep -o '[0-9]*$' | head -1)"
echo "slurm test passed in ${SECONDS} s: job $JOB_ID trained on the system MPI ($mpi_line), stopped on SIGUSR1" \
     "at step $stopped_at with a checkpoint, requeued itself, resumed and finished all $STEPS steps"
