"""Layers that a backbone's 16-bit graph keeps in float32, marked where the backbone
defines them.

arcface_torch calls its Vision Transformers outside autocast and enters it only around
the blocks' dense layers, so their patch convolution and feature head (the Linear over
all tokens and its BatchNorms) compute in float32. A backbone marks such layers by
creating them under `kept_in_float32()`; run/precision.py's AMP conversion leaves the
marked operators in float32 (casts before them, as before LayerNorm). The mark is an
attribute of the graph's nodes, so it travels with the graph to whatever converts it,
and it is meaningless elsewhere (the float32 graph, ONNX export)."""

from __future__ import annotations

import json

import mxnet as mx

ATTRIBUTE = "__pfc_float32__"


def kept_in_float32() -> mx.AttrScope:
    """A scope whose operators a 16-bit conversion leaves in float32."""
    return mx.AttrScope(**{ATTRIBUTE: "1"})


def float32_operators(graph: mx.sym.Symbol) -> list[str]:
    """The names of `graph`'s operators created under kept_in_float32 (not its variables)."""
    return [node["name"] for node in json.loads(graph.tojson())["nodes"]
            if node["op"] != "null" and node.get("attrs", {}).get(ATTRIBUTE) == "1"]
