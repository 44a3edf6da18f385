"""Parameter count and FLOPs of a backbone: `python -m partial_fc_mx model NAME`."""

from __future__ import annotations

import ast
import json

import mxnet as mx
import numpy as np
from mxnet.gluon import HybridBlock

from ..data.transforms import FACE_SIZE
from . import graph_of


def count_flops(net: HybridBlock, size: int = FACE_SIZE) -> tuple[int, int]:
    """(parameters, multiply-adds for one 3 x size x size image) of a net.

    Read from its inference graph with inferred shapes (no weights needed), counting
    convolutions, dense layers and batch_dot (a ViT's attention; everything else is a
    rounding error).
    """
    net.infer_shape(mx.nd.zeros((1, 3, size, size)))  # the parameters' shapes: nothing runs
    symbol = graph_of(net, training=False)  # a masking ViT trains on fewer tokens
    internals = symbol.get_internals()
    _, output_shapes, _ = internals.infer_shape(data=(1, 3, size, size))
    shapes = dict(zip(internals.list_outputs(), output_shapes))
    nodes = json.loads(symbol.tojson())["nodes"]
    macs = 0
    for node in nodes:
        if node["op"] not in ("Convolution", "FullyConnected", "batch_dot"):
            continue
        out = shapes[f"{node['name']}_output"]
        source = nodes[node["inputs"][0][0]]
        source_name = source["name"] if source["op"] == "null" else f"{source['name']}_output"
        data = shapes[source_name]
        if node["op"] == "batch_dot":  # out is batch x M x N; the sum runs over K
            transpose_a = node.get("attrs", {}).get("transpose_a") == "True"
            macs += int(np.prod(out)) * data[1 if transpose_a else 2]
        elif node["op"] == "Convolution":
            kernel = np.prod(ast.literal_eval(node["attrs"]["kernel"]))  # e.g. "(3, 3)"
            macs += int(np.prod(out)) * data[1] // int(node["attrs"].get("num_group", 1)) * kernel
        elif node.get("attrs", {}).get("flatten") == "False":  # over the last axis only
            macs += int(np.prod(out)) * data[-1]
        else:
            macs += int(np.prod(out)) * int(np.prod(data[1:]))
    params = sum(int(np.prod(p.shape)) for p in net.collect_params().values())
    return params, int(macs)
