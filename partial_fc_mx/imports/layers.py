"""A backbone from another framework as what our networks are made of: its weighted
layers in the order its graph computes them, each with the name of the tensor it
outputs there (to compare with ours when they differ), plus how it wants its input.

A reader (onnx_source.py, mxnet_source.py) turns a file into a `Source`; mapping.py
lays the layers onto ours. Everything else in the source graph (additions,
flattening, dropout, a ViT's attention arithmetic) carries no weights and is the same
in ours by construction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..data.network_input import PIXEL_MEAN
from ..errors import UserError


class BackboneImportError(UserError, ValueError):
    """A model that cannot be imported; the message names the file and the layer."""


@dataclass
class Conv:
    weight: np.ndarray
    """out x in/groups x kh x kw"""
    bias: np.ndarray | None
    stride: tuple
    padding: tuple
    groups: int
    output: str


@dataclass
class Norm:
    gamma: np.ndarray
    beta: np.ndarray
    mean: np.ndarray
    var: np.ndarray
    eps: float
    output: str
    input: str
    """the tensor it normalizes: whether it is the BatchNorm of the convolution before it"""


@dataclass
class Slope:
    alpha: np.ndarray
    """one per channel"""
    output: str


@dataclass
class TokenNorm:
    """A LayerNorm over each token's features (the ViTs'): no running statistics."""

    gamma: np.ndarray
    beta: np.ndarray
    eps: float
    output: str


@dataclass
class Position:
    """A ViT's position embedding: the constant 1 x tokens x width added to the patch
    embedding's tokens."""

    value: np.ndarray
    output: str


@dataclass
class Dense:
    weight: np.ndarray
    """out x in"""
    bias: np.ndarray | None
    output: str


Layer = Conv | Norm | Slope | TokenNorm | Position | Dense


@dataclass
class Source:
    """A model read from a file: `layers` in graph order; `input_scale`, what it
    multiplies (pixel - 127.5) by before its first convolution (inside its graph or
    expected outside it); `run(pixels, outputs)`, the values of the named tensors for a
    batch of N x 3 x 112 x 112 float pixels in 0..255 (the last of `outputs` unnamed:
    the embedding)."""

    path: str
    kind: str
    layers: list = field(default_factory=list)
    input_scale: float = 1 / 127.5
    run: Callable[[np.ndarray, list[str]], dict] | None = None


def describe(layer: Layer) -> str:
    """A layer as a message names it: its kind, its weight's shape, its output tensor."""
    if isinstance(layer, Conv):
        shape = f"convolution {'x'.join(map(str, layer.weight.shape))}"
    elif isinstance(layer, Norm):
        shape = f"BatchNorm of {len(layer.gamma)} channels"
    elif isinstance(layer, Slope):
        shape = f"PReLU of {len(layer.alpha)} channels"
    elif isinstance(layer, TokenNorm):
        shape = f"LayerNorm of {len(layer.gamma)} features"
    elif isinstance(layer, Position):
        shape = f"position embedding {'x'.join(map(str, layer.value.shape))}"
    else:
        shape = f"fully connected {'x'.join(map(str, layer.weight.shape))}"
    return f"{shape} (output {layer.output!r})"


def affine_input(scale: float, shift: float, path: str) -> float:
    """The input scale of a graph that computes scale * pixel + shift before its first
    convolution: the mean it subtracts must be 127.5, as ours (a different mean cannot
    be moved into the convolution: its zero padding would not move with it)."""
    if scale <= 0 or abs(-shift / scale - PIXEL_MEAN) > 1e-3:
        raise BackboneImportError(
            f"{path} normalizes its input as {scale:g} * pixel + {shift:g} (mean "
            f"{-shift / scale if scale else float('nan'):g}); only a mean of 127.5 can be "
            "imported, as insightface's and arcface_torch's models have")
    return scale
