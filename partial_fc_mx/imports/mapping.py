"""Lay a source's layers (layers.py) onto our network of the same architecture, in
order: our weighted layers and theirs come in the same sequence, each checked for
kind and shape, so a wrong `--network` or an unknown architecture stops at the first
layer that does not fit, named on both sides.

Three differences are bridged exactly (the same function in inference):
  - a BatchNorm folded into the convolution or fully connected layer before it (an
    ONNX export in eval mode folds those after convolutions; torch's dynamo exporter
    also the embedding's): the layer gains a bias, the BatchNorm is gone; our BatchNorm
    after that layer becomes the identity plus that bias, its statistics to be
    estimated (calibration.py);
  - a different epsilon (insightface's MXNet models: 2e-5; a BatchNorm with its scale
    fixed at 1 (MXNet's fix_gamma, ours in the embedding's BatchNorm) where the
    other learned one: both moved into the variance;
  - the input's scale (1/127.5 against our 1/128): moved into the first convolution.
A ViT's position embedding, a parameter of the network itself rather than of a
layer, takes its place after the patch embedding, where the source adds it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import mxnet as mx
import numpy as np
from mxnet.gluon import nn

from ..data.network_input import PIXEL_SCALE
from .layers import (
    BackboneImportError,
    Conv,
    Dense,
    Norm,
    Position,
    Slope,
    Source,
    TokenNorm,
    describe,
)

WEIGHTED = (nn.Conv2D, nn.BatchNorm, nn.PReLU, nn.LayerNorm, nn.Dense)
SOURCE_KIND = {nn.Conv2D: Conv, nn.BatchNorm: Norm, nn.PReLU: Slope, nn.LayerNorm: TokenNorm,
               nn.Dense: Dense, mx.gluon.Parameter: Position}
POSITION = "pos_embed"
"""The ViTs' position embedding (backbones/vit.py)."""


@dataclass
class Mapping:
    """What the assignment did: `checkpoints`, (our layer's name, the source tensor it
    must equal) after each layer where both compute the same thing (to find the first
    that differs); `folded`, our BatchNorms that took a folded one's place."""

    checkpoints: list = field(default_factory=list)
    folded: list = field(default_factory=list)


def named_layers(block, prefix: str = ""):
    """Every block under `block` with its structural name (features.3.body.1, as
    checkpoints name its parameters), in the order they were added, or in the
    `compute_order` a block that computes them in another order names."""
    children = block._children
    order = getattr(block, "compute_order", children)
    assert sorted(order) == sorted(children), f"{type(block).__name__}.compute_order"
    for name in order:
        yield f"{prefix}{name}", children[name]
        yield from named_layers(children[name], f"{prefix}{name}.")


@contextmanager
def forward_hooks(net, names: list[str], record) -> Iterator[None]:
    """Within the block, `record(name, inputs, output)` after each forward of the named
    layers (the network must run unhybridized: a cached graph calls no hooks)."""
    layers = dict(named_layers(net))
    hooks = [layers[name].register_forward_hook(
        lambda block, inputs, output, name=name: record(name, inputs, output))
        for name in names]
    try:
        yield
    finally:
        for hook in hooks:
            hook.detach()


def weighted_layers(net) -> list[tuple[str, object]]:
    """Our network's weighted layers in the order it computes them: each block's
    children run in the order they were added (or its `compute_order`), the shortcut
    after the body; a ViT's position embedding right after its patch embedding."""
    layers = [(name, block) for name, block in named_layers(net) if isinstance(block, WEIGHTED)]
    position = getattr(net, POSITION, None)
    if isinstance(position, mx.gluon.Parameter):
        layers.insert(1, (POSITION, position))
    return layers


