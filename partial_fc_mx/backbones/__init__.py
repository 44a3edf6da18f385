"""Backbones by name: iresnet18/34/50/100/200 (r18 ... r200), mobilefacenet, mbf, tiny,
and the Vision Transformers vit_t ... vit_h (vit.py).

The names arcface_torch's `get_model` knows (r18 ... r200, mbf, the vit_ names) build
its layers with the same parameter shapes."""

from __future__ import annotations

import mxnet as mx
from mxnet.gluon import HybridBlock

from .iresnet import DEPTHS, IResNet
from .mobilefacenet import MobileFaceNet
from .vit import VIT_SIZES, VisionTransformer

MOBILEFACENET_SCALES = {"mobilefacenet": 1, "mbf": 2}
"""The original MobileFaceNet, and arcface_torch's `get_model("mbf")` (twice as wide)."""

NAMES = sorted([*DEPTHS, *MOBILEFACENET_SCALES, *VIT_SIZES, "tiny"])


def unknown_network(name: str) -> str | None:
    """Why `name` names no backbone, or None when it names one."""
    if name.replace("iresnet", "r") in NAMES:
        return None
    return f"unknown network {name!r}; choose one of {', '.join(NAMES)}"


def dropout_problem(name: str, dropout: float) -> str | None:
    """Why `dropout` cannot apply to network `name`, or None."""
    if dropout and name in VIT_SIZES:
        return (f"dropout={dropout}: {name} has no dropout layer (arcface_torch's ViTs "
                "drop paths in training instead, at their own rate); set dropout = 0")
    return None


def get_model(name: str, embedding_size: int = 512, dropout: float = 0.0) -> HybridBlock:
    """`tiny` is a 3-stage IResNet with one unit per stage and 16-64 channels: small
    enough to train on a CPU in minutes (tests, the ORL default job)."""
    if problem := unknown_network(name):
        raise ValueError(problem)
    name = name.replace("iresnet", "r")
    if name in DEPTHS:
        return IResNet(DEPTHS[name], embedding_size=embedding_size, dropout=dropout)
    if name in MOBILEFACENET_SCALES:
        return MobileFaceNet(embedding_size, dropout, MOBILEFACENET_SCALES[name])
    if name in VIT_SIZES:
        if problem := dropout_problem(name, dropout):
            raise ValueError(problem)
        return VisionTransformer(VIT_SIZES[name], embedding_size)
    return IResNet((1, 1, 1), widths=(32, 64, 128), stem=16, stem_stride=2,
                   embedding_size=embedding_size, dropout=dropout)


def infers_with_another_graph(net: HybridBlock) -> bool:
    """Whether `net`'s training graph cannot run inference: a ViT that masks patches
    computes the kept tokens only in training (vit.py)."""
    return isinstance(net, VisionTransformer) and net.size.masks


def graph_of(net: HybridBlock, training: bool = True) -> mx.sym.Symbol:
    """`net`'s graph with its float32 input named "data", from calling it on a symbol:
    nothing runs and no cached graph is needed (the float32 network of a 16-bit run
    never runs forward). `training=False`: the graph for inference, without the
    operators a ViT uses in training only (its masking and drop path: vit.py); the
    other networks have one graph, whose Dropout and BatchNorm follow the mode."""
    data = mx.sym.var("data", dtype="float32")
    if isinstance(net, VisionTransformer):
        return net(data, training)
    return net(data)
