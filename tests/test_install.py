"""install.sh: what it says when it is done (the Horovod build by section, each mark
once), and MXNET_PACKAGE=preinstalled against an MXNet in the system python3's own site
folder (a mount namespace's overlay of it, as root)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BIN, SYSTEM_PATH, finish, start

from partial_fc_mx.caches import default_cache_dir

REPO = Path(__file__).resolve().parent.parent
CHECK_BUILD = """Horovod v0.28.1:

Available Frameworks:
    [ ] TensorFlow
    [X] PyTorch
    [X] MXNet

Available Controllers:
    [X] MPI
    [X] Gloo

Available Tensor Operations:
    [{nccl}] NCCL
    [ ] DDL
    [ ] CCL
    [X] MPI
    [X] Gloo
"""


def summary(tmp_path: Path, check_build: str) -> subprocess.CompletedProcess:
    """horovod_summary of install.sh (sourced: its functions alone) against a venv
    whose horovodrun prints `check_build`."""
    (tmp_path / "bin").mkdir(exist_ok=True)
    stub = tmp_path / "bin" / "horovodrun"
    stub.write_text(f"#!/bin/sh\ncat <<'EOF'\n{check_build}EOF\n")
    stub.chmod(0o755)
    return subprocess.run(["bash", "-c", f"VENV={tmp_path} source {REPO}/setup-utils/install.sh"
                           " && horovod_summary"], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("nccl, operations", [(" ", "MPI, Gloo"), ("X", "NCCL, MPI, Gloo")])
def test_the_closing_line_names_each_part_of_the_build_once(tmp_path, nccl, operations):
    result = summary(tmp_path, CHECK_BUILD.format(nccl=nccl))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("Horovod v0.28.1 for MXNet; controllers: MPI, Gloo; "
                                     f"tensor operations: {operations}")


def test_a_check_build_without_the_marks_is_a_failure(tmp_path):
    assert summary(tmp_path, "error: no horovod\n").returncode != 0


def test_check_builds_report_is_reused_until_what_decides_its_marks_changes(tmp_path):
    """run.sh's set-up runs `horovodrun --check-build` (6-11 s) only when a package, the
    Horovod extension or a library it loads changed since the last report, and every
    time when they cannot be read (an extension ldd cannot read): a venv whose Horovod
    extension is a copy of the real one and whose horovodrun counts its calls."""
    venv, calls = tmp_path / "venv", tmp_path / "calls"
    subprocess.run(["python3", "-m", "venv", "--without-pip", str(venv)], check=True,
                   env={**os.environ, "PATH": SYSTEM_PATH}, timeout=120)
    site = next(venv.glob("lib/python3*/site-packages"))
    (site / "horovod" / "mxnet").mkdir(parents=True)
    (site / "horovod" / "__init__.py").write_text("")
    real = next((BIN.parent / "lib").glob("python3*/site-packages/horovod/mxnet/mpi_lib*.so"))
    extension = site / "horovod" / "mxnet" / real.name
    extension.write_bytes(real.read_bytes())
    stub = venv / "bin" / "horovodrun"
    stub.write_text(f"#!/bin/sh\necho call >>{calls}\ncat <<'EOF'\n"
                    f"{CHECK_BUILD.format(nccl=' ')}EOF\n")
    stub.chmod(0o755)
    script = f"""VENV={venv} source {REPO}/setup-utils/install.sh
check() {{ horovod_has_everything && echo "$1: $(wc -l <{calls})"; }}
check first; check again
mkdir {site}/another_package; check installed; check again
printf x >>{extension}; check rebuilt; check again
echo text >{extension}; check unreadable; check again
"""
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n") == ["first: 1", "again: 1", "installed: 2", "again: 2",
                                         "rebuilt: 3", "again: 3", "unreadable: 4", "again: 5",
                                         ""], result.stdout
    assert [path.name for path in venv.glob(".partial_fc_mx-check-build*")] == [
        f".partial_fc_mx-check-build.{os.uname().nodename}"]  # this host's, written whole


# ----- MXNET_PACKAGE=preinstalled: an MXNet the system's python3 already has -----
# The system python3's install folders: its site folders and where pip puts scripts and
# data (the outermost of nested ones: on Debian /usr/local and /usr/lib/python3/...,
# under pyenv its whole prefix).
SYSTEM_FOLDERS = """import site, sysconfig
folders = {*site.getsitepackages(),
           *(sysconfig.get_path(key) for key in ("purelib", "platlib", "scripts", "data"))}
