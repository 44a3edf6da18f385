"""PReLU on the CPU: the training graph computes each per-channel PReLU with the
project's kernel (pfc/kernels/prelu.cc) in place of MXNet's LeakyReLU.

The backbones have insightface's PReLU, a slope per channel. MXNet 1.9 computes it
outside oneDNN, and its backward dominated a CPU step (68% of MobileFaceNet's, measured
in MXNet's profiler; docs/benchmarks.md has the step with each). Its slopes' gradient
is also wrong in some compiled graphs (the true one times the slopes: `mbf`'s first
PReLU, the parity study's MLP). The kernel computes the function and gradients PReLU
has (tests/test_cpu_prelu.py). Only the graph that trains is rewritten
(precision.training_model): the network's own graph, which checkpoints,
`backbone-symbol.json` and the ONNX export are written from, keeps LeakyReLU, so every
saved file loads in any MXNet without this project's library.
"""

from __future__ import annotations

import json

import mxnet as mx

from ..pfc import kernels


def with_prelu_kernel(graph: mx.sym.Symbol, threads: int) -> mx.sym.Symbol:
    """`graph` with every LeakyReLU of act_type "prelu" computed by pfc_prelu on
    `threads` OpenMP threads: the same inputs (data, slopes), node names and output.
    The kernel takes float32: in a bfloat16 graph AMP has cast PReLU's inputs to it.
    The graph goes through JSON with its casts: `tojson()` drops AMP's casts unless
    told not to, and a bfloat16 graph then computes in float32."""
    kernels.load()
    spec = json.loads(graph.tojson(remove_amp_cast=False))
    for node in spec["nodes"]:
        attributes = node.get("attrs", {})
        if node["op"] == "LeakyReLU" and attributes.get("act_type") == "prelu":
            node["op"] = "pfc_prelu"
            node["attrs"] = {**{k: v for k, v in attributes.items() if k.startswith("__")},
                             "threads": str(threads)}
    return mx.sym.load_json(json.dumps(spec))
