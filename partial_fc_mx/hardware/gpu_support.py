"""Which NVIDIA GPUs the installed MXNet can drive, told before a user installs for an
hour and fails at the first kernel.

A CUDA library carries its GPU code in fatbinaries, one per compiled source file.
Each holds images: SASS for one architecture (machine code; runs on GPUs of that
major generation with the same or a higher minor number, so sm_80 runs on 8.6 and
sm_86 on 8.9) or PTX (the driver compiles it for any GPU at least that new, once,
at the first start). MXNet's last wheels (1.9.1, 2022) carry SASS up to sm_86 and
no PTX, so Hopper (9.0) and newer GPUs cannot run their kernels: the failure would
be "no kernel image is available for execution on the device".

Standard library only: install.sh runs this with the system Python before anything
is installed, and it never imports MXNet (a GPU wheel without its CUDA libraries
does not import, and the preflight must still say what is wrong).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import re
import tempfile
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from ..caches import default_cache_dir
from ..errors import UserError
from .fatbinary import Fatbinary, library_fatbinaries, wheel_fatbinaries

CUDA_ERROR_NO_DEVICE, CUDA_ERROR_STUB_LIBRARY = 100, 34
COMPUTE_CAPABILITY_MAJOR, COMPUTE_CAPABILITY_MINOR = 75, 76  # cuDeviceGetAttribute


class Line(NamedTuple):
    """One line of a GPU report; `problem` lines stop the preflight and install.sh."""

    text: str
    problem: bool = False


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    capability: tuple[int, int]
    bus_id: str = ""
    """Its PCI bus id, the same in every process that sees this GPU ("" if unknown)."""

    def __str__(self) -> str:
        return (f"GPU {self.index} ({self.name}, compute capability "
                f"{self.capability[0]}.{self.capability[1]})")


# ----- what the machine has -----
class GpuQueryError(RuntimeError):
    """The NVIDIA driver is installed but could not list the GPUs."""


def libcuda() -> ctypes.CDLL | None:
    """The NVIDIA driver's library; None on a machine without the driver."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def cuda_driver_version() -> tuple[int, int] | None:
    """The newest CUDA the installed NVIDIA driver supports, or None without a driver."""
    cuda, version = libcuda(), ctypes.c_int()
    if cuda is None or cuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return version.value // 1000, (version.value % 1000) // 10


def visible_gpus() -> list[Gpu] | None:
    """The GPUs this process may use (CUDA_VISIBLE_DEVICES applies), asked of the CUDA
    driver; None when there is no NVIDIA driver (or only the stub library that
    build containers carry)."""
    cuda = libcuda()
    if cuda is None:
        return None

    def call(function: str, *args) -> None:
        status = getattr(cuda, function)(*args)
        if status != 0:
            raise GpuQueryError(f"the CUDA driver failed: {function} returned {status}; "
                                "`nvidia-smi` shows whether the driver and the GPUs are healthy")

    status = cuda.cuInit(0)
    if status == CUDA_ERROR_STUB_LIBRARY:
        return None
    if status == CUDA_ERROR_NO_DEVICE:  # also when CUDA_VISIBLE_DEVICES is empty
        return []
    call("cuInit", 0)
    count = ctypes.c_int()
    call("cuDeviceGetCount", ctypes.byref(count))
    gpus = []
    for index in range(count.value):
        device, name = ctypes.c_int(), ctypes.create_string_buffer(256)
        major, minor = ctypes.c_int(), ctypes.c_int()
        call("cuDeviceGet", ctypes.byref(device), index)
        call("cuDeviceGetName", name, len(name), device)
        call("cuDeviceGetAttribute", ctypes.byref(major), COMPUTE_CAPABILITY_MAJOR, device)
        call("cuDeviceGetAttribute", ctypes.byref(minor), COMPUTE_CAPABILITY_MINOR, device)
        bus_id = ctypes.create_string_buffer(64)
        if cuda.cuDeviceGetPCIBusId(bus_id, len(bus_id), device) != 0:
            bus_id.value = b""
        gpus.append(Gpu(index, name.value.decode(errors="replace"), (major.value, minor.value),
                        bus_id.value.decode(errors="replace")))
    return gpus


# ----- what a build can run on -----
def capability(arch: int) -> tuple[int, int]:
    """86 -> (8, 6), 120 -> (12, 0): how fatbinaries and nvcc number architectures."""
    return arch // 10, arch % 10


