# Restart on failure, sourced by run.sh and setup-utils/slurm.sbatch.
#
# train_with_restarts ARGS... runs `launch_training ARGS...` (the caller's function; it
# starts one process per slot of the hosts in HOSTS/SLOTS and passes PFC_COMMAND on)
# and, when the job ends abnormally, up to MAX_RESTARTS times:
#   1. probes every host with `probe_host HOST` (the caller's; PROBE_TIMEOUT seconds
#      each) and drops those that do not answer;
#   2. runs `python -m partial_fc_mx restart`, which names the failure in training.log
#      and metrics.jsonl and gives the work dir to resume from, or refuses (the same
#      failure after the same step twice: the job itself, not a host);
#   3. waits RESTART_BACKOFF seconds, runs the preflight on the hosts that remain, and
#      relaunches with --resume-from on their slots (at most the first launch's NP):
#      the trainer re-shards the centers to the new number of processes and keeps the
#      schedule (it counts images).
# A job that finished (0) or was stopped on purpose (SIGTERM or Ctrl-C: every rank
# saved and said so, which `restart` reads; or this shell was signalled, after the job
# ended: signal the ranks or the launcher, not this shell alone) is never relaunched.
MAX_RESTARTS=${MAX_RESTARTS:-0}
RESTART_BACKOFF=${RESTART_BACKOFF:-30}
PROBE_TIMEOUT=${PROBE_TIMEOUT:-30}
for name in MAX_RESTARTS RESTART_BACKOFF PROBE_TIMEOUT; do
  if ! [[ ${!name} =~ ^[0-9]+$ ]]; then
    echo "$name=${!name} must be a whole number (of restarts, seconds)" >&2
    exit 2
  fi
done

train_with_restarts() {
  local attempt=0 status np_wanted=$NP output resume=() stopping=0 alive dropped answer
  local -a kept_hosts kept_slots
  output=$(mktemp)
  # the job's copy goes when this function returns (not when the functions it calls do,
  # unless a caller sets functrace: set -T; nor a file sourced here, so source none)
  trap 'rm -f "$output"; trap - RETURN' RETURN
  trap 'stopping=1' TERM INT
  while :; do
    status=0
    # the launcher's status, not tee's (a full disk must not fail a finished job)
    launch_training "$@" "${resume[@]}" 2>&1 | tee -i "$output" || status=${PIPESTATUS[0]}
    if [ "$status" -eq 0 ]; then return 0; fi
    if [ "$stopping" = 1 ]; then
      echo "stopped on purpose (status $status): not restarting" >&2
      return "$status"
    fi
    if [ "$attempt" -ge "$MAX_RESTARTS" ]; then
      [ "$MAX_RESTARTS" -gt 0 ] && echo "not restarting: $attempt restart(s) done" \
        "(MAX_RESTARTS=$MAX_RESTARTS); resume with --resume-from the work dir" >&2
      return "$status"
    fi
    attempt=$((attempt + 1))
    kept_hosts=(); kept_slots=(); dropped=()
    for i in "${!HOSTS[@]}"; do
      if probe_host "${HOSTS[$i]}" >/dev/null 2>&1; then
        kept_hosts+=("${HOSTS[$i]}"); kept_slots+=("${SLOTS[$i]}")
      else
        echo "host ${HOSTS[$i]} did not answer within ${PROBE_TIMEOUT} s: dropped" >&2
        dropped+=("${HOSTS[$i]}")
      fi
    done
    HOSTS=("${kept_hosts[@]}"); SLOTS=("${kept_slots[@]}")
    alive=0
    for n in "${SLOTS[@]}"; do alive=$((alive + n)); done
    NP=$(( alive < np_wanted ? alive : np_wanted ))
    if [ "$NP" -eq 0 ]; then
      echo "not restarting: no host answered" >&2; return "$status"
    fi
    answer=$("$python" -m partial_fc_mx restart "$CONFIG" "$@" --status "$status" \
             --output "$output" --hosts "${HOSTS[@]}" --processes "$NP" \
             --dropped "${dropped[@]}" --attempt "$attempt") || return "$status"
    resume=()
    [ -n "$answer" ] && resume=(--resume-from "$answer")
    sleep "$RESTART_BACKOFF" || true  # a signal to the group ends it: not set -e's exit
    [ "$stopping" = 1 ] && return "$status"
    if ! PFC_COMMAND=check launch_training "$@" "${resume[@]}"; then
      echo "not restarting: the preflight on the remaining hosts failed (above)" >&2
      return "$status"
    fi
  done
}
