#!/usr/bin/env bash
# One training process. Launchers start it once per slot:
#   horovodrun -np 2 -H localhost:2 bash config.sh
#   horovodrun -np 16 -H ip1:8,ip2:8 bash config.sh
#   CONFIG=configs/ms1mv3_r50.py horovodrun -np 8 -H localhost:8 bash config.sh sample_rate=0.1
#   mpirun ... bash config.sh          (what run.sh does)
# Arguments are config overrides (key=value) or --work-dir DIR.
# PFC_COMMAND=check runs the preflight instead of training, under the same launcher.
# Relative paths (CONFIG, rec, --work-dir) are taken from the folder it is launched in.
# Stop it with SIGTERM, SIGINT or SIGUSR1 to every process: each saves after its current
# step (docs/launching.md, "Stopping a job").
#   bash config.sh --help                 # this text; `python -m partial_fc_mx train --help`
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
case "${1:-}" in
  -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; exit 0 ;;
esac
CONFIG=${CONFIG:-$root/configs/orl.py}
if [ -x "$root/.venv/bin/python" ]; then
  python="$root/.venv/bin/python"  # has the package installed (pip install -e)
else
  python=python3
  export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
fi

# The MXNet reference's settings: let Horovod, not the kvstore, apply updates, and
# let MXNet accumulate gradients in place.
export MXNET_UPDATE_ON_KVSTORE=0
export MXNET_EXEC_ENABLE_ADDTO=1
# Horovod batches small tensors into a fusion buffer this big. How often its
# background thread wakes (HOROVOD_CYCLE_TIME) is set by dist.init when not exported:
# 0.1 ms with a GPU, 5 ms on the CPU.
export HOROVOD_FUSION_THRESHOLD=${HOROVOD_FUSION_THRESHOLD:-67108864}

if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  # Which GPU collectives run on NCCL is fixed when Horovod is built
  # (HOROVOD_GPU_OPERATIONS=NCCL in setup-utils/install.sh); at run time only NCCL's
  # own knobs apply.
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
  export MXNET_GPU_WORKER_NTHREADS=${MXNET_GPU_WORKER_NTHREADS:-2}
  export MXNET_CPU_WORKER_NTHREADS=${MXNET_CPU_WORKER_NTHREADS:-3}
fi

exec "$python" -m partial_fc_mx "${PFC_COMMAND:-train}" "$CONFIG" "$@"
