# shellcheck shell=bash
# The centres' queue rules, written once: sourced by jobs/submit.sh (before anything is submitted)
# and by jobs/polaris.pbs (a job that PBS routed or that was submitted by hand checks itself again).
#
#   boostmpi_seconds TIME                        TIME (HH:MM:SS, H:MM, MM, D-HH:MM:SS) in seconds; status 2 if unreadable
#   frontier_queue_problem PARTITION QOS NODES SECONDS
#   perlmutter_queue_problem QOS NODES SECONDS
#   polaris_queue_problem QUEUE NODES SECONDS    each prints why the centre refuses that job (one line), or nothing

boostmpi_seconds() {
  local t="$1" days=0 h=0 m=0 s=0
  if [[ "$t" =~ ^([0-9]+)-(.*)$ ]]; then
    days="${BASH_REMATCH[1]}"
    t="${BASH_REMATCH[2]}"
  fi
  if [[ "$t" =~ ^([0-9]+):([0-9]+):([0-9]+)$ ]]; then
    h="${BASH_REMATCH[1]}" m="${BASH_REMATCH[2]}" s="${BASH_REMATCH[3]}"
  elif [[ "$t" =~ ^([0-9]+):([0-9]+)$ ]]; then
    if [ "$days" -gt 0 ]; then h="${BASH_REMATCH[1]}" m="${BASH_REMATCH[2]}"; else m="${BASH_REMATCH[1]}" s="${BASH_REMATCH[2]}"; fi
  elif [[ "$t" =~ ^([0-9]+)$ ]]; then
    if [ "$days" -gt 0 ]; then h="$t"; else m="$t"; fi
  else
    echo "error: cannot read the time '$1' (HH:MM:SS)" >&2
    return 2
  fi
  echo $((10#$days * 86400 + 10#$h * 3600 + 10#$m * 60 + 10#$s))
}

_boostmpi_limits_problem() {  # QUEUE MIN MAX HOURS NODES SECONDS [NOTE]
  local queue="$1" min="$2" max="$3" hours="$4" nodes="$5" seconds="$6" note="${7:-}"
  if [ "$nodes" -lt "$min" ] || [ "$nodes" -gt "$max" ] || [ "$seconds" -gt $((hours * 3600)) ] || [ "$seconds" -lt 300 ]; then
    echo "queue $queue takes $min-$max nodes for 5 min to $hours h${note:+ ($note)}, not $nodes nodes for $((seconds / 60)) min"
  fi
}

# OLCF Frontier User Guide, "Scheduling Policy": the batch partition's node-count bins (1-91 nodes
# <= 2 h, 92-183 <= 6 h, 184-9,472 <= 12 h); the extended partition (<= 64 nodes, <= 24 h); the debug
# QOS, where "production work and job chaining ... is prohibited".
frontier_queue_problem() {
  local partition="$1" qos="$2" nodes="$3" seconds="$4"
  if [ "$qos" = debug ]; then
    echo "the debug QOS prohibits job chaining, and this job requeues itself: submit without -q debug"
    return 0
  fi
  case "$partition" in
    batch)
      if [ "$nodes" -le 91 ]; then _boostmpi_limits_problem batch 1 91 2 "$nodes" "$seconds" "bin 5"
      elif [ "$nodes" -le 183 ]; then _boostmpi_limits_problem batch 92 183 6 "$nodes" "$seconds" "bin 4"
      else _boostmpi_limits_problem batch 184 9472 12 "$nodes" "$seconds" "bins 1-3"
      fi ;;
    extended) _boostmpi_limits_problem extended 1 64 24 "$nodes" "$seconds" ;;
    *) echo "partition $partition is not one of Frontier's (batch, extended)" ;;
  esac
}

# NERSC "QOSes and Charges" (docs.nersc.gov/jobs/policy/): only the page's introduction was readable
# here ("Most jobs are submitted to the 'regular' QOS"; debug is the default QOS), not its table of
# node and walltime limits per QOS: only the QOS is checked, no node count or time. Production runs go
# to regular; debug is for short tests and a chained job does not belong there.
perlmutter_queue_problem() {
  local qos="$1" nodes="$2"
  case "$qos" in
    regular) [ "$nodes" -ge 1 ] || echo "a job needs at least one node, not $nodes" ;;
    debug) echo "the debug QOS is for short tests and forbids job chaining, and this job requeues itself: use -q regular" ;;
    *) echo "QOS $qos is not the one this job is written for (regular)" ;;
  esac
}

# ALCF "Running Jobs on Polaris", the queue tables (nodes, 5 min to the maximum walltime); prod is
# a routing queue whose execution queues split it by node count: small 10-24 nodes <= 3 h, medium
# 25-99 <= 6 h, large 100-496 <= 24 h.
polaris_queue_problem() {
  local queue="$1" nodes="$2" seconds="$3"
  case "$queue" in
    debug) _boostmpi_limits_problem debug 1 2 1 "$nodes" "$seconds" ;;
    debug-scaling) _boostmpi_limits_problem debug-scaling 1 10 1 "$nodes" "$seconds" ;;
    preemptable) _boostmpi_limits_problem preemptable 1 10 72 "$nodes" "$seconds" ;;
    capacity) _boostmpi_limits_problem capacity 1 4 168 "$nodes" "$seconds" ;;
    demand) _boostmpi_limits_problem demand 1 56 1 "$nodes" "$seconds" "by request only" ;;
    prod)
      if [ "$nodes" -lt 10 ]; then _boostmpi_limits_problem prod 10 496 24 "$nodes" "$seconds"
      elif [ "$nodes" -le 24 ]; then _boostmpi_limits_problem "prod (routed to small)" 10 24 3 "$nodes" "$seconds"
      elif [ "$nodes" -le 99 ]; then _boostmpi_limits_problem "prod (routed to medium)" 25 99 6 "$nodes" "$seconds"
      else _boostmpi_limits_problem "prod (routed to large)" 100 496 24 "$nodes" "$seconds"
      fi ;;
    *) echo "queue $queue is not one of Polaris's (debug, debug-scaling, preemptable, prod, capacity, demand)" ;;
  esac
}
