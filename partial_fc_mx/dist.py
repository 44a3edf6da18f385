"""Process setup under Horovod, and the device each process trains on.

Every launcher users know (horovodrun with MPI or Gloo, mpirun, srun) ends in the
same `hvd.init()`; a plain `python -m partial_fc_mx ...` is a world of one.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import horovod.mxnet as hvd
import mxnet as mx
import numpy as np

from .errors import UserError
from .hardware import gpu_support

T = TypeVar("T")


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    local_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


RESPONSE_CACHE = 4096
"""Collectives whose negotiation Horovod remembers by name (its default: 1024). A step
allreduces one gradient per backbone parameter (r100: 771, r200: 1,506) and start-up
broadcasts as many: past the capacity every step renegotiates and logs evictions."""


def init() -> World:
    defaults = {"HOROVOD_CYCLE_TIME": cycle_time_ms(visible_gpus()),
                "HOROVOD_CACHE_CAPACITY": str(RESPONSE_CACHE)}
    for name, value in defaults.items():
        if not os.environ.get(name):  # an exported value wins
            os.environ[name] = value
    hvd.init()
    return World(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size())


def cycle_time_ms(gpus: int) -> str:
    """How often Horovod's background thread wakes to see which tensors are ready.

    The MXNet reference's 0.1 ms suits GPU hosts, whose cores are otherwise idle; on a
    CPU-only run that thread takes the cores the training computes on (the default
    job: 0.58 s/step at 0.1 ms, 0.37 s at 5 ms; docs/benchmarks.md). Decided here,
    by the device this process trains on, so that every launcher gets it.
    """
    return "0.1" if gpus > 0 else "5"


def world_size() -> int:
    return hvd.size()


class DeviceError(UserError, RuntimeError):
    """A process without a device of its own, or ranks on different kinds of device."""


def visible_gpus() -> int:
    """GPUs this process sees (after CUDA_VISIBLE_DEVICES and any binding)."""
    return mx.context.num_gpus()


def device(local_rank: int) -> mx.Context:
    """One GPU per process (choose_device), or the CPU when the process sees none."""
    return choose_device(local_rank, visible_gpus())


def choose_device(local_rank: int, gpus: int) -> mx.Context:
    """The local rank's GPU among the `gpus` this process sees; the only one when it
    sees one (Slurm's --gpus-per-task=1, a launcher binding each process to its GPU,
    a one-GPU pod: every process's GPU is its gpu(0)); the CPU when it sees none."""
    if gpus == 0:
        return mx.cpu()
    if gpus == 1:
        return mx.gpu(0)
    if local_rank < gpus:
        return mx.gpu(local_rank)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    raise DeviceError(
        f"local rank {local_rank} has no GPU of its own: this process sees {gpus} GPUs"
        f"{shown}, gpu(0) to gpu({gpus - 1}). Start at most {gpus} processes on this host "
        "(horovodrun -H host:N, a hostfile's slots), or give each process its own GPU "
        "(srun --gpus-per-task=1, or CUDA_VISIBLE_DEVICES per process)")


def mixed_devices(kinds: list[str]) -> str | None:
    """Why ranks on these device kinds (each rank's "gpu" or "cpu", in rank order; any
    other entry is a rank without a device, reported on its own) cannot train together,
    or None: a rank on the CPU beside GPUs (its GPUs hidden or missing) would make the
    whole job wait for it, or run out of its memory."""
    if not {"cpu", "gpu"} <= set(kinds):
        return None
    cpu_ranks = [str(rank) for rank, kind in enumerate(kinds) if kind == "cpu"]
    return (f"rank(s) {', '.join(cpu_ranks)} see no GPU while the others train on GPUs; "
            "check CUDA_VISIBLE_DEVICES and nvidia-smi on their hosts")


def gpu_identity(ctx: mx.Context) -> tuple[str, str] | None:
    """(host, PCI bus id) of the GPU `ctx` names, the same in every process that sees
    it; None on the CPU or when the driver does not say."""
    if ctx.device_type != "gpu":
        return None
    gpus = gpu_support.visible_gpus() or []
    if ctx.device_id >= len(gpus) or not gpus[ctx.device_id].bus_id:
        return None
    return socket.gethostname(), gpus[ctx.device_id].bus_id


def shared_gpus(identities: list) -> str | None:
    """Why ranks with these GPU identities (gpu_identity, in rank order) cannot train
    together, or None: two processes on one GPU (a host with one GPU and two processes,
    each of which sees it as its only one) would fail in NCCL or wait there."""
    ranks_of: dict = {}
    for rank, identity in enumerate(identities):
        if identity is not None:
            ranks_of.setdefault(tuple(identity), []).append(str(rank))
    shared = [f"ranks {', '.join(ranks)} on {host} share the GPU at PCI bus {bus}"
              for (host, bus), ranks in ranks_of.items() if len(ranks) > 1]
    if not shared:
        return None
    return ("; ".join(shared) + ". Start one process per GPU (as many as the host has "
            "GPUs), or give each process its own (CUDA_VISIBLE_DEVICES, srun "
            "--gpus-per-task=1)")


def own_device(local_rank: int) -> tuple[mx.Context, tuple[str, str] | None]:
    """This process's device and, for a GPU, its identity (gpu_identity)."""
    ctx = device(local_rank)
    return ctx, gpu_identity(ctx)


def training_device(world: World) -> mx.Context:
    """This process's device, agreed by every rank: a rank without a device of its
    own, ranks on different kinds of device, or two ranks on one GPU stop every rank
    with the same message before anything is allocated."""
    ctx, identity = run_agreed(lambda: own_device(world.local_rank), "device", (DeviceError,),
                               DeviceError, "cannot choose the device")
    everyone = allgather_object((ctx.device_type, identity), name="device.kinds")
    problem = (mixed_devices([kind for kind, _ in everyone])
               or shared_gpus([gpu for _, gpu in everyone]))
    if problem:
        raise agreed(DeviceError(problem))
    return ctx


def controller() -> str:
    """Which Horovod controller this run uses: 'MPI' or 'Gloo'."""
    return "MPI" if hvd.mpi_enabled() else "Gloo"


def allgather_object(obj: object, name: str) -> list:
    """Every rank's `obj`, in rank order, on every rank (small Python objects only)."""
    return hvd.allgather_object(obj, name=name)


def broadcast_parameters(params: dict, root_rank: int = 0) -> None:
    """Overwrite every parameter, in place, with its value on `root_rank`.

    An allreduce (sum) to which the other ranks contribute -0.0, instead of
    hvd.broadcast_parameters: Horovod 0.28.1's EnqueueTensorBroadcast reads the
    tensor's name after handing it to the background thread, which may already have
    finished the broadcast and freed the name; the use-after-free crashed a resumed
    2-process run in CI (SIGSEGV in EnqueueTensorBroadcast). Allreduce does not
    touch the name after enqueueing, and x + (-0.0) = x for every float x, -0.0
    included, so the values arrive bit for bit (a NaN stays a NaN).
    """
    if hvd.size() == 1:
        return
    for name, param in sorted(params.items()):
        for index, array in enumerate(param.list_data()):
            if hvd.rank() != root_rank:
                # -0.0 (`array[:] = -0.0` would store +0.0)
                mx.nd.negative(mx.nd.zeros_like(array), out=array)
            hvd.allreduce_(array, op=hvd.Sum, name=f"broadcast.{name}.{index}")
    mx.nd.waitall()


def stop_timeline() -> None:
    """Close Horovod's timeline (HOROVOD_TIMELINE) on every rank, so that it can be read
    whole: the file is written while the run goes on."""
    hvd.stop_timeline()


def barrier(name: str) -> None:
    hvd.allreduce(mx.nd.zeros(1), name=f"barrier.{name}").wait_to_read()


def sum_over_ranks(values, name: str) -> np.ndarray:
    """Element-wise sums of every rank's `values` (flags, counts: a list or an array of
    any shape), in float64 (exact for counts up to 2^53)."""
    total = hvd.allreduce(mx.nd.array(values, dtype="float64"), op=hvd.Sum, name=name)
    return total.asnumpy()


def any_rank(flag: bool, name: str) -> bool:
    """True on every rank if `flag` is true on any rank."""
    return sum_over_ranks([float(flag)], name)[0] > 0


def raise_on_every_rank(error: Exception | None, name: str, failed: bool | None = None) -> None:
    """Called by every rank at the same point: if any rank failed, every rank raises
    the same error, of the first failing rank's type, with every failing rank's
    message (naming the ranks where only some failed, or failed differently), so no
    rank is left waiting in the next collective; printed by rank 0 alone (`agreed`).

    One allreduce of a flag in the common case (none when the caller already knows
    `failed` from its own allreduce); the messages are gathered only on failure.
    """
    if failed is None:
        failed = any_rank(error is not None, name=f"{name}.failed")
    if not failed:
        return
    mine = None if error is None else (type(error), str(error))
    if error is not None and not constructible_from_message(type(error)):
        mine = (RuntimeError, f"{type(error).__name__}: {error}")
    everyone = allgather_object(mine, name=f"{name}.errors")
    failures = [(rank, item) for rank, item in enumerate(everyone) if item is not None]
    kind = failures[0][1][0]
    ranks_of: dict[str, list[str]] = {}
    for rank, (_, text) in failures:
        ranks_of.setdefault(text, []).append(str(rank))
    if len(failures) == len(everyone) and len(ranks_of) == 1:  # the same on every rank
        message = failures[0][1][1]
    else:
        message = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}: {text}"
                            for text, ranks in ranks_of.items())
    raise agreed(kind(message))


E = TypeVar("E", bound=Exception)


def agreed(error: E) -> E:
    """`error`, which every rank raises alike at this point, marked to be printed by
    rank 0 alone (`printed_by_rank_0` on the others): one message, not one per rank."""
    error.printed_by_rank_0 = hvd.rank() != 0
    return error


def constructible_from_message(kind: type) -> bool:
    try:
        kind("message")
    except Exception:  # e.g. UnicodeDecodeError needs five arguments
        return False
    return True


def run_agreed(action: Callable[[], T], name: str, expected: tuple, wrap: type,
               context: str, on: bool = True) -> T | None:
    """`action()` on the ranks where `on` is true (e.g. rank 0 only); if it fails on
    any rank, every rank raises together. Errors of the `expected` types keep their
    message; anything else (a disk error, an MXNetError) becomes `wrap(context: ...)`,
    with its traceback printed on the rank where it happened."""
    result, error = None, None
    if on:
        try:
            result = action()
        except expected as failure:
            error = failure
        except Exception as failure:  # reported on every rank
            traceback.print_exc()
            error = wrap(f"{context}: {type(failure).__name__}: {failure}")
    raise_on_every_rank(error, name)
    return result
