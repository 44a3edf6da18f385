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


def repeated_slope(name: str, saved: mx.nd.NDArray, shape: tuple) -> mx.nd.NDArray | None:
    """`saved` repeated to `shape` when it is a per-layer PReLU slope (or its optimizer
    state) and `shape` the per-channel one; None for anything else."""
    if (name.endswith("alpha") and saved.shape == (1,) and len(shape) == 1
            and shape[0] > 1):
        return saved.broadcast_to(shape)
    return None


def load_parameters(net: mx.gluon.Block, path: str | os.PathLike, ctx: mx.Context) -> None:
    """net.load_parameters, accepting the earlier layout's per-layer slopes."""
    saved = mx.nd.load(str(path))
    params = net._collect_params_with_prefix()
    upgraded = {name: repeated_slope(name, value, params[name].shape)
                for name, value in saved.items() if name in params}
    upgraded = {name: value for name, value in upgraded.items() if value is not None}
    if not upgraded:
        net.load_parameters(str(path), ctx=ctx)
        return
    with tempfile.TemporaryDirectory() as folder:
        copy = Path(folder) / Path(path).name
        mx.nd.save(str(copy), {**saved, **upgraded})
        net.load_parameters(str(copy), ctx=ctx)
