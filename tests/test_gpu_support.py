"""What the preflight and install.sh say about GPUs: the fatbinary reader on a library
written here, the decision on injected compute capabilities, and the real commands
against a stand-in libcuda.so.1 (tests/fake_libcuda.c) that reports an H100."""

from __future__ import annotations

import importlib.util
import shutil
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import BIN, REPO, SYSTEM_PATH, mpirun_command, python_module, run

from partial_fc_mx.hardware import fatbinary, gpu_support
from partial_fc_mx.hardware.fatbinary import Fatbinary, library_fatbinaries, read_fatbinaries
from partial_fc_mx.hardware.gpu_support import (
    MXNET_191_WHEELS,
    Gpu,
    how_it_runs,
    render_table,
    verdict,
)

H100, A100 = "NVIDIA H100 80GB HBM3=9.0", "NVIDIA A100-SXM4-40GB=8.0"
REAL_MXNET = Path(importlib.util.find_spec("mxnet").origin).parent
CU117 = Fatbinary(sass=(50, 60, 70, 80, 86), ptx=())


def image(kind: int, arch: int, payload: bytes, header_size: int = 64) -> bytes:
    """One fatbinary image as nvcc lays it out: a header (kind, version, its size,
    padded payload size, payload size, ..., architecture at byte 28), then the payload
    padded to 8 bytes."""
    padded = payload + b"\0" * (-len(payload) % 8)
    header = struct.pack("<HHIQIIII", kind, 0x0101, header_size, len(padded),
                         len(payload), 0, 0, arch)
    return header.ljust(header_size, b"\0") + padded


def container(*images: bytes) -> bytes:
    body = b"".join(images)
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


SASS, PTX = 2, 1
AMPERE_WITH_PTX = container(image(SASS, 50, b"x" * 13), image(SASS, 80, b"y" * 8),
                            image(PTX, 80, b".version 7.0", header_size=80))
ADA_ONLY = container(image(SASS, 86, b"z" * 21))


def write_library(path: Path, *parts: bytes) -> Path:
    """A file shaped like a CUDA library: noise around the given fatbinaries, plus
    things that look like one and are not."""
    noise = np.random.default_rng(0).bytes
    stray_magic = struct.pack("<IHHQ", 0xBA55ED50, 7, 99, 5)  # wrong version and sizes
    truncated = container(image(SASS, 90, b"w" * 64))[:-10]  # runs past the end
    path.write_bytes(b"\x7fELF" + noise(1000) + stray_magic + b"".join(
        part + noise(333) for part in parts) + truncated)
    return path


def test_every_fatbinary_in_a_library_is_found_with_its_images(tmp_path):
    library = write_library(tmp_path / "libfake.so", AMPERE_WITH_PTX, ADA_ONLY,
                            AMPERE_WITH_PTX)
    assert read_fatbinaries(library.read_bytes()) == Counter({
        Fatbinary(sass=(50, 80), ptx=(80,)): 2, Fatbinary(sass=(86,), ptx=()): 1})
    assert read_fatbinaries(b"no GPU code here" * 100) == Counter()


def test_empty_and_unknown_containers_are_passed_over():
    empty = container()
    unknown_kind = container(image(0x40, 90, b"?" * 8))
    zero_sized = struct.pack("<IHHQ", 0xBA55ED50, 1, 16, 64) + bytes(64)  # image header size 0
    data = empty + unknown_kind + zero_sized + ADA_ONLY
    assert read_fatbinaries(data) == Counter({Fatbinary(sass=(86,), ptx=()): 1})


def test_the_parse_is_cached_until_the_library_changes(tmp_path, monkeypatch):
    library = write_library(tmp_path / "libfake.so", ADA_ONLY)
    cache = tmp_path / "cache"
    first = library_fatbinaries(library, cache)
    assert first == Counter({Fatbinary(sass=(86,), ptx=()): 1})
    reads = []
    real_read = fatbinary.read_fatbinaries
    monkeypatch.setattr(fatbinary, "read_fatbinaries",
                        lambda data: reads.append(1) or real_read(data))
    assert library_fatbinaries(library, cache) == first and not reads
    write_library(library, AMPERE_WITH_PTX)  # a reinstall: other size and mtime
    assert library_fatbinaries(library, cache) == Counter({Fatbinary((50, 80), (80,)): 1})
    assert len(reads) == 1
    for entry in cache.glob("*.json"):
        entry.write_text("{damaged")
    assert library_fatbinaries(library, cache) == Counter({Fatbinary((50, 80), (80,)): 1})
    assert len(reads) == 2


