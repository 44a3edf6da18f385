# The job's supervisor, sourced by run.sh and setup-utils/slurm.sbatch: stops that save,
# and restarts on failure.
#
# train_with_restarts ARGS... runs `launch_training ARGS...` (the caller's function; it
# starts one process per slot of the hosts in HOSTS/SLOTS and passes PFC_COMMAND,
# PFC_JOB and PFC_STOPPED_STATUS on) in the background, its output on this terminal.
#
# A stop: SIGTERM, SIGINT (Ctrl-C) or SIGHUP to this shell sends STOP_SIGNAL (the
# caller's; SIGUSR1 by default, which mpirun and srun forward to every rank without
# ending the job) to the launcher once. Every rank saves after its current step, says
# "stopped by a signal at step N" and exits 0 (PFC_STOPPED_STATUS=0); this shell then
# says so in one line and returns STOPPED (143), whatever signal reached whom: a
# scheduler that signals the ranks themselves (scancel) ends the same way. A stopped job
# is never relaunched.
#
# A failure (the job ended otherwise, not with 0), up to MAX_RESTARTS times:
#   1. probes every host with `probe_host HOST` (the caller's; PROBE_TIMEOUT seconds
#      each) and drops those that do not answer;
#   2. runs `python -m partial_fc_mx restart`, which names the failure in training.log
#      and metrics.jsonl and prints the arguments to relaunch with (--resume-from the
#      work dir, or the first launch's global batch while there is no checkpoint, so
#      the schedule holds), or refuses (the same failure after the same step twice in
#      this job: the job itself, not a host);
#   3. waits RESTART_BACKOFF seconds, runs the preflight on the hosts that remain, and
#      relaunches on their slots (at most the first launch's NP): the trainer re-shards
#      the centers to the new number of processes and keeps the schedule (it counts
#      images).
MAX_RESTARTS=${MAX_RESTARTS:-0}
RESTART_BACKOFF=${RESTART_BACKOFF:-30}
PROBE_TIMEOUT=${PROBE_TIMEOUT:-30}
STOP_GRACE=${STOP_GRACE:-30}
STOP_SIGNAL=${STOP_SIGNAL:-USR1}
STOPPED=143
for name in MAX_RESTARTS RESTART_BACKOFF PROBE_TIMEOUT STOP_GRACE; do
  if ! [[ ${!name} =~ ^[0-9]+$ ]]; then
    echo "$name=${!name} must be a whole number (of restarts, seconds)" >&2
    exit 2
  fi
done

train_with_restarts() {
  local attempt=0 status np_wanted=$NP resume=() stopping=0 launcher_pid= answer word
  local alive dropped workspace output
  local -a kept_hosts kept_slots
  workspace=$(mktemp -d)
  output=$workspace/output
  # the job's copy goes when this function returns (not when the functions it calls do,
  # unless a caller sets functrace: set -T; nor a file sourced here, so source none)
  trap 'rm -rf "$workspace"; trap - RETURN TERM INT HUP' RETURN
  trap 'request_stop TERM' TERM
  trap 'request_stop INT' INT
  trap 'request_stop HUP' HUP
  # one id for every launch of this job: restart records and the trainer's start records
  # carry it, so that a failure is compared with this job's earlier ones only
  export PFC_JOB PFC_STOPPED_STATUS=0
  PFC_JOB="$(date +%Y%m%d-%H%M%S)-$$"
  while :; do
    launch_and_wait "$@" "${resume[@]}"
    status=$LAUNCH_STATUS
    if stopped_on_purpose; then return "$STOPPED"; fi
    if [ "$status" -eq 0 ]; then return 0; fi
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
             --dropped "${dropped[@]}" --attempt "$attempt" --job "$PFC_JOB" \
             --first-processes "$np_wanted") || return "$status"
    resume=()
    while IFS= read -r word; do [ -z "$word" ] || resume+=("$word"); done <<<"$answer"
    sleep "$RESTART_BACKOFF" & wait $! || true  # a trapped signal ends the wait
    if [ "$stopping" = 1 ]; then
      kill $! 2>/dev/null || true
      echo "stopped while waiting to relaunch the failed job (status $status): not" \
           "restarting" >&2
      return "$status"
    fi
    if ! PFC_COMMAND=check launch_training "$@" "${resume[@]}"; then
      echo "not restarting: the preflight on the remaining hosts failed (above)" >&2
      return "$status"
    fi
  done
}

# launch_and_wait ARGS: launch_training ARGS in the background, its output copied to this
# terminal and to $output; LAUNCH_STATUS is its status. `wait` returns early when a
# trapped signal arrives; the launch goes on until it ends.
launch_and_wait() {
  local fifo=$workspace/fifo copier
  rm -f "$fifo" && mkfifo "$fifo"
  # the copy keeps going through the signals meant for the job (a terminal's Ctrl-C or
  # hang-up, a TERM to the whole group): the ranks' last lines still come through it
  ( trap '' INT TERM HUP; exec tee "$output" ) <"$fifo" &
  copier=$!
  launch_training "$@" >"$fifo" 2>&1 &
  launcher_pid=$!
  while :; do
    LAUNCH_STATUS=0
    wait "$launcher_pid" || LAUNCH_STATUS=$?
    kill -0 "$launcher_pid" 2>/dev/null || break
  done
  launcher_pid=
  wait "$copier" || true
}

# request_stop SIGNAL: the first stop request goes to the launcher, which hands it to
# every rank; later ones say that the job is stopping.
request_stop() {
  if [ "$stopping" = 1 ]; then
    echo "already stopping: every rank saves after its current step, then exits" >&2
    return 0
  fi
  stopping=1
  [ -n "$launcher_pid" ] || return 0  # between launches: nothing runs to stop
  echo "stop requested (SIG$1): every rank saves after its current step, then exits" >&2
  pkill -"$STOP_SIGNAL" -P "$launcher_pid" || true
}

# stopped_on_purpose: whether the ended launch was a stop on purpose (this shell was
# signalled, or a rank said it stopped and saved), said in one line.
stopped_on_purpose() {
  local said
  said=$(grep -o 'stopped by a signal at step [0-9]*' "$output" | tail -n 1 || true)
  if [ -n "$said" ]; then
    echo "stopped on purpose: every rank saved at step ${said##* }; not restarting" \
         "(exit status $STOPPED)" >&2
  elif [ "$stopping" = 1 ]; then
    echo "stopped on purpose before any rank could save (the launcher's status" \
         "$LAUNCH_STATUS): resume from the last checkpoint; not restarting (exit status" \
         "$STOPPED)" >&2
  else
    return 1
  fi
}
