"""Backbone checkpoints of the earlier layout: one PReLU slope per layer, where the
networks now have one per channel, as insightface's. A single slope is the same
function as C equal slopes, so such a checkpoint (and its optimizer state) loads with
each slope repeated over the channels: the network computes what it computed before,
and training continues from there. Any other difference in shape stays an error."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import mxnet as mx


def is_per_layer_slope(name: str, saved: tuple, expected: tuple) -> bool:
    """Whether parameter `name`, saved with shape `saved` where `expected` is wanted, is a
    per-layer PReLU slope (or its optimizer state) to repeat over the channels."""
    return (name.endswith("alpha") and tuple(saved) == (1,) and len(expected) == 1
            and expected[0] > 1)


def load_parameters(net: mx.gluon.Block, path: str | os.PathLike, ctx: mx.Context) -> None:
    """net.load_parameters, accepting the earlier layout's per-layer slopes."""
    saved = mx.nd.load(str(path))
    params = net._collect_params_with_prefix()
    upgraded = {name: value.broadcast_to(params[name].shape) for name, value in saved.items()
                if name in params and is_per_layer_slope(name, value.shape, params[name].shape)}
    if not upgraded:
        net.load_parameters(str(path), ctx=ctx)
        return
    with tempfile.TemporaryDirectory() as folder:
        copy = Path(folder) / Path(path).name
        mx.nd.save(str(copy), {**saved, **upgraded})
        net.load_parameters(str(copy), ctx=ctx)
