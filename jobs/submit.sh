#!/bin/bash
# Submit a site's job after checking what the scheduler would only find later, or the job at its
# start: the project account, the queue and the node count and walltime against the centre's
# table (jobs/sites.sh), the modules (the same environment function the job runs, in a subshell),
# and the environment built by jobs/setup_<site>.sh. Each problem is one line, exit 2, and nothing
# is submitted. From the repository root, on a login node:
#
#   bash jobs/submit.sh frontier   -A <project> [-N NODES] [-t HH:MM:SS] [-p batch|extended]
#   bash jobs/submit.sh perlmutter -A <project>_g [-N NODES] [-t HH:MM:SS] [-q regular]
#   bash jobs/submit.sh polaris    -A <project> [-N NODES] [-t HH:MM:SS] [-q QUEUE]
#
# Unset options take the job script's header (#SBATCH / #PBS). --check stops after the checks.
# The environment of the submission (TP, PP, CONFIG, RUN_DIR, COMM, BOOSTMPI_VENV...) goes to the job:
# sbatch passes it on by default; for qsub it is given with -v.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
# shellcheck source=jobs/sites.sh
source jobs/sites.sh

fail() { echo "error: $*" >&2; exit 2; }

site="${1:-}"
case "$site" in
  frontier|perlmutter) script="jobs/$site.sbatch" ;;
  polaris) script="jobs/polaris.pbs" ;;
  *) fail "usage: bash jobs/submit.sh frontier|perlmutter|polaris -A <project> [-N NODES] [-t HH:MM:SS] [-q QUEUE] [--check]" ;;
esac
shift
account="" nodes="" walltime="" queue="" partition="" check_only=0
while [ $# -gt 0 ]; do
  case "$1" in
    -A|--account) account="${2:-}"; shift ;;
    -N|--nodes) nodes="${2:-}"; shift ;;
    -t|--time) walltime="${2:-}"; shift ;;
    -q|--qos) queue="${2:-}"; shift ;;
    -p|--partition) partition="${2:-}"; shift ;;
    --check) check_only=1 ;;
    *) fail "unknown option '$1' (bash jobs/submit.sh $site -A <project> [-N NODES] [-t HH:MM:SS] [-q QUEUE] [--check])" ;;
  esac
  shift
done

# header values of the job script: directive NAME (e.g. "#SBATCH -N")
header() { sed -n "s/^$1[ =]//p" "$script" | head -1; }
if [ "$site" = polaris ]; then
  nodes="${nodes:-$(header '#PBS -l select' | sed 's/:.*//')}"
  walltime="${walltime:-$(header '#PBS -l walltime')}"
  queue="${queue:-$(header '#PBS -q')}"
else
  nodes="${nodes:-$(header '#SBATCH -N')}"
  walltime="${walltime:-$(header '#SBATCH -t')}"
  queue="${queue:-$(header '#SBATCH -q')}"
  partition="${partition:-$(header '#SBATCH -p')}"
fi

# ---- 1. the project account: the centres charge every job to one (no default is assumed)
[ -n "$account" ] || fail "no project account: add -A <project> (the allocation this job is charged to)"
[[ "$nodes" =~ ^[0-9]+$ ]] && [ "$nodes" -ge 1 ] || fail "the node count '$nodes' is not a positive number"
seconds="$(boostmpi_seconds "$walltime")" || exit 2

# ---- 2. the queue's range
case "$site" in
  frontier) problem="$(frontier_queue_problem "${partition:-batch}" "$queue" "$nodes" "$seconds")" ;;
  perlmutter) problem="$(perlmutter_queue_problem "$queue" "$nodes" "$seconds")" ;;
  polaris) problem="$(polaris_queue_problem "$queue" "$nodes" "$seconds")" ;;
esac
[ -z "$problem" ] || fail "$problem"

# ---- 3. the modules: the job's own environment function, in a subshell, its last complaint shown
# shellcheck source=/dev/null
modules_out="$( (source "jobs/setup_$site.sh" && "${site}_environment") 2>&1 >/dev/null)" ||
  fail "the $site environment does not load: $(printf '%s\n' "$modules_out" | grep -v '^[[:space:]]*$' | tail -1)"

# ---- 4. the environment of jobs/setup_<site>.sh
venv="${BOOSTMPI_VENV:-$PWD/.venv-$site}"
[ -x "$venv/bin/python" ] || fail "no environment at $venv: run bash jobs/setup_$site.sh on a login node first"

if [ "$site" = polaris ]; then
  passed="TP=${TP:-},PP=${PP:-},CONFIG=${CONFIG:-configs/cola_d1024.toml},RUN_DIR=${RUN_DIR:-runs/polaris-cola_d1024},COMM=${COMM:-nccl},RANKS_PER_NODE=${RANKS_PER_NODE:-4},BOOSTMPI_VENV=$venv"
  command=(qsub -A "$account" -q "$queue" -l "select=$nodes:system=polaris" -l "walltime=$walltime" -v "$passed" "$script")
else
  command=(sbatch -A "$account" -N "$nodes" -t "$walltime" ${partition:+-p "$partition"} ${queue:+-q "$queue"} "$script")
fi
echo "checked: account $account, $nodes node(s) for $walltime in ${queue:-$partition}, modules load, environment $venv"
if [ "$check_only" = 1 ]; then
  echo "would run: ${command[*]}"
  exit 0
fi
echo "submitting: ${command[*]}"
exec "${command[@]}"