def assign(net, source: Source) -> Mapping:
    """Set `net`'s parameters (initialized, float32) from `source`; raise naming the
    first pair of layers that does not fit."""
    ours, theirs = weighted_layers(net), list(source.layers)
    mapping, position, pending_bias = Mapping(), 0, None
    for index, (name, block) in enumerate(ours):
        if isinstance(block, nn.BatchNorm) and pending_bias is not None:
            conv, bias = pending_bias
            identity_with_bias(block, bias)
            mapping.folded.append(name)
            mapping.checkpoints.append((name, conv.output))
            pending_bias = None
            continue
        if position >= len(theirs):
            raise BackboneImportError(f"{source.path} ends before our layer {name} "
                                      f"({type(block).__name__}): not this network")
        layer = theirs[position]
        if not isinstance(layer, SOURCE_KIND[type(block)]):
            raise mismatch(source, position, layer, name, block, "a different kind of layer")
        following = theirs[position + 1] if position + 1 < len(theirs) else None
        own_norm = isinstance(following, Norm) and following.input == layer.output
        # a convolution's BatchNorm reads its output; the embedding's may read it through
        # a reshape: after a fully connected layer, any BatchNorm next is its own
        kept = own_norm or (isinstance(layer, Dense) and isinstance(following, Norm))
        norm_folded = (isinstance(layer, (Conv, Dense)) and not kept and index + 1 < len(ours)
                       and isinstance(ours[index + 1][1], nn.BatchNorm))
        if norm_folded:  # the BatchNorm after it was folded into it: its bias goes into ours
            pending_bias = (layer, layer.bias if layer.bias is not None
                            else np.zeros(len(layer.weight), np.float32))
        if isinstance(layer, Conv):
            scale = source.input_scale / PIXEL_SCALE if index == 0 else 1.0
            set_conv(block, layer, scale, source, position, name)
            if block.bias is not None:  # a ViT's patch embedding
                expect(block.bias, layer.bias if layer.bias is not None else
                       np.zeros(len(layer.weight), np.float32), source, position, layer, name)
            elif layer.bias is not None and not norm_folded:
                if not own_norm:
                    raise mismatch(source, position, layer, name, block, "a bias ours lacks")
                theirs[position + 1] = shifted(following, -layer.bias)  # into its mean
        elif isinstance(layer, Norm):
            set_norm(block, layer, source, position, name)
            mapping.checkpoints.append((name, layer.output))
        elif isinstance(layer, TokenNorm):
            set_token_norm(block, layer, source, position, name)
            mapping.checkpoints.append((name, layer.output))
        elif isinstance(layer, Position):
            expect(block, layer.value, source, position, layer, name)
        elif isinstance(layer, Slope):
            slopes = layer.alpha.reshape(-1)
            if slopes.size == 1:  # one slope for every channel (layout.py): the same function
                slopes = np.repeat(slopes, block.alpha.shape[0])
            expect(block.alpha, slopes, source, position, layer, name)
            mapping.checkpoints.append((name, layer.output))
        else:
            if norm_folded:  # torch's dynamo exporter folds the embedding's BatchNorm in
                bias = None if block.bias is None else np.zeros(len(layer.weight), np.float32)
                layer = Dense(layer.weight, bias, layer.output)
            elif layer.bias is not None and block.bias is None and own_norm:
                theirs[position + 1] = shifted(following, -layer.bias)  # insightface's GDC
                layer = Dense(layer.weight, None, layer.output)
            else:
                mapping.checkpoints.append((name, layer.output))
            set_dense(block, layer, source, position, name)
        position += 1
    if position < len(theirs):
        raise BackboneImportError(
            f"{source.path} has layers past our network's last ({ours[-1][0]}), from layer "
            f"{position}: {describe(theirs[position])}; not this network")
    return mapping


