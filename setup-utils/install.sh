#!/usr/bin/env bash
# Set up everything partial_fc_mx needs on a Debian/Ubuntu machine, idempotently:
# Open MPI, a compiler and iproute2 from apt, a virtual environment .venv/ with the pinned
# Python packages, and Horovod built from source against the installed MXNet.
#
#   bash setup-utils/install.sh                              # CPU (default)
#   MXNET_PACKAGE=mxnet-cu112 bash setup-utils/install.sh    # GPU: CUDA MXNet + Horovod with NCCL
#   MXNET_PACKAGE=preinstalled bash setup-utils/install.sh   # the MXNet python3 already has (NGC)
#
# Environment:
#   MXNET_PACKAGE   mxnet (CPU, default) or a GPU build mxnet-cu101 ... mxnet-cu117 (all
#                   version 1.9.1), or preinstalled: the MXNet 1.9.x, numpy and (if it
#                   has MXNet support) Horovod of the system's python3, as in NVIDIA's NGC
#                   MXNet containers; the venv sees them (--system-site-packages) and
#                   nothing is installed over them. A GPU build is refused, before anything
#                   is installed, on a machine with a GPU it has no kernels for (the
#                   PyPI wheels on H100/H200 and newer: docs/installation.md, "GPU
#                   support"); it is checked again once installed.
#   VENV            where the virtual environment goes (default: <repo>/.venv)
#   PFC_CACHE_DIR   where built Horovod wheels are kept for reuse
#                   (default: ~/.cache/partial_fc_mx)
#
# A second run finishes in seconds: a stamp in the venv records what was installed,
# and a Horovod wheel is reused only from a cache keyed by everything it was built
# against, and only after `horovodrun --check-build` confirms MXNet, MPI and Gloo
# (its report is kept until a package or a library it reads changes).
set -euo pipefail
declare -A system=()  # MXNET_PACKAGE=preinstalled: the system's MXNet (read_mxnet_of)

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
  preinstalled) gpu_operations= ;;  # NCCL if the MXNet found is a CUDA build (main)
  *) die "MXNET_PACKAGE=$mxnet_package is not an MXNet build; use mxnet, one of mxnet-cu101 ... mxnet-cu117, or preinstalled (the MXNet python3 already has)" ;;
esac

# MXNET_PACKAGE=preinstalled: what setup-utils/system_mxnet.py says of an interpreter's
# MXNet, numpy and Horovod, into the associative array named by $2.
read_mxnet_of() {
  local python=$1 report key value
  local -n facts=$2
  report=$("$python" "$root/setup-utils/system_mxnet.py") \
    || die "MXNET_PACKAGE=preinstalled needs an MXNet 1.9.x that $python imports (above)"
  while IFS='=' read -r key value; do facts[$key]=$value; done <<<"$report"
}