def how_it_runs(gpu: tuple[int, int], fatbinary: Fatbinary) -> str | None:
    """'sass', 'ptx' (compiled by the driver at the first start) or None (cannot run)."""
    if any(capability(a)[0] == gpu[0] and capability(a) <= gpu for a in fatbinary.sass):
        return "sass"
    if any(capability(a) <= gpu for a in fatbinary.ptx):
        return "ptx"
    return None


def runs_on(gpu: tuple[int, int], fatbinaries: Counter[Fatbinary]) -> bool:
    """Every fatbinary has code the GPU can run: a kernel without one fails when it is
    first launched, hours into a run."""
    return bool(fatbinaries) and all(how_it_runs(gpu, f) for f in fatbinaries)


def describe_archs(fatbinaries: Counter[Fatbinary]) -> str:
    """'SASS for sm_50, sm_80; PTX for none': an architecture that only some fatbinaries
    have code for says in how many, e.g. 'sm_35 (in 1 of 199)'."""
    total = sum(fatbinaries.values())

    def listed(kind: str, prefix: str) -> str:
        having: Counter[int] = Counter()
        for fatbinary, count in fatbinaries.items():
            having.update({arch: count for arch in getattr(fatbinary, kind)})
        return ", ".join(f"{prefix}_{arch}" + (f" (in {n} of {total})" if n < total else "")
                         for arch, n in sorted(having.items())) or "none"

    if not total:
        return "no GPU code (a CPU build)"
    return f"SASS for {listed('sass', 'sm')}; PTX for {listed('ptx', 'compute')}"


def verdict(gpu: Gpu, fatbinaries: Counter[Fatbinary], build: str) -> Line:
    """Whether `build` (e.g. 'mxnet-cu117 1.9.1 (path)') runs on `gpu` (see `runs_on`)."""
    ways: Counter[str | None] = Counter()
    for fatbinary, count in fatbinaries.items():
        ways[how_it_runs(gpu.capability, fatbinary)] += count
    if runs_on(gpu.capability, fatbinaries):
        if ways["ptx"]:
            return Line(f"{gpu}: supported through PTX that the driver compiles at the first "
                        "start (minutes; kept in ~/.nv/ComputeCache)")
        return Line(f"{gpu}: supported (SASS)")
    cap = f"{gpu.capability[0]}.{gpu.capability[1]}"
    container = (", NVIDIA's NGC MXNet container, built for Hopper (MXNET_PACKAGE=preinstalled)"
                 if gpu.capability[0] == 9 and build.startswith("mxnet-cu") else "")
    return Line(f"{gpu} cannot run MXNet's kernels: {build} has {describe_archs(fatbinaries)}, "
                f"so {ways[None]} of its {sum(ways.values())} fatbinaries have no code for "
                f"{cap} and the first such kernel would fail with 'no kernel image is available "
                f"for execution on the device'. Options: GPUs it has code for "
                f"({supported_examples(fatbinaries)}){container}, or MXNet built from source "
                f"with a CUDA that knows {cap} (docs/installation.md: 'Hopper and newer GPUs')",
                problem=True)


EXAMPLE_GPUS = {  # compute capability -> GPUs users rent or own
    (3, 5): "K20/K40", (3, 7): "K80", (5, 0): "GTX 750", (5, 2): "GTX 9xx/M40",
    (6, 0): "P100", (6, 1): "GTX 10xx/P40", (7, 0): "V100", (7, 5): "T4/RTX 20xx",
    (8, 0): "A100/A30", (8, 6): "A10/A40/RTX 30xx", (8, 9): "L4/L40/RTX 40xx",
    (9, 0): "H100/H200", (10, 0): "B200", (12, 0): "RTX 50xx/RTX PRO 6000",
}


def supported_examples(fatbinaries: Counter[Fatbinary]) -> str:
    """The well-known GPUs these fatbinaries run on, e.g. 'V100 (7.0), A100/A30 (8.0)'."""
    runs = [cap for cap in EXAMPLE_GPUS if runs_on(cap, fatbinaries)]
    return ", ".join(f"{EXAMPLE_GPUS[cap]} ({cap[0]}.{cap[1]})" for cap in runs) or "none"


# ----- MXNet's GPU wheels -----
DRIVER_FOR_CUDA = {  # the Linux driver each CUDA release (GA) requires, from its release notes
    (10, 1): "418.39", (10, 2): "440.33", (11, 0): "450.51.05", (11, 1): "455.23",
    (11, 2): "460.27.03", (11, 3): "465.19.01", (11, 4): "470.42.01", (11, 5): "495.29.05",
    (11, 6): "510.39.01", (11, 7): "515.43.04",
}


