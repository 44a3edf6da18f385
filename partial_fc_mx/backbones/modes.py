"""A network's graph as a block over the network's own Parameter objects, and the
pair of such blocks a network needs when its training graph cannot infer: a ViT
that masks patches trains on the kept tokens only (vit.py), so inference needs the
graph of all of them. Updating the network's parameters updates every block."""

from __future__ import annotations

import mxnet as mx
from mxnet.gluon import HybridBlock, SymbolBlock


def graph_block(graph: mx.sym.Symbol, inputs: tuple[str, ...], net: HybridBlock,
                static_alloc: bool = True) -> SymbolBlock:
    """`graph` as a hybridized block over `net`'s Parameter objects."""
    block = SymbolBlock(graph, [mx.sym.var(name, dtype="float32") for name in inputs],
                        params=net.collect_params())
    block.hybridize(static_alloc=static_alloc, static_shape=static_alloc)
    return block


class ByMode:
    """`training` under autograd's training mode (the trainer records the forward in
    it), `inference` outside it (evaluation): one callable for both, so no caller can
    run the training graph on a verification set."""

    def __init__(self, training, inference) -> None:
        self.training = training
        self.inference = inference

    def __call__(self, x: mx.nd.NDArray) -> mx.nd.NDArray:
        return (self.training if mx.autograd.is_training() else self.inference)(x)
