#!/usr/bin/env bash
# The main job: set up on first use, run the preflight, then train with mpirun.
#   bash run.sh                                  # default: ORL real faces, 2 CPU processes
#   bash run.sh num_epoch=5                      # config overrides reach every process
#   NP=16 HOSTFILE=hosts/host_16 CONFIG=configs/ms1mv3_r50.py bash run.sh
#   bash run.sh --help                           # this text, without setting anything up
# Arguments: config overrides (key=value), --work-dir DIR, --resume-from DIR, --load-from DIR.
# Environment: NP (processes, default 2), HOSTFILE (an Open MPI hostfile; default: NP
# slots on localhost), CONFIG (default configs/orl.py), MXNET_PACKAGE (GPU build, see
# setup-utils/install.sh), MAX_RESTARTS (default 0: relaunch a failed job on the hosts
# that still answer, resuming from its last checkpoint, at most this many times),
# STOP_GRACE (default 30: seconds Open MPI gives the ranks to save when mpirun itself is
# signalled; setup-utils/restarts.sh, docs/launching.md).
# Stop it with Ctrl-C or `kill <this shell's pid>`: every rank saves after its current
# step, and it exits with status 143 (and is not relaunched); a third Ctrl-C ends it
# without waiting for the save.
# Relative paths (CONFIG, HOSTFILE, rec, --work-dir) are taken from the folder it is
# launched in, on every host.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)  # -P: as realpath spells it below
case "${1:-}" in
  -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; exit 0 ;;
esac
NP=${NP:-2}
CONFIG=${CONFIG:-$root/configs/orl.py}
HOSTFILE=${HOSTFILE:-}

bash "$root/setup-utils/install.sh"
export PATH="$root/.venv/bin:$PATH"
python="$root/.venv/bin/python"
source "$root/setup-utils/restarts.sh"  # checks MAX_RESTARTS and the others first
if [ "$(realpath -m "$CONFIG")" = "$root/configs/orl.py" ] && [ ! -f data/orl/train.rec ]; then
  echo "== packing the default job's data: ORL faces -> $PWD/data/orl"
  "$python" -m partial_fc_mx pack-orl data/orl
fi

# Open MPI's daemons notice a lost host by TCP keepalives on their (idle) control
# connections; its defaults take 8 minutes (300 s + 9 x 20 s). These take about a
# minute, after which mpirun ends the job on every host.
export OMPI_MCA_oob_tcp_keepalive_time=${OMPI_MCA_oob_tcp_keepalive_time:-30}
export OMPI_MCA_oob_tcp_keepalive_intvl=${OMPI_MCA_oob_tcp_keepalive_intvl:-10}
export OMPI_MCA_oob_tcp_keepalive_probes=${OMPI_MCA_oob_tcp_keepalive_probes:-3}
as_root=()
[ "$(id -u)" -eq 0 ] && as_root=(--allow-run-as-root)
# on_host HOST COMMAND...: COMMAND on HOST within PROBE_TIMEOUT seconds (its stdin not
# the caller's: a `while read` loop's lines stay there). user@host: as the user mpirun is.
on_host() {
  timeout -k 5 "$PROBE_TIMEOUT" mpirun "${as_root[@]}" -np 1 -H "${1#*@}:1" "${@:2}" </dev/null
}
# A host's cores: the slots mpirun gives a hostfile line without slots= (or max_slots=);
# mpirun counts those of its cpuset, lscpu all of them: in a container limited to fewer,
# write slots=N.
host_cores() {
  local count
  count=$(on_host "$1" lscpu -p=core,socket | grep -v '^#' | sort -u | wc -l)
  [ "$count" -gt 0 ] && echo "$count"
}
# The hosts and their slots as mpirun reads the hostfile (run/hostfile.py), which the
# restart supervisor narrows to those that still answer (setup-utils/restarts.sh).
HOSTS=(); SLOTS=()
if [ -n "$HOSTFILE" ]; then
  listed=$("$python" -m partial_fc_mx hostfile "$HOSTFILE") || exit 2
  while read -r host slots; do
    if [ "$slots" = cores ] && ! slots=$(host_cores "$host"); then
      echo "run.sh: $HOSTFILE gives $host no slots= and it did not answer within" \
           "$PROBE_TIMEOUT s (mpirun -H $host:1); give it slots=N or check the host" >&2
      exit 2
    fi
    HOSTS+=("$host"); SLOTS+=("$slots")
  done <<<"$listed"
else
  HOSTS=(localhost); SLOTS=("$NP")
fi
# Pass the caller's environment for the run through to every process, on every host
# (MXNet's, Horovod's, NCCL's, OpenMP's and oneDNN's settings, e.g. DNNL_MAX_CPU_ISA).
export CONFIG
forwarded=()
for name in PATH LD_LIBRARY_PATH CONFIG $(compgen -e | grep -E '^(MXNET_|HOROVOD_|NCCL_|OMP_|DNNL_|ONEDNN_)' || true); do
  [ -n "${!name+set}" ] && forwarded+=(-x "$name")
done
hosts_now=$(mktemp)
said=$(mktemp)
trap 'rm -f "$said" "$hosts_now"' EXIT

# One process per slot of HOSTS/SLOTS, NP in all; PFC_COMMAND=check: the preflight.
# -wdir: every process starts in this folder, so relative paths mean the same on every
# host; a host that lacks it stops the job instead of silently using its home folder.
# Training runs in a session of its own, so that a terminal's Ctrl-C reaches this shell
# alone, which asks every rank to save (restarts.sh sends mpirun SIGUSR1, which it hands
# to every rank); and with Open MPI's kill delay raised to STOP_GRACE, so that a SIGTERM
# or SIGINT to mpirun itself leaves the ranks time to save (it sends them SIGTERM after
# STOP_GRACE seconds, SIGKILL after as many again: so long does a crashed job take to end).
launch_training() {
  local placement=(-H "localhost:$NP" --oversubscribe) detach=() stops=() name
  if [ -n "$HOSTFILE" ]; then
    "$python" -m partial_fc_mx hostfile "$HOSTFILE" --keep "${HOSTS[@]}" >"$hosts_now"
    placement=(--hostfile "$hosts_now")
  fi
  if [ "${PFC_COMMAND:-train}" = train ]; then
    detach=(setsid)
    stops=(--mca odls_base_sigkill_timeout "$STOP_GRACE")
  fi
  for name in PFC_JOB PFC_STOPPED_STATUS; do
    [ -n "${!name+set}" ] && stops+=(-x "$name")
  done
  PFC_COMMAND=${PFC_COMMAND:-train} "${detach[@]}" mpirun -np "$NP" -bind-to none \
    -map-by slot -wdir "$PWD" "${placement[@]}" "${as_root[@]}" "${forwarded[@]}" \
    -x PFC_COMMAND "${stops[@]}" bash "$root/config.sh" "$@"
}
probe_host() { on_host "$1" true; }

echo "== preflight: $CONFIG on $NP processes"
status=0  # a pipeline: bash waits for tee, so the grep below sees every line
PFC_COMMAND=check launch_training "$@" 2>&1 | tee -i "$said" || status=$?
if [ "$status" -ne 0 ]; then
  if grep -q "PROBLEM:" "$said"; then
    echo "run.sh: the preflight found the PROBLEM lines above; fix them and run again." >&2
  else
    echo "run.sh: the preflight stopped before it could check everything; the error above" \
         "says why (CONFIG=$CONFIG, arguments: ${*:-none})." >&2
  fi
  exit 1
fi
echo "== training"
train_with_restarts "$@"
