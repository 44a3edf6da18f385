"""Preflight: `python -m partial_fc_mx check [CONFIG]`, alone or under any launcher.

It answers, before hours of queueing are spent, the questions a failed start
would otherwise answer one at a time: is MXNet/Horovod built with what the run
needs, did the launcher start the processes on the hosts and devices intended,
are the data files there on every host, and will the class-center shards fit.
Without a config it checks the environment alone (build, MPI, processes, devices).
Each problem is one line that says how to fix it; every rank exits non-zero.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

import horovod
import horovod.mxnet as hvd
import mxnet as mx
import psutil

from .. import dist
from ..config import Config
from ..data import DataError
from ..errors import UserError
from ..hardware import gpu_support
from ..pfc import kernels
from ..run import cpu_precision, workdir
from ..run.checkpoint import CheckpointError, find_resumable
from ..run.data_source import open_dataset
from .memory import CLOSE, GiB, RunMemory, estimate_run_memory


@dataclass
class RankInfo:
    """What one process learns about itself; gathered to every rank."""

    rank: int
    local_rank: int
    local_size: int
    host: str
    device: str
    gpu: tuple[str, str] | None
    """(host, PCI bus id) of its GPU (dist.gpu_identity)."""
    free_memory: int | None
    memory_need: RunMemory | None
    gpus: list[str]  # one line per GPU this process sees: can the installed MXNet run on it
    problems: list[str]


def run_check(config: Config | None, checkpoint: str | None = None,
              weights_only: bool = False) -> int:
    """Print the report on rank 0; return the exit code every rank should use.
    `config` None: the environment alone. `checkpoint`: what --resume-from/--load-from
    names, checked to verify as that option takes it (`weights_only`: --load-from)."""
    world = dist.init()
    mine = []  # this rank's problems: every rank reports its own, none raises alone
    try:
        ctx, gpu = dist.own_device(world.local_rank)
    except (dist.DeviceError, gpu_support.GpuQueryError) as error:
        ctx, gpu, mine = None, None, [str(error)]
    if ctx is not None and ctx.device_type == "cpu":
        try:  # Partial FC's row passes on the CPU, built on first use
            kernels.load()
        except kernels.KernelBuildError as error:  # load() wraps MXNet's own refusal too
            mine.append(str(error))
    need = precision = None
    if config is not None:
        try:  # what training refuses at start on this many processes
            config.check_world_size(world.size)
        except UserError as error:
            mine.append(str(error))
        precision = agreed_precision(config, ctx, mine)
        try:
            need = estimate_run_memory(config, world.size, world.rank,
                                       precision.dtype if precision else "float32",
                                       ctx.device_type)
        except (UserError, mx.base.MXNetError) as error:
            mine.append(f"cannot estimate the memory of this run: {error}")
    free, memory_problems = free_memory(ctx, world.local_size)
    info = RankInfo(
        world.rank, world.local_rank, world.local_size, socket.gethostname(),
        str(ctx) if ctx else "none", gpu, free, need, [], mine + memory_problems,
    )
    for line in gpu_support.installed_report():
        (info.problems if line.problem else info.gpus).append(line.text)
    info.problems += check_gpu_driver()
    if config is not None:
        dataset_problems, fingerprint = check_dataset(config)
        info.problems += dataset_problems
        if free is not None and need is not None:
            info.problems += check_memory(need, free)
    everyone = dist.allgather_object(info, name="preflight")
    problems = [f"rank {i.rank} ({i.host}): {p}" for i in everyone for p in i.problems]
    problems = deduplicate_across_ranks(problems)
    kinds = [i.device.split("(")[0] for i in everyone]
    problems += [problem for problem in (dist.mixed_devices(kinds),
                                         dist.shared_gpus([i.gpu for i in everyone]))
                 if problem]
    if config is not None:  # every rank has one, or none: the same command line
        problems += workdir.sharing_problems(Path(config.output), world)
        if disagreement := dataset_disagreement_across_ranks(fingerprint):
            problems.append(disagreement)
    resumable = None
    if checkpoint:
        try:
            resumable, notes = find_resumable(checkpoint, world, weights_only)
        except CheckpointError as error:
            problems.append(str(error))
    if world.is_main:
        print_report(config, everyone, precision)
        if resumable:
            print("\n".join([*notes, f"checkpoint: {resumable} verifies"]))
        for line in problems:
            print(f"PROBLEM: {line}")
        print(f"{len(problems)} problem(s) found" if problems else "OK: no problems found")
    return 1 if problems else 0


def agreed_precision(config: Config, ctx: mx.Context | None,
                     problems: list[str]) -> cpu_precision.Choice | None:
    """What the backbone will compute in, as training decides it (every rank takes
    part); a host that cannot run a forced bfloat16 adds its problem to `problems`."""
    mine = None
    if ctx is not None:
        try:
            mine = cpu_precision.host_choice(config, ctx.device_type == "gpu")
        except UserError as error:
            problems.append(str(error))
        except Exception as error:  # reported, never raised alone: the others would wait
            problems.append(f"cannot choose the backbone's precision: {error!r}")
    everyone = dist.allgather_object((socket.gethostname(), mine), name="preflight.precision")
    known = [(host, choice) for host, choice in everyone if choice is not None]
    return cpu_precision.agree(known) if len(known) == len(everyone) else None


def deduplicate_across_ranks(lines: list[str]) -> list[str]:
    """The same problem on every rank is one line naming the ranks, not W lines."""
    by_text: dict[str, list[str]] = {}
    for line in lines:
        where, _, text = line.partition(": ")
        by_text.setdefault(text, []).append(where)
    return [f"{', '.join(wheres)}: {text}" if len(wheres) < 3 else f"{len(wheres)} ranks: {text}"
            for text, wheres in by_text.items()]


def free_memory(ctx: mx.Context | None, local_size: int) -> tuple[int | None, list[str]]:
    """Bytes this process may use (its GPU's free memory, or its share of host RAM)
    and the problem when a GPU cannot tell (None bytes then)."""
    if ctx is None:
        return None, []
    if ctx.device_type == "gpu":
        try:
            free, _total = mx.context.gpu_memory_info(ctx.device_id)
        except mx.base.MXNetError as error:  # its message ends MXNet's C++ traceback
            said = str(error).strip().splitlines()[-1:] or [""]
            return None, [f"cannot read the free memory of {ctx}: {said[0]}; is the GPU "
                          "usable (nvidia-smi) and MXNet a CUDA build?"]
        return int(free), []
    return psutil.virtual_memory().available // max(local_size, 1), []


def check_gpu_driver() -> list[str]:
    built_for, driver = gpu_support.mxnet_cuda_version(), gpu_support.cuda_driver_version()
    cuda_enabled = mx.runtime.Features().is_enabled("CUDA")
    if cuda_enabled and driver is None:
        return ["MXNet is a CUDA build but no NVIDIA driver was found; install the driver, "
                "or reinstall the CPU build with `MXNET_PACKAGE=mxnet bash setup-utils/install.sh`"]
    if cuda_enabled and built_for and driver < built_for:
        return [f"MXNet is built for CUDA {built_for[0]}.{built_for[1]} but the driver "
                f"supports only CUDA {driver[0]}.{driver[1]}; upgrade the driver (CUDA "
                f"{built_for[0]}.{built_for[1]}: {gpu_support.driver_for(built_for)}) or "
                "install an older mxnet-cuXXX (docs/installation.md, 'GPU support')"]
    if cuda_enabled and mx.context.num_gpus() == 0:
        return ["MXNet is a CUDA build but sees no GPU; check CUDA_VISIBLE_DEVICES and nvidia-smi"]
    return []


def check_dataset(config: Config) -> tuple[list[str], dict | None]:
    """The dataset opens as the trainer will open it; the verification sets exist.
    Returns the problems and the dataset's fingerprint (None when it did not open)."""
    if not config.rec:
        return ["the config sets no `rec` directory; set rec=/path/to/dataset"], None
    problems, fingerprint = [], None
    try:
        dataset = open_dataset(config)
        fingerprint = dataset.records.fingerprint() if dataset is not None else None
    except DataError as error:
        problems.append(str(error))
    problems += [f"verification set {path.absolute()} is missing; fix `val_targets` or "
                 "copy it there"
                 for path in config.val_paths() if not path.is_file()]
    return problems, fingerprint


def dataset_disagreement_across_ranks(fingerprint: dict | None) -> str | None:
    """Called by every rank with its dataset's fingerprint (record count, train.idx size
    and CRC-32): one problem line, the same on every rank, when the copies differ. They
    would yield different numbers of batches and wait for each other in a collective."""
    copies = dist.allgather_object((socket.gethostname(), fingerprint), name="dataset.copies")
    groups: dict[str, list[str]] = {}
    for rank, (host, copy) in enumerate(copies):
        if copy is not None:  # a joined dataset's: each of its datasets'
            described = " + ".join(
                f"{part['records']} records, train.idx of {part['bytes']} bytes with CRC-32 "
                f"{part['crc32']:08x}, train.rec of {part['rec_bytes']} bytes"
                for part in copy.get("datasets", [copy]))
            groups.setdefault(described, []).append(f"{rank} ({host})")
    if len(groups) < 2:
        return None
    return ("the ranks read different copies of the dataset: "
            + "; ".join(f"rank(s) {', '.join(ranks)}: {what}" for what, ranks in groups.items())
            + ". Copy the same train.rec and train.idx to every host")


def check_memory(need: RunMemory, available: int) -> list[str]:
    if need.total <= available:
        return []
    return [f"this process needs about {need.total / GiB:.1f} GiB ({describe_memory(need)}) "
            f"but {available / GiB:.1f} GiB is free; lower batch_size or set "
            "recompute_activations=True (the activations), or use more processes, a lower "
            "sample_rate or fp16_centers=True (Partial FC)"]


def describe_room(free: int | None, need: RunMemory | None) -> str:
    """A rank's free memory, and what the run needs of it."""
    if free is None:
        return "unknown"
    text = f"{free / GiB:.1f} GiB"
    if need is not None:
        text += f", the run needs about {need.total / GiB:.1f} GiB"
        if CLOSE * free < need.total <= free:
            text += (" (close: the estimate can be tens of percent short for some "
                     "networks; docs/benchmarks.md)")
    return text


def describe_memory(need: RunMemory) -> str:
    backbone, pfc = need.backbone, need.partial_fc
    parts = {"weights": backbone.weights, "gradients": backbone.gradients,
             "optimizer": backbone.optimizer, "activations": backbone.activations}
    return (f"backbone {backbone.total / GiB:.2f} GiB: "
            + ", ".join(f"{name} {size / GiB:.2f} GiB" for name, size in parts.items())
            + f"; Partial FC {pfc.total / GiB:.2f} GiB: centers and their optimizer state "
            f"{pfc.centers / GiB:.2f} GiB, per step {pfc.working / GiB:.2f} GiB")


def print_report(config: Config | None, ranks: list[RankInfo],
                 precision: cpu_precision.Choice | None) -> None:
    features = mx.runtime.Features()
    flag = {True: "yes", False: "no"}
    print(f"MXNet {mx.__version__}: CUDA {flag[features.is_enabled('CUDA')]}, "
          f"NCCL {flag[features.is_enabled('NCCL')]}, oneDNN {flag[features.is_enabled('MKLDNN')]}")
    print(f"Horovod {horovod.__version__}: {horovod_build_summary()}, "
          f"controller in use: {dist.controller()}")
    print(f"MPI: {mpi_library()}")
    hosts = sorted({r.host for r in ranks})
    print(f"processes: {len(ranks)} on {len(hosts)} host(s) ({', '.join(hosts)}), "
          f"launched by {launcher()}")
    for r in ranks:
        print(f"  rank {r.rank}: host {r.host}, local rank {r.local_rank}/{r.local_size}, "
              f"device {r.device}, free memory {describe_room(r.free_memory, r.memory_need)}")
    for host in hosts:  # ranks of a host may see different GPUs (CUDA_VISIBLE_DEVICES)
        lines = [line for r in ranks if r.host == host for line in r.gpus]
        for line in dict.fromkeys(lines):
            print(f"  {host}: {line}")
    if config is None:
        print("no config given: the environment alone was checked; `check CONFIG` also "
              "checks the data, the work dir and the memory of a run")
        return
    print(f"data: {config.rec or '(not set)'}, {config.num_classes} classes, "
          f"val_targets {[str(p) for p in config.val_paths()]}")
    print(f"work_dir: {config.output} (must be one directory shared by every host)")
    if precision is not None:
        print(f"backbone in {precision.dtype}: {precision.reason}")
    need = ranks[0].memory_need
    if need is not None:
        print(f"memory of rank 0 at batch {config.batch_size}: about {need.total / GiB:.2f} "
              f"GiB ({describe_memory(need)})")


def horovod_build_summary() -> str:
    built = {
        "MXNet": True, "MPI": hvd.mpi_built(), "Gloo": hvd.gloo_built(),
        "NCCL": hvd.nccl_built(), "CUDA": hvd.cuda_built(), "oneCCL": hvd.ccl_built(),
    }
    return "built with " + ", ".join(name for name, ok in built.items() if ok)


def mpi_library() -> str:
    """The MPI library's own version string, without initialising MPI a second time."""
    import mpi4py

    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
    from mpi4py import MPI

    return " ".join(MPI.Get_library_version().split()[:6]).rstrip(",")


def launcher() -> str:
    if "OMPI_COMM_WORLD_SIZE" in os.environ and "HOROVOD_GLOO_RENDEZVOUS_ADDR" not in os.environ:
        return "mpirun"
    return "horovodrun" if "HOROVOD_RANK" in os.environ else "none"
