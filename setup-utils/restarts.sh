# The job's supervisor, sourced by run.sh and setup-utils/slurm.sbatch: stops that save,
# and restarts on failure.
#
# train_with_restarts ARGS... runs `launch_training ARGS...` (the caller's function; it
# starts one process per slot of the hosts in HOSTS/SLOTS and passes PFC_COMMAND,
# PFC_JOB and PFC_STOPPED_STATUS on) in the background, its output on this terminal.
#
# A stop: SIGTERM, SIGINT (Ctrl-C), SIGHUP or STOP_SIGNAL to this shell (or to its whole
# process group) sends STOP_SIGNAL (the caller's; SIGUSR1 by default, which mpirun and
# srun forward to every rank without ending the job) to the launcher once. Every rank
# saves after its current step, says "stopped by a signal at step N" (metrics.py) and
# exits 0 (PFC_STOPPED_STATUS=0); this shell then says so in one line and returns
# STOPPED (143), whatever signal reached whom: a scheduler that signals the ranks
# themselves (scancel) ends the same way. A stopped job is never relaunched. The third
# request sends the launcher SIGTERM: the job ends without waiting for the save (mpirun
# gives the ranks STOP_GRACE seconds). A stop while a failed job waits to be relaunched
# ends there, with the failed job's status.
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
STOPPED=143  # interrupts.STOPPED_STATUS
for name in MAX_RESTARTS RESTART_BACKOFF PROBE_TIMEOUT STOP_GRACE; do
  if ! [[ ${!name} =~ ^[0-9]+$ ]]; then
    echo "$name=${!name} must be a whole number (of restarts, seconds)" >&2
    exit 2
  fi
done
if ! kill -l "$STOP_SIGNAL" >/dev/null 2>&1; then
  echo "STOP_SIGNAL=$STOP_SIGNAL is not a signal (USR1, TERM, ...)" >&2
  exit 2
fi

# say WORDS: a line on stderr; a terminal that went away (a hang-up) must not end this
# shell under set -e while it stops the job
say() { echo "$*" >&2 || true; }

train_with_restarts() {
  local attempt=0 status np_wanted=$NP resume=() stopping=0 requests=0 launcher_pid=
  local answer word alive dropped workspace output signal
  local -a kept_hosts kept_slots
  workspace=$(mktemp -d)
  output=$workspace/output
  # the job's copy goes when this function returns (not when the functions it calls do,
  # unless a caller sets functrace: set -T; nor a file sourced here, so source none)
  trap 'rm -rf "$workspace"; trap - RETURN TERM INT HUP "$STOP_SIGNAL"' RETURN
  for signal in TERM INT HUP "$STOP_SIGNAL"; do
    trap "request_stop $signal" "$signal"
  done
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
      [ "$MAX_RESTARTS" -gt 0 ] && say "not restarting: $attempt restart(s) done" \
        "(MAX_RESTARTS=$MAX_RESTARTS); resume with --resume-from the work dir"
      return "$status"
    fi
    attempt=$((attempt + 1))
    kept_hosts=(); kept_slots=(); dropped=()
    for i in "${!HOSTS[@]}"; do
      if probe_host "${HOSTS[$i]}" >/dev/null 2>&1; then
        kept_hosts+=("${HOSTS[$i]}"); kept_slots+=("${SLOTS[$i]}")
      else
        say "host ${HOSTS[$i]} did not answer within ${PROBE_TIMEOUT} s: dropped"
        dropped+=("${HOSTS[$i]}")
      fi
    done
    if relaunch_stopped; then return "$status"; fi  # a probe ended by the Ctrl-C too
    HOSTS=("${kept_hosts[@]}"); SLOTS=("${kept_slots[@]}")
    alive=0
    for n in "${SLOTS[@]}"; do alive=$((alive + n)); done
    NP=$(( alive < np_wanted ? alive : np_wanted ))
    if [ "$NP" -eq 0 ]; then
      say "not restarting: no host answered"; return "$status"
    fi
    answer=$("$python" -m partial_fc_mx restart "$CONFIG" "$@" --status "$status" \
             --output "$output" --hosts "${HOSTS[@]}" --processes "$NP" \
             --dropped "${dropped[@]}" --attempt "$attempt" --job "$PFC_JOB" \
             --first-processes "$np_wanted") || return "$status"
    resume=()
    while IFS= read -r word; do [ -z "$word" ] || resume+=("$word"); done <<<"$answer"
    sleep "$RESTART_BACKOFF" & wait $! || true  # a trapped signal ends the wait
    kill $! 2>/dev/null || true
    if relaunch_stopped; then return "$status"; fi
    if ! PFC_COMMAND=check launch_training "$@" "${resume[@]}"; then
      relaunch_stopped && return "$status"
      say "not restarting: the preflight on the remaining hosts failed (above)"
      return "$status"
    fi
    if relaunch_stopped; then return "$status"; fi
  done
}