def test_a_cache_that_cannot_be_used_only_costs_time(tmp_path):
    library = write_library(tmp_path / "libfake.so", ADA_ONLY)
    expected = Counter({Fatbinary(sass=(86,), ptx=()): 1})
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    assert library_fatbinaries(library, not_a_directory) == expected
    cache = tmp_path / "cache"
    library_fatbinaries(library, cache)
    for entry in cache.glob("*.json"):  # an entry that cannot be read as a file
        entry.unlink()
        entry.mkdir()
    assert library_fatbinaries(library, cache) == expected


def test_a_library_that_cannot_be_read_is_a_problem_line_not_an_exception(monkeypatch):
    def unreadable(library, cache_dir):
        raise PermissionError(13, "Permission denied", str(library))

    monkeypatch.setattr(gpu_support, "library_fatbinaries", unreadable)
    [line] = gpu_support.installed_report()
    assert line.problem and line.text.startswith("cannot read ") and "libmxnet.so" in line.text
    assert "Permission denied" in line.text


@pytest.mark.parametrize("gpu, fatbinary, expected", [
    ((9, 0), CU117, None),  # H100/H200: no sm_9x SASS, no PTX
    ((10, 0), CU117, None),  # B200
    ((8, 9), CU117, "sass"),  # L40: sm_86 runs on 8.9 (same generation, newer)
    ((8, 0), CU117, "sass"),
    ((7, 5), CU117, "sass"),  # T4 runs sm_70
    ((3, 7), CU117, None),  # K80: older than every image
    ((9, 0), Fatbinary(sass=(80,), ptx=(80,)), "ptx"),  # the driver compiles compute_80
    ((8, 6), Fatbinary(sass=(90,), ptx=(90,)), None),  # PTX for a newer GPU cannot run
    ((10, 0), Fatbinary(sass=(90,), ptx=()), None),  # SASS never crosses a generation
    ((8, 0), Fatbinary(sass=(86,), ptx=()), None),  # nor runs on an older minor
    ((7, 0), Fatbinary(sass=(75,), ptx=()), None),
    ((7, 5), Fatbinary(sass=(75,), ptx=()), "sass"),
])
def test_which_code_a_gpu_can_run(gpu, fatbinary, expected):
    assert how_it_runs(gpu, fatbinary) == expected


def test_an_h100_is_refused_with_the_facts_and_the_options():
    line, problem = verdict(Gpu(0, "NVIDIA H100 80GB HBM3", (9, 0)),
                            MXNET_191_WHEELS["mxnet-cu117"].fatbinaries, "mxnet-cu117 1.9.1")
    assert problem is True
    assert line.startswith("GPU 0 (NVIDIA H100 80GB HBM3, compute capability 9.0) cannot run")
    assert "SASS for sm_50, sm_60, sm_70, sm_80, sm_86; PTX for none" in line
    assert "197 of its 197 fatbinaries have no code for 9.0" in line
    assert "A100/A30 (8.0)" in line and "built from source" in line
    assert "NGC MXNet container, built for Hopper (MXNET_PACKAGE=preinstalled)" in line
    blackwell, _ = verdict(Gpu(0, "NVIDIA B200", (10, 0)),
                           MXNET_191_WHEELS["mxnet-cu117"].fatbinaries, "mxnet-cu117 1.9.1")
    assert "NGC" not in blackwell  # built for Hopper: not known to run on 10.0


def test_one_fatbinary_without_code_is_enough_to_refuse():
    mostly_hopper = Counter({Fatbinary(sass=(80, 90), ptx=()): 3, CU117: 1})
    line, problem = verdict(Gpu(1, "H200", (9, 0)), mostly_hopper, "a build")
    assert problem and "1 of its 4 fatbinaries have no code for 9.0" in line
    assert "sm_90 (in 3 of 4)" in line
    line, problem = verdict(Gpu(1, "H200", (9, 0)), Counter({Fatbinary((80,), (80,)): 2}), "b")
    assert not problem and "supported through PTX" in line
    assert verdict(Gpu(2, "A10", (8, 6)), mostly_hopper, "a build") == (
        "GPU 2 (A10, compute capability 8.6): supported (SASS)", False)
    groups = Counter({Fatbinary((80,), ()): 5, Fatbinary((70, 80), ()): 7})  # both fail on 9.0
    assert "12 of its 12 fatbinaries" in verdict(Gpu(0, "H100", (9, 0)), groups, "c").text


