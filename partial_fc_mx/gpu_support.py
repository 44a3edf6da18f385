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
is installed, and the preflight runs it before MXNet is imported (a GPU wheel
without its CUDA libraries does not import).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .fatbinary import Fatbinary, library_fatbinaries, wheel_fatbinaries


def default_cache_dir() -> Path:
    """The cache install.sh uses for Horovod wheels (PFC_CACHE_DIR overrides it)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(os.environ.get("PFC_CACHE_DIR") or Path(base) / "partial_fc_mx")


def installed_libmxnet() -> Path | None:
    """libmxnet.so of the installed MXNet, found without importing MXNet."""
    spec = importlib.util.find_spec("mxnet")
    if spec is None or not spec.submodule_search_locations:
        return None
    library = Path(next(iter(spec.submodule_search_locations))) / "libmxnet.so"
    return library if library.is_file() else None


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    capability: tuple[int, int]

    def __str__(self) -> str:
        return (f"GPU {self.index} ({self.name}, compute capability "
                f"{self.capability[0]}.{self.capability[1]})")


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
    driver; None when there is no NVIDIA driver."""
    cuda = libcuda()
    if cuda is None:
        return None
    status = cuda.cuInit(0)
    if status == 100:  # CUDA_ERROR_NO_DEVICE, also when CUDA_VISIBLE_DEVICES is empty
        return []
    count, name = ctypes.c_int(), ctypes.create_string_buffer(256)
    major, minor = ctypes.c_int(), ctypes.c_int()
    if status != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        raise GpuQueryError(f"the CUDA driver did not start (cuInit returned {status}); "
                            "`nvidia-smi` shows whether the driver and the GPUs are healthy")
    gpus = []
    for index in range(count.value):
        device = ctypes.c_int()
        cuda.cuDeviceGet(ctypes.byref(device), index)
        cuda.cuDeviceGetName(name, len(name), device)
        cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, device)  # COMPUTE_CAPABILITY_MAJOR
        cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, device)  # COMPUTE_CAPABILITY_MINOR
        gpus.append(Gpu(index, name.value.decode(errors="replace"), (major.value, minor.value)))
    return gpus


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


def verdict(gpu: Gpu, fatbinaries: Counter[Fatbinary], build: str) -> tuple[str, bool]:
    """One line on whether `build` (e.g. 'mxnet-cu117 1.9.1 (path)') runs on `gpu`, and
    whether that is a problem (see `runs_on`)."""
    ways = Counter({how_it_runs(gpu.capability, f): n for f, n in fatbinaries.items()})
    cap = f"{gpu.capability[0]}.{gpu.capability[1]}"
    if runs_on(gpu.capability, fatbinaries):
        if "ptx" in ways:
            return (f"{gpu}: supported through PTX that the driver compiles at the first "
                    "start (minutes; kept in ~/.nv/ComputeCache)", False)
        return f"{gpu}: supported (SASS)", False
    return (f"{gpu} cannot run MXNet's kernels: {build} has {describe_archs(fatbinaries)}, "
            f"so {ways[None]} of its {sum(ways.values())} fatbinaries have no code for {cap} "
            "and the first such kernel would fail with 'no kernel image is available for "
            f"execution on the device'. Options: GPUs it has code for "
            f"({supported_examples(fatbinaries)}), or MXNet built from source with a CUDA "
            f"that knows {cap} (README: 'Hopper and newer GPUs')", True)


EXAMPLE_GPUS = {  # compute capability -> GPUs users rent or own
    (3, 5): "K20/K40", (3, 7): "K80", (5, 0): "GTX 750", (5, 2): "GTX 9xx/M40",
    (6, 0): "P100", (6, 1): "GTX 10xx/P40", (7, 0): "V100", (7, 5): "T4/RTX 20xx",
    (8, 0): "A100/A30", (8, 6): "A10/A40/RTX 30xx", (8, 9): "L4/L40/RTX 40xx",
    (9, 0): "H100/H200", (10, 0): "B200", (12, 0): "RTX 50xx/RTX PRO 6000",
}


def supported_examples(fatbinaries: Counter[Fatbinary]) -> str:
    runs = [cap for cap in EXAMPLE_GPUS if runs_on(cap, fatbinaries)]
    return ", ".join(f"{EXAMPLE_GPUS[cap]} ({cap[0]}.{cap[1]})" for cap in runs) or "none"


DRIVER_FOR_CUDA = {  # the Linux driver each CUDA release (GA) requires, from its release notes
    "10.1": "418.39", "10.2": "440.33", "11.0": "450.51.05", "11.1": "455.23",
    "11.2": "460.27.03", "11.3": "465.19.01", "11.4": "470.42.01", "11.5": "495.29.05",
    "11.6": "510.39.01", "11.7": "515.43.04",
}


@dataclass(frozen=True)
class Wheel:
    package: str  # mxnet-cu117
    fatbinaries: Counter[Fatbinary]

    @property
    def cuda(self) -> str:
        digits = self.package.removeprefix("mxnet-cu")
        return f"{digits[:-1]}.{digits[-1]}"


