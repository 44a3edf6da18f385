"""The CPU's training graph with the project's kernels (pfc/kernels) in place of two
MXNet operators whose CPU code dominated a step:

- PReLU with a slope per channel (prelu.cc) for MXNet's LeakyReLU. The backbones have
  insightface's PReLU; MXNet 1.9 computes it outside oneDNN, and its backward was 68%
  of MobileFaceNet's step (MXNet's profiler; docs/benchmarks.md has the step with each).
  Its slopes' gradient is also wrong in some compiled graphs (the true one times the
  slopes: `mbf`'s first PReLU, the parity study's MLP).
- LayerNorm over the last axis (layer_norm.cc) for MXNet's LayerNorm, whose backward
  reduces through broadcast indexing: 32 ms against the kernel's 1.2 ms for one of
  vit_t's 25 at batch 16 on one thread, forward and backward.

Each kernel computes the function and gradients of the operator it replaces
(tests/test_cpu_kernels.py). Only the graph that trains is rewritten
(precision.training_model): the network's own graph, which checkpoints,
`backbone-symbol.json` and the ONNX export are written from, keeps MXNet's operators,
so every saved file loads in any MXNet without this project's library.
"""

from __future__ import annotations

import json

import mxnet as mx

from ..pfc import kernels

LAYER_NORM_EPS = "1e-05"
"""MXNet's LayerNorm's eps where a graph leaves it at its default."""


def with_cpu_kernels(graph: mx.sym.Symbol, threads: int) -> mx.sym.Symbol:
    """`graph` with every LeakyReLU of act_type "prelu" computed by pfc_prelu and every
    LayerNorm over the last axis by pfc_layer_norm, on `threads` OpenMP threads: the
    same inputs, node names and first output. The kernels take float32: in a bfloat16
    graph AMP has cast these operators' inputs to it. The graph goes through JSON with
    its casts: `tojson()` drops AMP's casts unless told not to, and a bfloat16 graph
    then computes in float32."""
    kernels.load()
    spec = json.loads(graph.tojson(remove_amp_cast=False))
    for node in spec["nodes"]:
        attributes = node.get("attrs", {})
        hidden = {k: v for k, v in attributes.items() if k.startswith("__")}
        if node["op"] == "LeakyReLU" and attributes.get("act_type") == "prelu":
            node["op"], node["attrs"] = "pfc_prelu", {**hidden, "threads": str(threads)}
        elif (node["op"] == "LayerNorm" and attributes.get("axis", "-1") == "-1"
              and attributes.get("output_mean_var", "False") in ("False", "false", "0")):
            # its mean and std outputs read by nothing: the kernel's second and third
            # outputs (mean and 1 / std) serve its own backward only
            node["op"], node["attrs"] = "pfc_layer_norm", {
                **hidden, "eps": attributes.get("eps", LAYER_NORM_EPS),
                "threads": str(threads)}
    return mx.sym.load_json(json.dumps(spec))