def test_the_documented_table_is_what_the_wheels_hold():
    table = render_table(list(MXNET_191_WHEELS.values()))
    assert table in (REPO / "docs" / "installation.md").read_text()
    assert "| `mxnet-cu117` | 11.7 | >= 515.43.04 | sm_50, sm_60, sm_70, sm_80, sm_86 | none |" \
        in table


# ----- the commands, with a stand-in NVIDIA driver -----
def with_gpus(fake_driver: Path, tmp_path: Path, *gpus: str) -> dict:
    return {"LD_LIBRARY_PATH": str(fake_driver), "FAKE_CUDA_GPUS": ";".join(gpus),
            "PFC_CACHE_DIR": str(tmp_path / "cache")}


def installed_mxnet(site: Path, name: str, version: str, *fatbinaries: bytes) -> Path:
    """An installed MXNet as it is on a machine without its CUDA libraries: its
    libmxnet.so holding `fatbinaries` is there, `import mxnet` fails."""
    (site / "mxnet").mkdir(parents=True)
    (site / "mxnet" / "__init__.py").write_text(
        "raise OSError('libcudart.so.11.0: cannot open shared object file: "
        "No such file or directory')\n")
    shutil.copy(REAL_MXNET / "libinfo.py", site / "mxnet")  # how mxnet finds its library
    write_library(site / "mxnet" / "libmxnet.so", *fatbinaries)
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return site


@pytest.fixture
def gpu_wheel_without_cuda(tmp_path) -> Path:
    """mxnet-cu117 from PyPI (here: the wheel's fatbinary layout)."""
    cu117 = container(*(image(SASS, arch, b"k" * 40) for arch in CU117.sass))
    return installed_mxnet(tmp_path / "site", "mxnet-cu117", "1.9.1", cu117, cu117)


def test_a_preinstalled_build_with_hopper_code_is_judged_by_its_own_library(
        fake_driver, tmp_path):
    """MXNET_PACKAGE=preinstalled (an NGC container's MXNet, built from source): the
    verdict reads what its library holds, as for the wheels: sm_90 SASS runs on an H100,
    compute_90 PTX on a newer GPU, and the build is named by its own distribution."""
    hopper = container(image(SASS, 80, b"a" * 40), image(SASS, 90, b"h" * 40),
                       image(PTX, 90, b".version 8.4", header_size=80))
    site = installed_mxnet(tmp_path / "site", "mxnet", "1.9.1", hopper, hopper, hopper)
    env = {**with_gpus(fake_driver, tmp_path, H100, "NVIDIA B200=10.0", A100),
           "PYTHONPATH": str(site)}
    result = run(python_module("gpus"), env=env, timeout=60)
    assert result.returncode == 0, result.stdout
    assert result.stdout.splitlines() == [
        "GPU 0 (NVIDIA H100 80GB HBM3, compute capability 9.0): supported (SASS)",
        "GPU 1 (NVIDIA B200, compute capability 10.0): supported through PTX that the driver "
        "compiles at the first start (minutes; kept in ~/.nv/ComputeCache)",
        "GPU 2 (NVIDIA A100-SXM4-40GB, compute capability 8.0): supported (SASS)"]
    ampere_only = installed_mxnet(tmp_path / "ampere", "mxnet", "1.9.1",
                                  container(image(SASS, 80, b"a" * 40)))
    refused = run(python_module("gpus"), timeout=60,
                  env={**env, "PYTHONPATH": str(ampere_only)})
    assert refused.returncode == 3
    assert f"mxnet 1.9.1 ({ampere_only / 'mxnet' / 'libmxnet.so'}) has SASS for sm_80; PTX " \
        "for none" in refused.stdout
    assert "NGC" not in refused.stdout  # it may be the container's own build