# MXNET_PACKAGE=preinstalled: after our pins are installed (and on every rerun) the venv
# must still import the system's MXNet and numpy from the system's folders, and its
# Horovod too unless the venv had to build its own: a package that shadows one is an error.
refuse_shadowed_packages() {
  [ "$mxnet_package" = preinstalled ] || return 0
  declare -A venv_has=()
  read_mxnet_of "$venv/bin/python" venv_has
  local key checked=(mxnet_dir mxnet_library numpy_dir numpy_version)
  # a Horovod built into the venv (the system's has no MXNet support) is expected there
  [[ ${venv_has[horovod_dir]} == "$(realpath "$venv")"/* ]] || checked+=(horovod_dir)
  for key in "${checked[@]}"; do
    [ "${venv_has[$key]}" = "${system[$key]}" ] || die "the venv's ${key%_*} is ${venv_has[$key]}, not the system's ${system[$key]}: something installed into $venv shadows it. Remove $venv and rerun; if it comes back, a pin in requirements.txt needs another version than the system has"
  done
}

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
    3) die "$mxnet_package cannot run on this machine's GPUs (the PROBLEM above); stopped $when. docs/installation.md, \"GPU support\", lists which build runs on which GPU." ;;
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
  # `python3 -m venv` needs ensurepip, a separate package on Debian/Ubuntu (NGC's image)
  python3 -c 'import ensurepip' 2>/dev/null || missing+=(python3-venv)
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
  [ "$mxnet_package" != preinstalled ] \
    || echo "$(mxnet_build_key) cuda ${system[mxnet_cuda]} numpy ${system[numpy_version]} ${system[horovod_dir]}"
}

python_in_venv() { "$venv/bin/python" "$@"; }
sees_system_packages() { grep -qx 'include-system-site-packages *= *true' "$venv/pyvenv.cfg"; }

# What decides `horovodrun --check-build`'s marks: the host and its CPU's flags, the site
# folders the venv imports from (their listings with times: an install, upgrade or
# removal changes them), its python and horovodrun, and Horovod's extensions with every
# shared library they load (size and time: a rebuilt MXNet or another Open MPI changes
# them), and any they cannot find. Fails, so that the report is made afresh, where any
# of these cannot be read.
check_build_inputs() {
  local folders horovod_dir extensions linked libraries folder
  command -v ldd >/dev/null || return 1
  folders=$(python_in_venv -c 'import os, sys
print("\n".join(p for p in sys.path if os.path.isdir(p) and p.endswith(("site-packages", "dist-packages"))))') || return 1
  horovod_dir=$(python_in_venv -c 'import importlib.util as u
print(u.find_spec("horovod").submodule_search_locations[0])' 2>/dev/null) || return 1
  mapfile -t extensions < <(find "$horovod_dir" -name '*.so' 2>/dev/null | sort)
  [ "${#extensions[@]}" -gt 0 ] || return 1
  echo "host $(uname -nm), CPU flags $(grep -m 1 '^flags' /proc/cpuinfo | sha256sum | cut -c1-16)"
  while read -r folder; do
    echo "$folder"
    ls -la --time-style=+%s "$folder" 2>/dev/null || return 1
  done <<<"$folders"
  linked=$(ldd "${extensions[@]}" 2>/dev/null) || return 1
  grep 'not found' <<<"$linked" || true
  libraries=$(awk '$2 == "=>" && $3 ~ /^\// { print $3 }' <<<"$linked" | sort -u)
  [ -n "$libraries" ] || return 1
  # shellcheck disable=SC2086  # one library per word
  stat -L -c '%n %s %Y' "$venv/bin/python" "$venv/bin/horovodrun" "${extensions[@]}" \
    $libraries 2>/dev/null
}

# --check-build's report, reused while check_build_inputs are the same: it imports each
# framework in a process of its own and takes 6-11 s, which every run.sh paid before
# training. Kept per host (a venv on a shared folder serves several) and written whole
# or not at all; without those inputs (no Horovod yet) it always runs.
check_build_report() {
  local cache="$venv/.partial_fc_mx-check-build.$(uname -n)" inputs report
  inputs=$(check_build_inputs | sha256sum | cut -c1-16) || inputs=
  if [ -n "$inputs" ] && [ -f "$cache" ] && [ "$(head -n 1 "$cache")" = "$inputs" ]; then
    tail -n +2 "$cache"
    return 0
  fi
  report=$("$venv/bin/horovodrun" --check-build 2>/dev/null) || return 1
  if [ -n "$inputs" ] && grep -q '^Horovod v' <<<"$report"; then
    printf '%s\n%s\n' "$inputs" "$report" >"$cache.$$" && mv -f "$cache.$$" "$cache" \
      || rm -f "$cache.$$"
  fi
  printf '%s\n' "$report"
}

horovod_has_everything() {
  local report
  report=$(check_build_report) || return 1
  grep -q '\[X\] MXNet' <<<"$report" && grep -q '\[X\] MPI' <<<"$report" \
    && grep -q '\[X\] Gloo' <<<"$report" || return 1
  if [ -n "$gpu_operations" ]; then grep -q "\[X\] $gpu_operations" <<<"$report" || return 1; fi
}

install_python_packages() {
  python_in_venv -m pip install -q --upgrade pip
  # Horovod is built without build isolation, so its build tools must be in the venv.
  python_in_venv -m pip install -q setuptools wheel
  local pins=(-r "$venv/requirements.resolved.txt" -r "$root/setup-utils/requirements-test.txt")
  if [ "$mxnet_package" = preinstalled ]; then
    # the system's MXNet and numpy stay: no pin of ours for them, and numpy held at the
    # system's version so that no other package pulls another one into the venv
    grep -v '^\(mxnet\|numpy\)==' "$root/requirements.txt" >"$venv/requirements.resolved.txt"
    echo "numpy==${system[numpy_version]}" >"$venv/constraints.txt"
    pins+=(-c "$venv/constraints.txt")
  else
    # MXNet variants share the files of the mxnet package: keep exactly one installed
    local others
    others=$(python_in_venv -m pip list --format=freeze 2>/dev/null \
      | grep -io '^mxnet\(-cu[0-9]*\)\?==' | tr -d '=' | grep -vix "$mxnet_package" || true)
    [ -z "$others" ] || python_in_venv -m pip uninstall -q -y $others
    sed "s/^mxnet==.*/${mxnet_package}==${mxnet_version}/" "$root/requirements.txt" >"$venv/requirements.resolved.txt"
  fi
  python_in_venv -m pip install -q "${pins[@]}" \
    || die "pip could not install the pinned packages (above)${system[numpy_version]:+ beside numpy ${system[numpy_version]} of the system}"
  python_in_venv -m pip install -q --no-deps -r "$root/setup-utils/requirements-data.txt"
  python_in_venv -m pip install -q --no-deps -e "$root"
}

# A Horovod the system already has (MXNET_PACKAGE=preinstalled) gets the venv's own
# horovodrun, so that run.sh and `horovodrun --check-build` start it with the venv; as
# pip writes it, with the __main__ guard (Gloo's launcher re-imports it in children).
add_horovodrun_launcher() {
  [ "$mxnet_package" = preinstalled ] && [ ! -e "$venv/bin/horovodrun" ] \
    && python_in_venv -c 'import horovod.runner' 2>/dev/null || return 0
  printf '%s\n' "#!$venv/bin/python" "import sys" "from horovod.runner.launch import run_commandline" \
    "if __name__ == '__main__':" "    sys.exit(run_commandline())" >"$venv/bin/horovodrun"
  chmod +x "$venv/bin/horovodrun"
}

# What a Horovod wheel was built against. A preinstalled MXNet is named by its library's
# path, size and time: two builds of 1.9.1 (the wheel's, a container's, one rebuilt in
# place) differ in ABI, and a Horovod built against one must not serve another.
mxnet_build_key() {
  if [ "$mxnet_package" = preinstalled ]; then
    echo "preinstalled-${system[mxnet_version]}-$(stat -c '%n %s %Y' "${system[mxnet_library]}" | sha256sum | cut -c1-12)"
  else
    echo "${mxnet_package}-${mxnet_version}"
  fi
}

install_horovod() {
  add_horovodrun_launcher
  if horovod_has_everything; then return 0; fi
  local key wheel_dir wheel
  key="horovod-${horovod_version}_$(mxnet_build_key)_$(python_in_venv -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')_$(uname -m)_gpu-${gpu_operations:-none}"
  wheel_dir="$cache_dir/wheels/$key"
  wheel=$(ls "$wheel_dir"/horovod-*.whl 2>/dev/null | head -n 1 || true)
  if [ -n "$wheel" ]; then
    say "reusing the Horovod wheel built earlier: $wheel"
    python_in_venv -m pip install -q --no-deps --force-reinstall "$wheel"
    horovod_has_everything && return 0
    say "that wheel lacks MXNet/MPI/Gloo support; discarding it and building again"
    rm -rf "$wheel_dir"
  fi
  say "building Horovod $horovod_version against ${system[mxnet_dir]:-$mxnet_package} (about 8 minutes on 2 cores)"
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
  local wheel=(--wheel "$mxnet_package") venv_options=()
  if [ "$mxnet_package" = preinstalled ]; then
    read_mxnet_of python3 system
    say "using the system's MXNet ${system[mxnet_version]} (${system[mxnet_dir]}), numpy ${system[numpy_version]}${system[horovod_version]:+, Horovod ${system[horovod_version]}}"
    [ "${system[mxnet_cuda]}" = 0 ] || gpu_operations=NCCL
    wheel=() venv_options=(--system-site-packages)  # the GPU check reads its library
  fi
  refuse_undriven_gpus "before installing anything" \
    env PYTHONPATH="$root" python3 -m partial_fc_mx gpus "${wheel[@]}"
  install_system_packages
  if [ ! -x "$venv/bin/python" ]; then
    say "creating the virtual environment $venv"
    python3 -m venv "${venv_options[@]}" "$venv"
  elif [ "$mxnet_package" = preinstalled ] && ! sees_system_packages; then
    die "$venv was made without the system's packages, so it cannot see the preinstalled MXNet; remove it (rm -rf $venv) or set VENV to another folder, and rerun"
  elif [ "$mxnet_package" != preinstalled ] && sees_system_packages; then
    die "$venv sees the system's packages (made by MXNET_PACKAGE=preinstalled): an MXNet installed into it would run beside the system's Horovod and numpy. Rerun with MXNET_PACKAGE=preinstalled, or remove it (rm -rf $venv) or set VENV to another folder"
  fi
  local stamp="$venv/.partial_fc_mx-installed"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$(install_fingerprint)" ] && horovod_has_everything; then
    refuse_shadowed_packages
    say "up to date ($venv)"
    return 0
  fi
  install_python_packages
  refuse_shadowed_packages  # before a Horovod build that a shadowed numpy could break
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
  check_build_report | awk '
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
