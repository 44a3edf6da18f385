"""One training process's memory, estimated before anything is allocated: the backbone
(weights, gradients, optimizer states, activations at the batch) and Partial FC
(pfc_memory.py). The preflight compares it with the free memory of each
process's GPU, or its share of the host's RAM.

The backbone's part is read from its graph: parameter shapes, and the shape and type
of every operator's output at the configured batch (in 16 bits where the
mixed-precision graph computes in 16 bits), from MXNet's shape and type inference;
nothing is allocated. Training keeps the forward outputs the backward needs and a
gradient buffer beside each, so the activations are counted twice. Measured against
the resident memory of real runs on the CPU (docs/benchmarks.md, `bench train`):
within 8% for r50 and r100 in float32 at batch 8 and 32; MobileFaceNet holds 32% more,
the bfloat16 graph of a CPU host 23-41% less. Not measured on a GPU (none of MXNet's wheels runs on
the GPUs this project was lent).
"""

from __future__ import annotations

from dataclasses import dataclass

import mxnet as mx
import numpy as np

from ..backbones import get_model, graph_of
from ..config import Config
from ..data.transforms import FACE_SIZE
from ..run.precision import mixed_precision_graph
from .pfc_memory import PartialFCMemory, estimate_memory

GiB = 2**30

KEPT_PER_ACTIVATION = 2
"""Each forward output is kept for the backward, with a gradient buffer of its size."""


@dataclass(frozen=True)
class BackboneMemory:
    weights: int
    """Parameters and BatchNorm statistics, float32."""
    gradients: int
    optimizer: int
    """The optimizer's states (SGD: momentum; AdamW: two moments)."""
    activations: int
    """What a training step at the configured batch holds between forward and backward."""

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations


@dataclass(frozen=True)
class RunMemory:
    backbone: BackboneMemory
    partial_fc: PartialFCMemory

    @property
    def total(self) -> int:
        return self.backbone.total + self.partial_fc.total


CLOSE = 0.8
"""A run estimated to take more of the free memory than this is said to be close: the
estimate is within 8% for IResNets in float32 but 32% short for MobileFaceNet
(docs/benchmarks.md)."""


def estimate_run_memory(config: Config, world_size: int, rank: int, dtype: str) -> RunMemory:
    """What rank `rank` of `world_size` needs for `config` with the backbone computing
    in `dtype` (cpu_precision.py)."""
    return RunMemory(backbone_memory(config, dtype), partial_fc_memory(config, world_size, rank))


def partial_fc_memory(config: Config, world_size: int, rank: int) -> PartialFCMemory:
    """Partial FC's part alone: the only part that depends on the world size, so a
    search over world sizes (plan.py) reads the backbone's graph once."""
    return estimate_memory(
        config.num_classes, config.embedding_size, world_size, rank, config.sample_rate,
        config.batch_size * world_size, config.fp16_centers, config.centers_optimizer(),
        config.center_update_mode(), config.num_subcenters,
        config.interclass_filtering_threshold > 0)


def backbone_memory(config: Config, dtype: str) -> BackboneMemory:
    """Gradients and optimizer states only for the parameters that learn: a parameter
    without a gradient (the embedding BatchNorm's fixed scale) has neither."""
    net = get_model(config.network, config.embedding_size, config.dropout)
    frozen = {p.name for p in net.collect_params().values() if p.grad_req == "null"}
    graph = graph_of(net)
    if dtype != "float32":
        graph = mixed_precision_graph(graph, dtype)
    data = (config.batch_size, 3, FACE_SIZE, FACE_SIZE)
    arguments, _, auxiliary = graph.infer_shape(data=data)
    sizes = {name: int(np.prod(shape)) for name, shape in zip(graph.list_arguments(), arguments)
             if name != "data"}
    trainable = sum(size for name, size in sizes.items() if name not in frozen)
    statistics = sum(int(np.prod(shape)) for shape in auxiliary)
    states = optimizer_states(config)
    return BackboneMemory(4 * (sum(sizes.values()) + statistics), 4 * trainable,
                          4 * states * trainable, KEPT_PER_ACTIVATION * output_bytes(graph, data))


def output_bytes(graph: mx.sym.Symbol, data: tuple) -> int:
    """Bytes of every operator's output in `graph` for an input of shape `data`."""
    internals = graph.get_internals()
    _, shapes, _ = internals.infer_shape(data=data)
    _, types, _ = internals.infer_type(data="float32")
    variables = {*graph.list_arguments(), *graph.list_auxiliary_states()}
    return sum(int(np.prod(shape)) * np.dtype(kind).itemsize
               for name, shape, kind in zip(internals.list_outputs(), shapes, types)
               if name not in variables)


def optimizer_states(config: Config) -> int:
    """Arrays of a parameter's size the backbone's optimizer keeps per parameter."""
    if config.optimizer == "adamw":
        return 2
    return 1 if config.momentum else 0