def test_a_wheel_is_judged_before_it_is_installed(fake_driver, tmp_path):
    result = run(python_module("gpus", "--wheel", "mxnet-cu117"),
                 env=with_gpus(fake_driver, tmp_path, H100, A100), timeout=60)
    assert result.returncode == 3, result.stdout
    lines = result.stdout.splitlines()
    assert lines[0].startswith("PROBLEM: GPU 0 (NVIDIA H100 80GB HBM3, compute capability 9.0)"
                               " cannot run MXNet's kernels: mxnet-cu117 1.9.1 has SASS")
    assert lines[1] == "GPU 1 (NVIDIA A100-SXM4-40GB, compute capability 8.0): supported (SASS)"
    a100_only = run(python_module("gpus", "--wheel", "mxnet-cu112"),
                    env=with_gpus(fake_driver, tmp_path, A100), timeout=60)
    assert a100_only.returncode == 0, a100_only.stdout
    unknown = run(python_module("gpus", "--wheel", "mxnet-cu118"), timeout=60)
    assert unknown.returncode == 2 and "not an MXNet 1.9.1 GPU wheel" in unknown.stdout


def test_a_broken_driver_or_no_gpu_is_said_plainly(fake_driver, tmp_path):
    broken = {**with_gpus(fake_driver, tmp_path, H100), "FAKE_CUDA_INIT": "999"}
    for_a_gpu_wheel = run(python_module("gpus", "--wheel", "mxnet-cu117"), env=broken,
                          timeout=60)
    assert for_a_gpu_wheel.returncode == 3
    assert "PROBLEM: the CUDA driver failed: cuInit returned 999" in for_a_gpu_wheel.stdout
    cpu_build = run(python_module("gpus"), env=broken, timeout=60)  # the venv's CPU MXNet
    assert cpu_build.returncode == 0 and "PROBLEM" not in cpu_build.stdout
    assert "cuInit returned 999" in cpu_build.stdout and "is the CPU build" in cpu_build.stdout
    stub = {**with_gpus(fake_driver, tmp_path, H100), "FAKE_CUDA_INIT": "34"}  # build images
    stubbed = run(python_module("gpus", "--wheel", "mxnet-cu117"), env=stub, timeout=60)
    assert stubbed.returncode == 0 and "no NVIDIA driver on this host" in stubbed.stdout
    none = run(python_module("gpus"), env=with_gpus(fake_driver, tmp_path), timeout=60)
    assert none.returncode == 0 and "the NVIDIA driver sees none" in none.stdout
    no_driver = run(python_module("gpus", "--wheel", "mxnet-cu117"), timeout=60,
                    env={"PFC_CACHE_DIR": str(tmp_path / "cache")})
    assert no_driver.returncode == 0 and "no NVIDIA driver on this host" in no_driver.stdout


def test_the_preflight_names_the_gpu_problem_even_when_mxnet_cannot_load(
        fake_driver, tmp_path, gpu_wheel_without_cuda):
    config = tmp_path / "cfg.py"
    config.write_text(f"rec = 'random'\nnum_classes = 10\nnetwork = 'tiny'\n"
                      f"output = '{tmp_path / 'out'}'\n")
    env = {**with_gpus(fake_driver, tmp_path, H100), "PYTHONPATH": str(gpu_wheel_without_cuda)}
    result = run(python_module("check", str(config)), env=env, timeout=60)
    assert result.returncode == 1, result.stdout
    problems = [line for line in result.stdout.splitlines() if line.startswith("PROBLEM")]
    assert "libcudart.so.11.0: cannot open shared object file" in problems[0]
    library = gpu_wheel_without_cuda / "mxnet" / "libmxnet.so"
    assert problems[1].startswith(
        "PROBLEM: GPU 0 (NVIDIA H100 80GB HBM3, compute capability 9.0) cannot run MXNet's "
        f"kernels: mxnet-cu117 1.9.1 ({library}) has SASS for sm_50, sm_60, sm_70, sm_80, "
        "sm_86; PTX for none, so 2 of its 2 fatbinaries have no code for 9.0")
    assert len(problems) == 2


def test_the_preflight_says_once_per_host_that_a_cpu_build_leaves_gpus_unused(
        fake_driver, tmp_path):
    config = tmp_path / "cfg.py"
    config.write_text(f"rec = 'random'\nnum_classes = 10\nnetwork = 'tiny'\n"
                      f"output = '{tmp_path / 'out'}'\n")
    env = with_gpus(fake_driver, tmp_path, H100, A100)
    command = mpirun_command(2, ["-x", "LD_LIBRARY_PATH", "-x", "FAKE_CUDA_GPUS",
                                 "-x", "PFC_CACHE_DIR", *python_module("check", str(config))])
    result = run(command, env=env, timeout=180)
    assert result.returncode == 0, result.stdout
    h100 = [line for line in result.stdout.splitlines() if "(NVIDIA H100 80GB HBM3" in line]
    assert len(h100) == 1 and "is the CPU build; no MXNet 1.9.1 GPU wheel has code for it" \
        in h100[0]
    a100 = [line for line in result.stdout.splitlines() if "(NVIDIA A100-SXM4-40GB" in line]
    assert len(a100) == 1 and "the GPU wheels that run on it: mxnet-cu110, mxnet-cu111" \
        in a100[0]


