#!/usr/bin/env bash
# The main job: set up on first use, run the preflight, then train with mpirun.
#   bash run.sh                                  # default: ORL real faces, 2 CPU processes
#   bash run.sh num_epoch=5                      # config overrides reach every process
#   NP=16 HOSTFILE=hosts/host_16 CONFIG=configs/ms1mv3_r50.py bash run.sh
# Environment: NP (processes, default 2), HOSTFILE (default: NP slots on localhost),
# CONFIG (default configs/orl.py), MXNET_PACKAGE (GPU build, see setup-utils/install.sh),
# MAX_RESTARTS (default 0: relaunch a failed job on the hosts that still answer, resuming
# from its last checkpoint, at most this many times; setup-utils/restarts.sh).
# Relative paths (CONFIG, HOSTFILE, rec, --work-dir) are taken from the folder it is
# launched in, on every host.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)  # -P: as realpath spells it below
NP=${NP:-2}
CONFIG=${CONFIG:-$root/configs/orl.py}
HOSTFILE=${HOSTFILE:-}

bash "$root/setup-utils/install.sh"
export PATH="$root/.venv/bin:$PATH"
if [ "$(realpath -m "$CONFIG")" = "$root/configs/orl.py" ] && [ ! -f data/orl/train.rec ]; then
  echo "== packing the default job's data: ORL faces -> $PWD/data/orl"
  "$root/.venv/bin/python" -m partial_fc_mx pack-orl data/orl
fi

# Open MPI's daemons notice a lost host by TCP keepalives on their (idle) control
# connections; its defaults take 8 minutes (300 s + 9 x 20 s). These take about a
# minute, after which mpirun ends the job on every host.
export OMPI_MCA_oob_tcp_keepalive_time=${OMPI_MCA_oob_tcp_keepalive_time:-30}
export OMPI_MCA_oob_tcp_keepalive_intvl=${OMPI_MCA_oob_tcp_keepalive_intvl:-10}
export OMPI_MCA_oob_tcp_keepalive_probes=${OMPI_MCA_oob_tcp_keepalive_probes:-3}
# The hosts and their slots (a host line without slots= counts as one), which the
# restart supervisor narrows to those that still answer (setup-utils/restarts.sh).
HOSTS=(); SLOTS=()
if [ -n "$HOSTFILE" ]; then
  while read -r host options; do
    [ -z "$host" ] || [ "${host:0:1}" = "#" ] && continue
    slots=1
    [[ $options =~ slots=([0-9]+) ]] && slots=${BASH_REMATCH[1]}
    HOSTS+=("$host"); SLOTS+=("$slots")
  done < "$HOSTFILE"
else
  HOSTS=(localhost); SLOTS=("$NP")
fi
as_root=()
[ "$(id -u)" -eq 0 ] && as_root=(--allow-run-as-root)
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
launch_training() {
  local placement=(-H "localhost:$NP" --oversubscribe)
  if [ -n "$HOSTFILE" ]; then
    for i in "${!HOSTS[@]}"; do echo "${HOSTS[$i]} slots=${SLOTS[$i]}"; done > "$hosts_now"
    placement=(--hostfile "$hosts_now")
  fi
  PFC_COMMAND=${PFC_COMMAND:-train} mpirun -np "$NP" -bind-to none -map-by slot -wdir "$PWD" \
    "${placement[@]}" "${as_root[@]}" "${forwarded[@]}" -x PFC_COMMAND \
    bash "$root/config.sh" "$@"
}
probe_host() {
  timeout -k 5 "$PROBE_TIMEOUT" mpirun "${as_root[@]}" -np 1 -H "$1:1" true
}

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
python="$root/.venv/bin/python"
source "$root/setup-utils/restarts.sh"
train_with_restarts "$@"