def cuda_of(package: str) -> tuple[int, int] | None:
    """(11, 7) for mxnet-cu117, None for mxnet (the CPU build)."""
    match = re.fullmatch(r"mxnet[-_]cu(\d+)(\d)", package)
    return (int(match.group(1)), int(match.group(2))) if match else None


def driver_for(cuda: tuple[int, int]) -> str:
    """'>= 515.43.04' for CUDA 11.7; what NVIDIA's release notes say for versions not listed."""
    known = DRIVER_FOR_CUDA.get(cuda)
    return f">= {known}" if known else f"see the CUDA {cuda[0]}.{cuda[1]} release notes"


@dataclass(frozen=True)
class Wheel:
    package: str
    """mxnet-cu117"""
    fatbinaries: Counter[Fatbinary]


def wheel_from_file(path: Path) -> Wheel:
    """A downloaded mxnet_cuXXX-*.whl, read (its libmxnet.so is about 900 MB)."""
    package = Path(path).name.split("-")[0].replace("_", "-")
    if cuda_of(package) is None:
        raise ValueError(f"{path} is not an MXNet GPU wheel (mxnet_cuXXX-*.whl)")
    return Wheel(package, wheel_fatbinaries(path))


def recorded(package: str, *fatbinaries: tuple[tuple[int, ...], tuple[int, ...], int]) -> Wheel:
    """A wheel as `wheel_from_file` read it: (SASS, PTX, how many fatbinaries) each."""
    return Wheel(package, Counter({Fatbinary(sass, ptx): n for sass, ptx, n in fatbinaries}))


# What `python -m partial_fc_mx gpus --table mxnet_cu*-1.9.1-*.whl` read from every
# MXNet 1.9.1 GPU wheel on PyPI (docs/gpu.md). install.sh decides with it before a
# wheel is downloaded; the preflight reads the installed library itself.
MXNET_191_WHEELS = {wheel.package: wheel for wheel in (
    recorded("mxnet-cu101", ((30, 50, 60, 70, 75), (), 198),
             ((35, 37, 50, 52, 60, 61, 70, 75), (75,), 1)),
    recorded("mxnet-cu102", ((30, 50, 60, 70, 75), (), 198)),
    recorded("mxnet-cu110", ((50, 60, 70, 80), (), 198)),
    recorded("mxnet-cu111", ((50, 60, 70, 80, 86), (), 197)),
    recorded("mxnet-cu112", ((50, 60, 70, 80, 86), (), 198)),
    recorded("mxnet-cu113", ((50, 60, 70, 80, 86), (), 197)),
    recorded("mxnet-cu114", ((50, 60, 70, 80, 86), (), 197)),
    recorded("mxnet-cu115", ((50, 60, 70, 80, 86), (), 197)),
    recorded("mxnet-cu116", ((50, 60, 70, 80, 86), (), 197)),
    recorded("mxnet-cu117", ((50, 60, 70, 80, 86), (), 197)),
)}


def render_table(wheels: list[Wheel]) -> str:
    """The GPU support table of docs/installation.md."""
    rows = ["| wheel (1.9.1) | CUDA | driver (Linux) | SASS | PTX | GPUs it runs on |",
            "|---|---|---|---|---|---|"]
    for wheel in wheels:
        sass, ptx = describe_archs(wheel.fatbinaries).split("; ")
        cuda = cuda_of(wheel.package)
        rows.append(f"| `{wheel.package}` | {cuda[0]}.{cuda[1]} | {driver_for(cuda)} "
                    f"| {sass.removeprefix('SASS for ')} | {ptx.removeprefix('PTX for ')} "
                    f"| {supported_examples(wheel.fatbinaries)} |")
    return "\n".join(rows)


def wheel_advice(gpu: Gpu) -> str:
    """Which GPU wheels would run on `gpu`, for a user who installed the CPU build."""
    runs = [w.package for w in MXNET_191_WHEELS.values() if runs_on(gpu.capability, w.fatbinaries)]
    if runs:
        return f"the GPU wheels that run on it: {', '.join(runs)} (MXNET_PACKAGE=...)"
    container = ("; NVIDIA's NGC MXNet container is built for Hopper (MXNET_PACKAGE="
                 "preinstalled)" if gpu.capability[0] == 9 else "")
    return (f"no MXNet 1.9.1 GPU wheel has code for it{container} (docs/installation.md: "
            "'Hopper and newer GPUs')")