def test_install_refuses_a_gpu_wheel_for_an_h100_before_installing_anything(
        fake_driver, tmp_path):
    """With the system's python3, not the project's venv: nothing is installed yet."""
    venv = tmp_path / "venv"
    env = {**with_gpus(fake_driver, tmp_path, H100), "MXNET_PACKAGE": "mxnet-cu117",
           "VENV": str(venv), "PATH": SYSTEM_PATH}
    result = run(["bash", str(REPO / "setup-utils" / "install.sh")], env=env, timeout=60)
    assert result.returncode == 1, result.stdout
    assert "PROBLEM: GPU 0 (NVIDIA H100 80GB HBM3, compute capability 9.0) cannot run" \
        in result.stdout
    assert "mxnet-cu117 cannot run on this machine's GPUs (the PROBLEM above); stopped " \
        "before installing anything" in result.stdout
    assert not venv.exists()


def test_the_installed_build_is_named_by_the_distribution_beside_it(
        gpu_wheel_without_cuda, tmp_path):
    """Not by any mxnet-cuXXX found elsewhere on sys.path (here: the venv's CPU mxnet)."""
    probe = ("from partial_fc_mx.hardware import gpu_support as g; print(g.mxnet_cuda_version())")
    cache = {"PFC_CACHE_DIR": str(tmp_path / "cache")}
    result = run([str(BIN / "python"), "-c", probe], timeout=60,
                 env={**cache, "PYTHONPATH": str(gpu_wheel_without_cuda)})
    assert result.stdout.strip() == "(11, 7)", result.stdout
    venv = run([str(BIN / "python"), "-c", probe], env=cache, timeout=60)
    assert venv.stdout.strip() == "None", venv.stdout


def test_the_preflight_refuses_an_h100_on_every_rank(fake_driver, tmp_path):
    """MXNet that imports, whose library (found through MXNET_LIBRARY_PATH, as
    `import mxnet` finds it) has cu117's kernels: the real CPU library with cu117's
    fatbinary layout appended, which the dynamic loader ignores."""
    library = tmp_path / "libmxnet.so"
    shutil.copy(REAL_MXNET / "libmxnet.so", library)
    cu117 = container(*(image(SASS, arch, b"k" * 40) for arch in CU117.sass))
    with open(library, "ab") as appended:
        appended.write(cu117 * 3)
    config = tmp_path / "cfg.py"
    config.write_text(f"rec = 'random'\nnum_classes = 10\nnetwork = 'tiny'\n"
                      f"output = '{tmp_path / 'out'}'\n")
    env = {**with_gpus(fake_driver, tmp_path, H100), "MXNET_LIBRARY_PATH": str(library),
           "LD_LIBRARY_PATH": f"{fake_driver}:{REAL_MXNET}"}  # and the BLAS it links
    command = mpirun_command(2, ["-x", "LD_LIBRARY_PATH", "-x", "FAKE_CUDA_GPUS",
                                 "-x", "PFC_CACHE_DIR", "-x", "MXNET_LIBRARY_PATH",
                                 *python_module("check", str(config))])
    result = run(command, env=env, timeout=180)
    assert result.returncode == 1, result.stdout
    problems = [line for line in result.stdout.splitlines() if line.startswith("PROBLEM")]
    assert len(problems) == 1, result.stdout  # the same problem on both ranks: one line
    assert problems[0].startswith("PROBLEM: rank 0 (")
    assert ", rank 1 (" in problems[0]
    assert (f"GPU 0 (NVIDIA H100 80GB HBM3, compute capability 9.0) cannot run MXNet's "
            f"kernels: mxnet 1.9.1 ({library}) has SASS for sm_50, sm_60, sm_70, sm_80, "
            "sm_86; PTX for none, so 3 of its 3 fatbinaries") in problems[0]
    assert "1 problem(s) found" in result.stdout