def wheel_from_file(path: Path) -> Wheel:
    return Wheel(Path(path).name.split("-")[0].replace("_", "-"), wheel_fatbinaries(path))


# What `python -m partial_fc_mx gpus --table mxnet_cu*-1.9.1-*.whl` read from every
# MXNet 1.9.1 GPU wheel on PyPI (docs/gpu.md): per wheel, ((SASS, PTX), how many
# fatbinaries). install.sh decides with it before a wheel is downloaded; the preflight
# reads the installed library itself.
MXNET_191_WHEELS = {package: Wheel(package, Counter({Fatbinary(*images): n for images, n in sets}))
                    for package, sets in {
    "mxnet-cu101": [(((30, 50, 60, 70, 75), ()), 198),
                    (((35, 37, 50, 52, 60, 61, 70, 75), (75,)), 1)],
    "mxnet-cu102": [(((30, 50, 60, 70, 75), ()), 198)],
    "mxnet-cu110": [(((50, 60, 70, 80), ()), 198)],
    "mxnet-cu111": [(((50, 60, 70, 80, 86), ()), 197)],
    "mxnet-cu112": [(((50, 60, 70, 80, 86), ()), 198)],
    "mxnet-cu113": [(((50, 60, 70, 80, 86), ()), 197)],
    "mxnet-cu114": [(((50, 60, 70, 80, 86), ()), 197)],
    "mxnet-cu115": [(((50, 60, 70, 80, 86), ()), 197)],
    "mxnet-cu116": [(((50, 60, 70, 80, 86), ()), 197)],
    "mxnet-cu117": [(((50, 60, 70, 80, 86), ()), 197)],
}.items()}


def render_table(wheels: list[Wheel]) -> str:
    """The README's GPU support table."""
    rows = ["| wheel (1.9.1) | CUDA | driver (Linux) | SASS | PTX | GPUs it runs on |",
            "|---|---|---|---|---|---|"]
    for wheel in wheels:
        archs = describe_archs(wheel.fatbinaries).split("; ")
        rows.append(f"| `{wheel.package}` | {wheel.cuda} | >= {DRIVER_FOR_CUDA[wheel.cuda]} "
                    f"| {archs[0].removeprefix('SASS for ')} | {archs[1].removeprefix('PTX for ')} "
                    f"| {supported_examples(wheel.fatbinaries)} |")
    return "\n".join(rows)


def mxnet_distribution(library: Path) -> tuple[str, str] | None:
    """(name, version) of the MXNet installed beside `library`: ('mxnet-cu117', '1.9.1')."""
    for dist in importlib.metadata.distributions(path=[str(library.parent.parent)]):
        name = dist.metadata["Name"] or ""
        if name == "mxnet" or name.startswith("mxnet-cu"):
            return name, dist.version
    return None


def mxnet_cuda_version() -> tuple[int, int] | None:
    """(11, 2) for an mxnet-cu112 install, None for the CPU build."""
    library = installed_libmxnet()
    installed = mxnet_distribution(library) if library else None
    match = re.fullmatch(r"mxnet-cu(\d+)(\d)", installed[0]) if installed else None
    return (int(match.group(1)), int(match.group(2))) if match else None


def installed_build() -> tuple[str, Counter[Fatbinary]] | None:
    """('mxnet-cu117 1.9.1 (/path/libmxnet.so)', its fatbinaries), None without MXNet."""
    library = installed_libmxnet()
    if library is None:
        return None
    installed = mxnet_distribution(library)
    build = f"{installed[0]} {installed[1]} ({library})" if installed else str(library)
    return build, library_fatbinaries(library, default_cache_dir())


def gpu_report(build: str, fatbinaries: Counter[Fatbinary]) -> list[tuple[str, bool]]:
    """(line, is a problem) for each GPU this process sees, judged against `build`."""
    try:
        gpus = visible_gpus()
    except GpuQueryError as error:
        return [(str(error), True)]
    if gpus is None:
        return [("GPUs: no NVIDIA driver on this host", False)]
    if not gpus:
        return [("GPUs: the NVIDIA driver sees none (CUDA_VISIBLE_DEVICES="
                 f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')})", False)]
    if not fatbinaries:
        return [(f"{gpu} is not used: {build} is the CPU build; "
                 f"{wheel_advice(gpu)}", False) for gpu in gpus]
    return [verdict(gpu, fatbinaries, build) for gpu in gpus]


def print_report(lines: list[tuple[str, bool]]) -> int:
    """Print `gpu_report`'s lines, problems marked as the preflight marks them; the exit code."""
    for line, problem in lines:
        print(f"PROBLEM: {line}" if problem else line)
    return 1 if any(problem for _, problem in lines) else 0


def wheel_advice(gpu: Gpu) -> str:
    runs = [w.package for w in MXNET_191_WHEELS.values() if runs_on(gpu.capability, w.fatbinaries)]
    if runs:
        return f"the GPU wheels that run on it: {', '.join(runs)} (MXNET_PACKAGE=...)"
    return "no MXNet 1.9.1 GPU wheel has code for it (README: 'Hopper and newer GPUs')"
