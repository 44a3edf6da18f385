"""One training process's memory, estimated before anything is computed: the backbone
(weights, gradients, optimizer states, activations at the batch) and Partial FC
(pfc_memory.py). The preflight compares it with the free memory of each
process's GPU, or its share of the host's RAM.

The backbone's weights are read from its graph's parameter shapes. Its activations
(every operator output and gradient of a forward and backward, in 16 bits where the
mixed-precision graph computes in 16 bits) are what MXNet's own memory planner gives
them, sharing buffers whose lifetimes do not overlap: an executor bound on the CPU
at two small batches, never run (planned_bytes), extended linearly to the configured
batch. On a CPU, oneDNN keeps one more copy of each convolution's, BatchNorm's and
PReLU's output in its blocked layout, outside the planner's buffers: counted too.
Measured against the resident memory of real float32 runs on the CPU (`bench train`,
2026-12-03, docs/benchmarks.md), the processes grew by 1.00-1.06x the estimate for
r18 and r50, 1.07-1.11x for vit_t and vit_s at batches 8-32, and 1.34x for
MobileFaceNet (its depthwise convolutions' oneDNN buffers). Counting every output
twice, the rule before, held the IResNets within 8% and over-counted a ViT 4 times
(the planner shares its reshapes', scalings' and softmax's buffers). The 16-bit
graphs' estimate is the planner's too, not measured since this rule (a bfloat16 r50
held 0.6-0.8x the old rule's estimate); nor on a GPU (none of MXNet's wheels runs
on the GPUs this project was lent), where oneDNN's copies are not counted.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import mxnet as mx
import numpy as np

from ..backbones import get_model, graph_of
from ..backbones.segments import DATA
from ..config import Config
from ..data.transforms import FACE_SIZE
from ..run.precision import training_graph
from ..run.recompute import segments_of
from .pfc_memory import PartialFCMemory, estimate_memory

GiB = 2**30

PLANNED_BATCHES = (8, 16)
"""The batches MXNet's planner is asked about: its buffers grow linearly with the batch
beside a fixed part (a 16-bit graph's casts of the weights), and an executor bound at
the configured batch would reserve that much address space."""

IMAGE_BYTES = 3 * FACE_SIZE * FACE_SIZE * 4
"""One input image as the step holds it: float32, normalized (data/loader.py)."""

ONEDNN_COPIES = {"Convolution", "BatchNorm", "LeakyReLU"}
"""Operators whose outputs oneDNN keeps a second copy of on a CPU (r18 at batch 16:
96 MB an image resident with oneDNN, 61 MB with MXNET_MKLDNN_ENABLED=0, 48 MB
planned)."""


@dataclass(frozen=True)
class BackboneMemory:
    weights: int
    """Parameters and BatchNorm statistics, float32."""
    gradients: int
    optimizer: int
    """The optimizer's states (SGD: momentum; AdamW: two moments)."""
    activations: int
    """What a training step at the configured batch holds between forward and backward."""
    accumulation: int = 0
    """With gradient_accumulation k > 1: the earlier micro-batches' gradients, summed in
    one more copy of them, and the images of the k - 1 micro-batches beside the one
    computing (the loader's batch holds all k). Not counted, at any k: the loader's
    host copy of a batch and, on a GPU, the next batch copied ahead (0.15 MB an image
    each)."""

    @property
    def total(self) -> int:
        return (self.weights + self.gradients + self.optimizer + self.activations
                + self.accumulation)


@dataclass(frozen=True)
class RunMemory:
    backbone: BackboneMemory
    partial_fc: PartialFCMemory

    @property
    def total(self) -> int:
        return self.backbone.total + self.partial_fc.total


CLOSE = 0.8
"""A run estimated to take more of the free memory than this is said to be close: the
processes measured grew by up to 11% more than estimated, MobileFaceNet by 34%
(docs/benchmarks.md)."""


def estimate_run_memory(config: Config, world_size: int, rank: int, dtype: str,
                        device: str = "cpu") -> RunMemory:
    """What rank `rank` of `world_size` needs for `config` with the backbone computing
    in `dtype` (cpu_precision.py) on `device` ("cpu" or "gpu")."""
    return RunMemory(backbone_memory(config, dtype, device),
                     partial_fc_memory(config, world_size, rank))


def partial_fc_memory(config: Config, world_size: int, rank: int) -> PartialFCMemory:
    """Partial FC's part alone: the only part that depends on the world size, so a
    search over world sizes (plan.py) reads the backbone's graph once."""
    return estimate_memory(
        config.num_classes, config.embedding_size, world_size, rank, config.sample_rate,
        config.batch_size * world_size, config.fp16_centers, config.centers_optimizer(),
        config.center_update_mode(), config.num_subcenters,
        config.interclass_filtering_threshold > 0, config.gradient_accumulation,
        # "auto" counted as bfloat16, which it may be on the hosts that run it
        "float32" if config.pfc_gemm == "float32" else "bfloat16")


def backbone_memory(config: Config, dtype: str, device: str = "cpu") -> BackboneMemory:
    """Gradients and optimizer states only for the parameters that learn: a parameter
    without a gradient (the embedding BatchNorm's fixed scale) has neither."""
    net = get_model(config.network, config.embedding_size, config.dropout)
    frozen = {p.name for p in net.collect_params().values() if p.grad_req == "null"}
    graph = training_graph(graph_of(net), dtype, cpu_kernels=False)
    data = (config.batch_size, 3, FACE_SIZE, FACE_SIZE)
    arguments, _, auxiliary = graph.infer_shape(data=data)
    sizes = {name: int(np.prod(shape)) for name, shape in zip(graph.list_arguments(), arguments)
             if name != "data"}
    trainable = sum(size for name, size in sizes.items() if name not in frozen)
    statistics = sum(int(np.prod(shape)) for shape in auxiliary)
    states = optimizer_states(config)
    others = config.gradient_accumulation - 1
    accumulation = (others > 0) * 4 * trainable + others * config.batch_size * IMAGE_BYTES
    activations = (recomputed_activation_bytes(net, dtype, data, device)
                   if config.recompute_activations
                   else activation_bytes(graph, {DATA: data}, device))
    return BackboneMemory(4 * (sum(sizes.values()) + statistics), 4 * trainable,
                          4 * states * trainable, activations, accumulation)


def recomputed_activation_bytes(net: mx.gluon.HybridBlock, dtype: str, data: tuple,
                                device: str) -> int:
    """With recompute_activations (run/recompute.py): every segment's inputs, kept from
    the forward to the backward (float32 in either precision: AMP casts each segment's
    outputs to it), and the largest forward and backward of one segment. A segment's
    block allocates per call, and its recording keeps every operator's output until
    its backward: the planner's figure, which shares buffers across the whole forward
    and backward, is only a floor (a vit_t block at batch 32: 108 MiB planned, 261 MiB
    of outputs; docs/benchmarks.md has the estimate against RSS)."""
    shapes, producer, kept, largest = {DATA: data}, {DATA: -1}, {}, 0
    for index, segment in enumerate(segments_of(net)):
        graph = training_graph(segment.graph(), dtype, cpu_kernels=False,
                               inputs=segment.inputs)
        inputs = {name: shapes[name] for name in segment.inputs}
        for name, shape in inputs.items():  # a value several segments read: kept once
            if name != DATA:
                kept[name, producer[name]] = 4 * int(np.prod(shape))
        largest = max(largest, activation_bytes(graph, inputs, device),
                      operator_output_bytes(graph, inputs))
        _, outputs, _ = graph.infer_shape(**inputs)
        shapes.update(zip(segment.outputs, outputs))
        producer.update(dict.fromkeys(segment.outputs, index))
    return sum(kept.values()) + largest


def activation_bytes(graph: mx.sym.Symbol, inputs: dict[str, tuple], device: str) -> int:
    """What a forward and backward of `graph` on inputs of the shapes `inputs` (each
    batch first) holds beside the weights: the planner's buffers at the batch (linear
    through PLANNED_BATCHES) and, on a CPU, oneDNN's copies."""
    batch = next(iter(inputs.values()))[0]
    small, large = (planned_bytes(graph, at_batch(inputs, size)) for size in PLANNED_BATCHES)
    per_image = (large - small) / (PLANNED_BATCHES[1] - PLANNED_BATCHES[0])
    fixed = max(small - per_image * PLANNED_BATCHES[0], 0)
    copies = output_bytes(graph, inputs, ONEDNN_COPIES) if device == "cpu" else 0
    return int(fixed + per_image * batch) + copies


def at_batch(inputs: dict[str, tuple], batch: int) -> dict[str, tuple]:
    """`inputs`' shapes with `batch` as their first dimension."""
    return {name: (batch, *shape[1:]) for name, shape in inputs.items()}


def planned_bytes(graph: mx.sym.Symbol, inputs: dict[str, tuple]) -> int:
    """The bytes MXNet's memory planner gives a forward and backward of `graph`: an
    executor bound on the CPU, never run, reports them ("Total N MB allocated"). Its
    weights and buffers are reserved, not written: 0.2-0.5 s and under 130 MiB resident
    for r200 and vit_l at batch 16."""
    verbose = os.environ.get("MXNET_SUBGRAPH_VERBOSE")
    os.environ["MXNET_SUBGRAPH_VERBOSE"] = "0"  # no "Subgraph backend ..." line per bind
    try:
        executor = graph.simple_bind(mx.cpu(), grad_req="write", **inputs)
        report = executor.debug_str()
        del executor
    finally:
        if verbose is None:
            del os.environ["MXNET_SUBGRAPH_VERBOSE"]
        else:
            os.environ["MXNET_SUBGRAPH_VERBOSE"] = verbose
    return sum(int(mb) for mb in re.findall(r"Total (\d+) MB allocated", report)) * 2**20


def output_bytes(graph: mx.sym.Symbol, inputs: dict[str, tuple], operators: set[str]) -> int:
    """Bytes of the outputs of `graph`'s `operators` for inputs of the shapes `inputs`."""
    size = internal_bytes(graph, inputs)
    return sum(size[f"{node['name']}_output"] for node in json.loads(graph.tojson())["nodes"]
               if node["op"] in operators)


def operator_output_bytes(graph: mx.sym.Symbol, inputs: dict[str, tuple]) -> int:
    """Bytes of every output of every operator of `graph` (its variables' aside)."""
    variables = set(graph.list_inputs())
    return sum(size for name, size in internal_bytes(graph, inputs).items()
               if name not in variables)


def internal_bytes(graph: mx.sym.Symbol, inputs: dict[str, tuple]) -> dict[str, int]:
    """The bytes of each of `graph`'s values, by name, for inputs of the shapes `inputs`."""
    internals = graph.get_internals()
    _, shapes, _ = internals.infer_shape(**inputs)
    _, types, _ = internals.infer_type(**dict.fromkeys(inputs, "float32"))
    return {name: int(np.prod(shape)) * np.dtype(kind).itemsize
            for name, shape, kind in zip(internals.list_outputs(), shapes, types)}


def optimizer_states(config: Config) -> int:
    """Arrays of a parameter's size the backbone's optimizer keeps per parameter."""
    if config.optimizer == "adamw":
        return 2
    return 1 if config.momentum else 0
