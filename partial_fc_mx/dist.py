"""Process setup under Horovod, and the device each process trains on.

Every launcher users know (horovodrun with MPI or Gloo, mpirun, srun) ends in the
same `hvd.init()`; a plain `python -m partial_fc_mx ...` is a world of one.
"""

from __future__ import annotations

from dataclasses import dataclass

import horovod.mxnet as hvd
import mxnet as mx


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    local_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init() -> World:
    hvd.init()
    return World(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size())


def device(local_rank: int) -> mx.Context:
    """One GPU per process, chosen by local rank, or the CPU when there is none."""
    if mx.context.num_gpus() > 0:
        return mx.gpu(local_rank)
    return mx.cpu()


def controller() -> str:
    """Which Horovod controller this run uses: 'MPI' or 'Gloo'."""
    return "MPI" if hvd.mpi_enabled() else "Gloo"


def allgather_object(obj: object, name: str) -> list:
    """Every rank's `obj`, in rank order, on every rank (small Python objects only)."""
    return hvd.allgather_object(obj, name=name)
