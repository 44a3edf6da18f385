"""Activation recomputation (config `recompute_activations`): the backbone's forward
keeps only the inputs of each of its segments (backbones/segments.py: the stem, each
residual unit or transformer block, the head), and the backward recomputes one
segment at a time under autograd and back-propagates through it. A step then holds
the segments' boundaries and one segment's activations, for one more forward's time.

MXNet 1.9.1's own recomputation (MXNET_BACKWARD_DO_MIRROR) is a pass of the symbolic
GraphExecutor; Gluon's hybridized blocks run through CachedOp, which has none. So
it is done here, segment by segment, with two rules that make the recomputed forward
compute what the first one did:
  - random operators (drop path, the patch mask, dropout) draw the same numbers:
    every segment's forward, first and recomputed, reseeds MXNet's generator with a
    seed of its own, drawn from the generator train.seed_step seeds (a resumed run
    draws what the uninterrupted one drew);
  - a BatchNorm's running statistics move once: each segment's are kept as they
    were before its first forward and put back before its recomputation. MXNet
    1.9.1's CPU BatchNorm moves them in its backward, so on the CPU this changes
    nothing; cuDNN's training forward takes them and moves them, which would move
    a GPU's twice (tests/test_recompute.py holds the rule with a forward that moves
    them).
The segments' blocks allocate their memory per call (no static_alloc: a static one
would keep every segment's activations between steps, what recomputing saves).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import mxnet as mx

from ..backbones.modes import graph_block
from ..backbones.segments import DATA, EMBEDDINGS, Segment, recompute_problem
from ..errors import UserError
from .precision import training_graph, uses_cpu_kernels

SEED_RANGE = 2**30
"""A step's segment seeds are base, base + 1, ...: base is drawn below this."""


class RecomputeError(UserError, ValueError):
    """A backbone that cannot recompute its activations."""


def segments_of(net: mx.gluon.HybridBlock) -> list[Segment]:
    """`net`'s segments, or RecomputeError saying why it has none that would train it."""
    if problem := recompute_problem(net):
        raise RecomputeError(problem)
    return net.segments()


@dataclass(frozen=True)
class Piece:
    """A segment as it trains: its block over the network's parameters and the
    BatchNorm statistics among them."""

    segment: Segment
    block: Callable
    statistics: list


class Recomputed:
    """The backbone that trains with recomputation: `forward` for the step, and the
    whole graph (`whole`, the model without recomputation) for anything else that
    calls it (evaluation)."""

    def __init__(self, whole: mx.gluon.HybridBlock, net: mx.gluon.HybridBlock,
                 ctx: mx.Context, dtype: str) -> None:
        self.whole = whole
        self.ctx = ctx
        cpu_kernels = uses_cpu_kernels(net, ctx, dtype)
        params = net.collect_params()
        self.pieces = []
        for segment in segments_of(net):
            graph = training_graph(segment.graph(), dtype, cpu_kernels, segment.inputs)
            self.pieces.append(Piece(segment, graph_block(graph, segment.inputs, net,
                                                          static_alloc=False),
                                     [params[name] for name in graph.list_auxiliary_states()]))
        self.constants = {DATA, *(name for piece in self.pieces
                                  for name in piece.segment.constants)}

    def __call__(self, images: mx.nd.NDArray) -> mx.nd.NDArray:
        return self.whole(images)

    def forward(self, images: mx.nd.NDArray) -> tuple[mx.nd.NDArray, Callable]:
        """The embeddings of `images` in training mode, and the function that
        back-propagates their gradient; kept for it: each segment's inputs and running
        statistics."""
        base = int(mx.nd.random.randint(0, SEED_RANGE, shape=(1,)).asscalar())
        values, kept = {DATA: images}, []
        with mx.autograd.pause(train_mode=True):
            for index, piece in enumerate(self.pieces):
                inputs = [values[name] for name in piece.segment.inputs]
                kept.append((inputs, [p.data(self.ctx).copy() for p in piece.statistics]))
                mx.random.seed(base + index)
                values.update(zip(piece.segment.outputs, outputs_of(piece.block(*inputs))))
        return values[EMBEDDINGS], partial(self._backward, kept, base)

    def _backward(self, kept: list, base: int, grad: mx.nd.NDArray) -> None:
        """The parameters' gradients of a forward whose segments' inputs are `kept`,
        given the embeddings' gradient: the last segment first, each recomputed with
        the seed its forward had, its inputs' gradients passed to the one before."""
        grads = {EMBEDDINGS: grad}
        for index in reversed(range(len(self.pieces))):
            (inputs, statistics), kept[index] = kept[index], None  # freed after it
            grads.update(self._backward_segment(index, base + index, inputs, statistics,
                                                grads))

    def _backward_segment(self, index: int, seed: int, inputs: list, statistics: list,
                          grads: dict) -> dict:
        """Segment `index` recomputed from `inputs` (with the running `statistics` its
        forward found, and its `seed`) and back-propagated from the gradients of its
        outputs, taken from `grads`; the gradients of its inputs."""
        piece = self.pieces[index]
        differentiable = [(name, x) for name, x in zip(piece.segment.inputs, inputs)
                          if name not in self.constants]
        for _, x in differentiable:
            x.attach_grad()
        for parameter, value in zip(piece.statistics, statistics):
            parameter.data(self.ctx)[:] = value
        with mx.autograd.record(train_mode=True):
            mx.random.seed(seed)
            outputs = outputs_of(piece.block(*inputs))
        heads = [(out, grads.pop(name)) for name, out in zip(piece.segment.outputs, outputs)
                 if name in grads]
        mx.autograd.backward([out for out, _ in heads], [g for _, g in heads])
        return {name: x.grad for name, x in differentiable}


def outputs_of(result) -> list:
    """A block's outputs as a list (one output comes alone)."""
    return list(result) if isinstance(result, (list, tuple)) else [result]


def forward_for_backward(model: mx.gluon.HybridBlock | Recomputed, images: mx.nd.NDArray
                         ) -> tuple[mx.nd.NDArray, Callable]:
    """The embeddings of `images` and the function that back-propagates a gradient of
    them into the backbone's parameters: recorded whole, or with recomputation."""
    if isinstance(model, Recomputed):
        return model.forward(images)
    with mx.autograd.record():
        embeddings = model(images)
    return embeddings, embeddings.backward