# ----- the installed MXNet -----
def mxnet_package() -> Path | None:
    """The installed mxnet package's directory, found without importing it."""
    spec = importlib.util.find_spec("mxnet")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def installed_libmxnet(package: Path) -> Path | None:
    """The libmxnet.so that `import mxnet` loads, found by MXNet's own search
    (mxnet/libinfo.py: MXNET_LIBRARY_PATH, LD_LIBRARY_PATH, the package, a source
    tree's lib/ and build/), run from its file: importing mxnet may be what fails."""
    module_spec = importlib.util.spec_from_file_location("mxnet_libinfo", package / "libinfo.py")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
        return Path(module.find_lib_path()[0])
    except (OSError, RuntimeError):  # no libinfo.py, or no library where it looks
        return None


def mxnet_distribution(package: Path) -> tuple[str, str] | None:
    """(name, version) of the distribution installed beside `package`, e.g.
    ('mxnet-cu117', '1.9.1'); install.sh keeps one MXNet variant installed at a time."""
    for dist in importlib.metadata.distributions(path=[str(package.parent)]):
        name = dist.metadata["Name"] or ""
        if name == "mxnet" or cuda_of(name):
            return name, dist.version
    return None


def mxnet_cuda_version() -> tuple[int, int] | None:
    """(11, 2) for an mxnet-cu112 install, None for the CPU build."""
    package = mxnet_package()
    installed = mxnet_distribution(package) if package else None
    return cuda_of(installed[0]) if installed else None


def installed_report() -> list[Line]:
    """The GPU report for the installed MXNet; never raises for what it finds (every
    rank of the preflight must reach its next collective)."""
    package = mxnet_package()
    library = installed_libmxnet(package) if package else None
    if library is None:
        return [Line("MXNet or its library (libmxnet.so) was not found where `import mxnet` "
                     "looks; run `bash setup-utils/install.sh`", problem=True)]
    installed = mxnet_distribution(package)
    build = f"{installed[0]} {installed[1]} ({library})" if installed else str(library)
    try:
        cache = default_cache_dir()
    except RuntimeError:  # no home folder: the table is read again each time
        cache = Path(tempfile.gettempdir()) / f"partial_fc_mx-{os.getuid()}"
    try:
        fatbinaries = library_fatbinaries(library, cache)
    except OSError as error:
        return [Line(f"cannot read {library} to see which GPUs it supports: {error}",
                     problem=True)]
    return gpu_report(build, fatbinaries)


def gpu_report(build: str, fatbinaries: Counter[Fatbinary]) -> list[Line]:
    """A line for each GPU this process sees, judged against `build`."""
    cpu_build = not fatbinaries
    try:
        gpus = visible_gpus()
    except GpuQueryError as error:  # a problem only for a build that needs the GPUs
        return [Line(f"{error}" + (f" ({build} is the CPU build)" if cpu_build else ""),
                     problem=not cpu_build)]
    if gpus is None:
        return [Line("GPUs: no NVIDIA driver on this host")]
    if not gpus:
        return [Line("GPUs: the NVIDIA driver sees none (CUDA_VISIBLE_DEVICES="
                     f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')})")]
    if cpu_build:
        return [Line(f"{gpu} is not used: {build} is the CPU build; {wheel_advice(gpu)}")
                for gpu in gpus]
    return [verdict(gpu, fatbinaries, build) for gpu in gpus]


def print_lines(lines: list[Line]) -> None:
    """Problems marked as the preflight marks them."""
    for line in lines:
        print(f"PROBLEM: {line.text}" if line.problem else line.text)


def gpus_report(wheel: str | None, table: list[str] | None) -> int:
    """Prints which GPUs an MXNet build can run on: the installed one, a GPU wheel by
    name, or the table of docs/installation.md from wheel files. Returns 0 when every GPU
    can run the build, 3 when one cannot (install.sh refuses on exactly that)."""
    if table is not None:
        try:
            wheels = ([wheel_from_file(Path(path)) for path in table]
                      or list(MXNET_191_WHEELS.values()))
        except (OSError, KeyError, ValueError, zipfile.BadZipFile) as error:
            raise UserError(f"cannot read the wheel: {error}") from error
        print(render_table(wheels))
        return 0
    if wheel is None:
        lines = installed_report()
    elif wheel in MXNET_191_WHEELS:
        lines = gpu_report(f"{wheel} 1.9.1", MXNET_191_WHEELS[wheel].fatbinaries)
    else:
        raise UserError(f"{wheel} is not an MXNet 1.9.1 GPU wheel; choose one of "
                        f"{', '.join(MXNET_191_WHEELS)}")
    print_lines(lines)
    return 3 if any(line.problem for line in lines) else 0