outermost = []
for folder in sorted(folders):
    if not any(folder.startswith(kept + "/") for kept in outermost):
        outermost.append(folder)
print(" ".join(outermost))
"""
IN_A_MOUNT_NAMESPACE = """set -euo pipefail
mount --make-rprivate /
# the system python3's install folders as overlays only this namespace sees, without
# any MXNet, numpy or Horovod they hold (deleted in the overlay only)
n=0
for folder in $(python3 -c "$SYSTEM_FOLDERS"); do
  [ -d "$folder" ] || continue  # a site folder that does not exist: pip does not write there
  n=$((n + 1)); mkdir -p "$WORK/upper$n" "$WORK/work$n"
  mount -t overlay overlay -o "lowerdir=$folder,upperdir=$WORK/upper$n,workdir=$WORK/work$n" \
    "$folder"
done
forget_packages() {
  local site
  for site in $(python3 -c 'import site; print(" ".join(site.getsitepackages()))'); do
    [ ! -d "$site" ] || rm -rf "$site"/numpy "$site"/numpy[-.]* "$site"/mxnet \\
      "$site"/mxnet-* "$site"/horovod "$site"/horovod-*
  done
}
forget_packages
# as into a container's Python; --ignore-installed: never uninstall (Debian's own
# packages have no RECORD)
system_pip() { "$PROJECT_PYTHON" -m pip --python "$(command -v python3)" install -q \
  --break-system-packages --ignore-installed "$@"; }
"""


def horovod_wheel() -> Path:
    """The Horovod wheel install.sh built for this venv's MXNet: a system Horovod with
    MXNet support, as an NGC container has one."""
    wheels = sorted((default_cache_dir() / "wheels").glob(
        f"horovod-*_mxnet-1.9.1_cp{sys.version_info[0]}{sys.version_info[1]}_*_gpu-none/*.whl"))
    assert wheels, "no Horovod wheel in the cache: run bash setup-utils/install.sh first"
    return wheels[0]


def system_scripts() -> dict[str, float]:
    """The system python3's scripts folder, name by modification time: what pip would
    change on the real disk if the overlays missed a folder."""
    folder = subprocess.run(["python3", "-c", "import sysconfig; print(sysconfig.get_path("
                             "'scripts'))"], env={**os.environ, "PATH": SYSTEM_PATH},
                            capture_output=True, text=True, timeout=60).stdout.strip()
    return {entry.name: entry.stat().st_mtime for entry in Path(folder).iterdir()}


def as_the_system(tmp_path: Path, script: str, timeout: float,
                  wheel: Path | None = None) -> subprocess.CompletedProcess:
    """`script` in a mount namespace of its own in which the system python3's packages
    are whatever `system_pip` installs there; the real folders stay as they were."""
    env = {"PATH": SYSTEM_PATH, "WORK": str(tmp_path), "REPO": str(REPO),
           "PROJECT_PYTHON": str(BIN / "python"), "HOROVOD_WHEEL": str(wheel or ""),
           "SYSTEM_FOLDERS": SYSTEM_FOLDERS}
    before = system_scripts()
    result = finish(start(["unshare", "--mount", "bash", "-c", IN_A_MOUNT_NAMESPACE + script],
                          env=env), timeout)
    assert system_scripts() == before, "the test changed the system's scripts folder"
    return result


def test_preinstalled_mxnet_is_used_as_it_is_and_check_passes(tmp_path):
    """The NGC route on a CPU: MXNet 1.9.1, numpy and a Horovod with MXNet support in the
    system python3's own site folder; install.sh makes a venv that uses them, installs
    our other pins beside them, and refuses later shadowing and a venv that cannot see
    them. Python 3.10 itself: Debian 12's archive has none (docs/installation.md)."""
    config = tmp_path / "cfg.py"
    config.write_text(f"rec = 'random'\nnum_classes = 20\nnetwork = 'tiny'\n"
                      f"output = '{tmp_path / 'out'}'\n")
    venv = tmp_path / "venv"
    result = as_the_system(tmp_path, f"""
system_pip mxnet==1.9.1 numpy==1.23.5
system_pip --no-deps "$HOROVOD_WHEEL"
export MXNET_PACKAGE=preinstalled VENV={venv}
bash "$REPO/setup-utils/install.sh"
echo "== the venv's own packages"
ls {venv}/lib/python3*/site-packages
echo "== what the venv imports"
{venv}/bin/python "$REPO/setup-utils/system_mxnet.py" 2>/dev/null
echo "== check"
{venv}/bin/horovodrun -np 2 -H localhost:2 --gloo {venv}/bin/python -m partial_fc_mx check {config}
echo "== again"
bash "$REPO/setup-utils/install.sh"
echo "== shadowed"
{venv}/bin/python -m pip install -q --no-deps --ignore-installed numpy==1.23.5
bash "$REPO/setup-utils/install.sh" && echo "NOT REFUSED"
echo "== the PyPI wheel into it"
MXNET_PACKAGE=mxnet bash "$REPO/setup-utils/install.sh" && echo "NOT REFUSED"
echo "== a venv without the system's packages"
python3 -m venv {tmp_path / 'plain'}
VENV={tmp_path / 'plain'} bash "$REPO/setup-utils/install.sh" && echo "NOT REFUSED"
echo "== end"
""", timeout=600, wheel=horovod_wheel())
    out = result.stdout
    assert result.returncode == 0 and "== end" in out, out[-4000:]
    sections = dict(part.split("\n", 1) for part in out.split("== ")[1:])
    own = sections["the venv's own packages"].split()
    assert not {"mxnet", "numpy", "horovod"} & set(own), own  # nothing installed over them
    assert "onnxruntime" in own and "tensorboardX" in own  # our other pins: in the venv
    imported = dict(line.split("=", 1) for line in sections["what the venv imports"].split())
    system_site = Path(imported["mxnet_dir"]).parent
    assert str(venv) not in system_site.as_posix() and imported["mxnet_version"] == "1.9.1"
    assert Path(imported["numpy_dir"]).parent == system_site == Path(imported["horovod_dir"]).parent
    assert "using the system's MXNet 1.9.1" in out and "Horovod 0.28.1" in out
    assert "done: Horovod v0.28.1 for MXNet; controllers: MPI, Gloo" in out
    assert "OK: no problems found" in sections["check"], sections["check"]
    assert "up to date" in sections["again"]
    shadowed = sections["shadowed"]
    assert "the venv's numpy is" in shadowed and "NOT REFUSED" not in shadowed
    pypi = sections["the PyPI wheel into it"]
    assert "sees the system's packages (made by MXNET_PACKAGE=preinstalled)" in pypi
    assert "NOT REFUSED" not in pypi
    plain = sections["a venv without the system's packages"]
    assert "was made without the system's packages" in plain and "NOT REFUSED" not in plain