def set_conv(block: nn.Conv2D, layer: Conv, scale: float, source: Source, position: int,
             name: str) -> None:
    options = block._kwargs
    ours = (tuple(options["stride"]), tuple(options["pad"]), options["num_group"])
    if ours != (tuple(layer.stride), tuple(layer.padding), layer.groups):
        raise mismatch(source, position, layer, name, block,
                       f"stride, padding, groups {(layer.stride, layer.padding, layer.groups)}"
                       f" where ours are {ours}")
    expect(block.weight, layer.weight * np.float32(scale), source, position, layer, name)


def set_norm(block: nn.BatchNorm, layer: Norm, source: Source, position: int,
             name: str) -> None:
    """Their BatchNorm into ours: the same function with our epsilon, and with our
    scale fixed at 1 where ours has no learned scale (moved into the variance)."""
    eps = block._kwargs["eps"]
    var = layer.var.astype(np.float64) + layer.eps
    gamma = layer.gamma.astype(np.float64)
    if not block._kwargs["fix_gamma"]:
        expect(block.gamma, gamma, source, position, layer, name)
    elif not np.allclose(gamma, 1.0):
        if (gamma <= 0).any():
            raise mismatch(source, position, layer, name, block,
                           "a scale <= 0 where ours is fixed at 1")
        var = var / gamma ** 2
    expect(block.beta, layer.beta, source, position, layer, name)
    put(block.running_mean, layer.mean)
    put(block.running_var, np.maximum(var - eps, 0))


def set_token_norm(block: nn.LayerNorm, layer: TokenNorm, source: Source, position: int,
                   name: str) -> None:
    """A LayerNorm's epsilon cannot be moved anywhere (each token's own variance is
    under it): it must be ours."""
    eps = block._kwargs["eps"]
    if not np.isclose(layer.eps, eps, rtol=1e-3):
        raise mismatch(source, position, layer, name, block,
                       f"epsilon {layer.eps:g} where ours is {eps:g}")
    expect(block.gamma, layer.gamma, source, position, layer, name)
    expect(block.beta, layer.beta, source, position, layer, name)


def set_dense(block: nn.Dense, layer: Dense, source: Source, position: int, name: str) -> None:
    expect(block.weight, layer.weight, source, position, layer, name)
    if (block.bias is None) != (layer.bias is None):
        raise mismatch(source, position, layer, name, block,
                       "a bias where ours has none" if block.bias is None else
                       "no bias where ours has one")
    if layer.bias is not None:
        expect(block.bias, layer.bias, source, position, layer, name)


def identity_with_bias(block: nn.BatchNorm, bias: np.ndarray) -> None:
    """Our BatchNorm as x + bias (in inference): the folded one's place."""
    eps = block._kwargs["eps"]
    channels = len(bias)
    put(block.gamma, np.ones(channels, np.float32))
    put(block.beta, bias)
    put(block.running_mean, np.zeros(channels, np.float32))
    put(block.running_var, np.full(channels, 1 - eps, np.float32))


def shifted(norm: Norm, shift: np.ndarray) -> Norm:
    """A BatchNorm after a convolution's bias, as one after the bias-free convolution."""
    return Norm(norm.gamma, norm.beta, norm.mean + shift, norm.var, norm.eps, norm.output,
                norm.input)


def expect(parameter, value: np.ndarray, source: Source, position: int, layer, name: str) -> None:
    if tuple(parameter.shape) != tuple(value.shape):
        raise mismatch(source, position, layer, name, None,
                       f"{parameter.name.split('_')[-1]} of shape {tuple(value.shape)} where "
                       f"ours is {tuple(parameter.shape)}")
    put(parameter, value)


def put(parameter, value: np.ndarray) -> None:
    parameter.set_data(mx.nd.array(np.asarray(value, np.float32)))


def mismatch(source: Source, position: int, layer, name: str, block, why: str
             ) -> BackboneImportError:
    ours = f"our {name}" + (f" ({type(block).__name__})" if block is not None else "")
    return BackboneImportError(
        f"{source.path}: its layer {position}, {describe(layer)}, does not fit {ours}: "
        f"{why}. Is --network the model's architecture?")
