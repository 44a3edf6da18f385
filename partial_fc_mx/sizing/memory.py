"""One training process's memory, estimated before anything is allocated: the backbone
(weights, gradients, optimizer states, activations at the batch) and Partial FC
(estimate_memory). The preflight compares it with the free memory of each
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
from ..pfc.center_optimizers import CenterOptimizer
from ..pfc.center_optimizers.sgd import SGD
from ..pfc.centers import center_dtype, rows_per_block, sampled_per_step, shard_of
from ..run.precision import mixed_precision_graph

GiB = 2**30

KEPT_PER_ACTIVATION = 2
"""Each forward output is kept for the backward, with a gradient buffer of its size."""


@dataclass(frozen=True)
class PartialFCMemory:
    """Bytes one rank needs for Partial FC, apart from the backbone."""

    weights: int
    """The shard's rows, resident for the whole run."""
    states: int
    """Their optimizer states, resident for the whole run."""
    sampled_rows: int
    """Per step: the sampled rows (weights, their scaled copy v, gradient, states) in
    float32 and the buffers they are gathered through."""
    logits: int
    """Per step: the N x n matrices (the logits, then the probabilities)."""

    @property
    def centers(self) -> int:
        return self.weights + self.states

    @property
    def working(self) -> int:
        return self.sampled_rows + self.logits

    @property
    def total(self) -> int:
        return self.centers + self.working


LOGIT_MATRICES = 2
"""N x n float32 matrices counted per step: the one buffer of the logits (then the
softmax's probabilities, which the backward GEMMs read), and one more as a margin for
MXNet's own temporaries (resident memory measured 0.96x this estimate at N = 1024,
n = 50,000, before the scaled rows v were added to the estimate; docs/benchmarks_history.md)."""


def estimate_memory(
    num_classes: int,
    embedding_size: int,
    world_size: int,
    rank: int,
    sample_rate: float,
    global_batch: int,
    fp16_centers: bool = False,
    optimizer: CenterOptimizer | None = None,
) -> PartialFCMemory:
    """`optimizer`: the centers' (default: SGD with momentum, one state as wide as a row)."""
    optimizer = optimizer or SGD()
    rows = shard_of(num_classes, rank, world_size).count
    dtype = center_dtype(fp16_centers)
    states = optimizer.states(embedding_size, dtype).values()
    state_bytes = sum(width * np.dtype(state_dtype).itemsize for width, state_dtype in states)
    sampled = sampled_per_step(rows, sample_rate, global_batch)
    fp32 = 4
    # float32 work copies of the sampled rows, their scaled copy (v in partial_fc.py),
    # their gradient and states, and the buffers the rows stored in another dtype are
    # gathered through
    gathered = (embedding_size * np.dtype(dtype).itemsize * (dtype != "float32")
                + sum(width * np.dtype(state_dtype).itemsize
                      for width, state_dtype in states if state_dtype != "float32"))
    # a shard in several blocks joins each block's float32 rows in one more buffer
    joined = embedding_size * fp32 * (rows > rows_per_block(embedding_size))
    sampled_rows = sampled * ((3 * embedding_size + sum(width for width, _ in states)) * fp32
                              + gathered + joined)
    return PartialFCMemory(rows * embedding_size * np.dtype(dtype).itemsize, rows * state_bytes,
                          sampled_rows, LOGIT_MATRICES * global_batch * sampled * fp32)


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
        config.batch_size * world_size, config.fp16_centers, config.centers_optimizer())


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