# relaunch_stopped: whether a stop came while the failed job was being relaunched, said.
relaunch_stopped() {
  [ "$stopping" = 1 ] || return 1
  say "stopped while relaunching the failed job (status $status): not restarting"
}

# launch_and_wait ARGS: launch_training ARGS in the background, its output copied to this
# terminal and to $output; LAUNCH_STATUS is its status. `wait` returns early when a
# trapped signal arrives; the launch goes on until it ends.
launch_and_wait() {
  local fifo=$workspace/fifo copier again
  rm -f "$fifo" && mkfifo "$fifo"
  # the copy and the launching shell keep going through the signals meant for the job (a
  # terminal's Ctrl-C or hang-up, a TERM to the whole group): the ranks' last lines still
  # come through, and this shell hands the stop to the launcher, which sets its own
  ( trap '' INT TERM HUP; exec tee "$output" ) <"$fifo" &
  copier=$!
  ( trap '' INT TERM HUP; launch_training "$@" ) >"$fifo" 2>&1 &
  launcher_pid=$!
  while :; do
    LAUNCH_STATUS=0
    wait "$launcher_pid" || LAUNCH_STATUS=$?
    kill -0 "$launcher_pid" 2>/dev/null || break
  done
  # ended while a trap ran: its own status, which bash keeps until it is waited for
  again=0; wait "$launcher_pid" 2>/dev/null || again=$?
  [ "$again" -eq 127 ] || LAUNCH_STATUS=$again
  launcher_pid=
  wait "$copier" || true
}

# request_stop SIGNAL: the first stop request goes to the launcher, which hands it to
# every rank; the second says that the job is stopping; the third ends it.
request_stop() {
  requests=$((requests + 1))
  stopping=1
  [ -n "$launcher_pid" ] || return 0  # between launches: relaunch_stopped says so
  case $requests in
    1) say "stop requested (SIG$1): every rank saves after its current step, then exits"
       pkill -"$STOP_SIGNAL" -P "$launcher_pid" || true ;;
    2) say "already stopping: every rank saves after its current step, then exits; a" \
           "third request ends the job without waiting for the save" ;;
    *) say "ending the job without waiting for the save (its launcher gets SIGTERM)"
       pkill -TERM -P "$launcher_pid" || true ;;
  esac
}

# stopped_on_purpose: whether the ended launch was a stop on purpose (a rank said it
# stopped and saved, or this shell was signalled and the job did not finish), said in
# one line.
stopped_on_purpose() {
  local said
  said=$(grep -o 'stopped by a signal at step [0-9]*' "$output" | tail -n 1 || true)
  if [ -n "$said" ]; then
    say "stopped on purpose: every rank saved at step ${said##* }; not restarting (exit" \
        "status $STOPPED)"
  elif [ "$stopping" = 1 ] && [ "$LAUNCH_STATUS" -ne 0 ]; then
    say "stopped on purpose before any rank could save (the launcher's status" \
        "$LAUNCH_STATUS): resume from the last checkpoint; not restarting (exit status" \
        "$STOPPED)"
  else
    return 1
  fi
}