def test_preinstalled_without_a_usable_mxnet_or_numpy_is_refused_by_name(tmp_path):
    """No MXNet, an MXNet that does not import (numpy 2), and a numpy our pins cannot
    work with (opencv-python-headless 4.11 needs 1.23.5 on Python 3.11; MXNet 1.9 stops
    at 1.23): each stops install.sh with the reason, the first two before any venv."""
    venv = tmp_path / "venv"
    result = as_the_system(tmp_path, f"""
export MXNET_PACKAGE=preinstalled VENV={venv}
echo "== none"
bash "$REPO/setup-utils/install.sh" && echo "NOT REFUSED"
[ -e {venv} ] && echo "VENV MADE"
echo "== numpy 2"
system_pip --no-deps mxnet==1.9.1 numpy==2.2.6
bash "$REPO/setup-utils/install.sh" && echo "NOT REFUSED"
[ -e {venv} ] && echo "VENV MADE"
echo "== numpy 1.23.4"
forget_packages
system_pip mxnet==1.9.1 numpy==1.23.4
bash "$REPO/setup-utils/install.sh" && echo "NOT REFUSED"
echo "== end"
""", timeout=300)
    out = result.stdout
    assert result.returncode == 0 and "== end" in out, out[-4000:]
    sections = dict(part.split("\n", 1) for part in out.split("== ")[1:])
    assert all("NOT REFUSED" not in text and "VENV MADE" not in text
               for text in sections.values()), out[-4000:]
    assert "has no mxnet; MXNET_PACKAGE=preinstalled uses the MXNet this interpreter" \
        in sections["none"]
    assert "has mxnet, but it does not import" in sections["numpy 2"]
    assert "could not install the pinned packages (above) beside numpy 1.23.4 of the system" \
        in sections["numpy 1.23.4"]
