"""ONNX backbones as arcface_torch's torch2onnx.py writes them, built with onnx's helper
API and random weights, for the import tests (no torch here).

Written from arcface_torch's own definitions (backbones/iresnet.py, mobilefacenet.py):
layer order, strides, groups, a PReLU slope per channel; names as torch's exporter
gives them (module paths for the weights it keeps, onnx::Conv_N for those it folds).
In eval mode the exporter folds every BatchNorm that follows a convolution into it
(`folded`); the others stay BatchNormalization nodes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

EPS = 1e-5


def scope(module: str) -> str:
    """torch's exporter's node scope of a module: layer1.0.conv2 -> /layer1/layer1.0/conv2
    (an index in a Sequential joins its parent's name)."""
    parts = module.split(".")
    names = [f"{parts[i - 1]}.{part}" if part.isdigit() and i else part
             for i, part in enumerate(parts)]
    return "/" + "/".join(names)


class Graph:
    def __init__(self, seed: int, folded: bool, conv_bias: bool = False) -> None:
        self.rng, self.folded, self.conv_bias = np.random.default_rng(seed), folded, conv_bias
        self.nodes, self.inits, self.count = [], [], 0

    def const(self, name: str, value: np.ndarray) -> str:
        value = np.asarray(value)  # weights as float32, shapes (integers) as int64
        value = value.astype(np.int64 if value.dtype.kind == "i" else np.float32)
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def anonymous(self, op: str, value: np.ndarray) -> str:
        self.count += 1
        return self.const(f"onnx::{op}_{self.count}", value)

    def node(self, op: str, path: str, inputs: list, **attributes) -> str:
        output = f"{path}/{op}_output_0"
        self.nodes.append(helper.make_node(op, inputs, [output], name=f"{path}/{op}",
                                           **attributes))
        return output

    def norm_values(self, channels: int) -> dict:
        r = self.rng
        return {"weight": r.uniform(0.5, 1.5, channels), "bias": r.normal(0, 0.1, channels),
                "running_mean": r.normal(0, 0.1, channels),
                "running_var": r.uniform(0.5, 1.5, channels)}

    def norm(self, x: str, module: str, channels: int, values: dict | None = None) -> str:
        values = values or self.norm_values(channels)
        names = [self.const(f"{module}.{k}", values[k])
                 for k in ("weight", "bias", "running_mean", "running_var")]
        return self.node("BatchNormalization", scope(module), [x, *names],
                         epsilon=EPS)

    def conv_norm(self, x: str, conv: str, norm: str | None, cin: int, cout: int, kernel: int,
                  stride: int = 1, groups: int = 1) -> str:
        """A bias-free convolution and the BatchNorm after it (if any), as exported."""
        fan_in = cin // groups * kernel * kernel
        weight = self.rng.normal(0, np.sqrt(1.0 / fan_in), (cout, cin // groups, kernel, kernel))
        options = {"kernel_shape": [kernel] * 2, "strides": [stride] * 2,
                   "pads": [0 if kernel == 7 else kernel // 2] * 4,  # the GDC's 7 x 7: none
                   "group": groups, "dilations": [1, 1]}
        path = scope(conv)
        if norm is None:
            return self.node("Conv", path, [x, self.const(f"{conv}.weight", weight)], **options)
        values = self.norm_values(cout)
        if not self.folded:  # conv_bias: a bias before the BatchNorm (folded into its mean)
            bias = [self.const(f"{conv}.bias", self.rng.normal(0, 0.1, cout))] \
                if self.conv_bias else []
            y = self.node("Conv", path, [x, self.const(f"{conv}.weight", weight), *bias],
                          **options)
            return self.norm(y, norm, cout, values)
        factor = values["weight"] / np.sqrt(values["running_var"] + EPS)
        fused_weight = self.anonymous("Conv", weight * factor[:, None, None, None])
        fused_bias = self.anonymous("Conv", values["bias"] - values["running_mean"] * factor)
        return self.node("Conv", path, [x, fused_weight, fused_bias], **options)

    def prelu(self, x: str, module: str, channels: int) -> str:
        slope = self.rng.uniform(0.1, 0.3, channels).reshape(channels, 1, 1)
        return self.node("PRelu", scope(module),
                         [x, self.anonymous("PRelu", slope)])

    def save(self, path: Path, x: str, output: str, embedding: int, opset: int = 11) -> Path:
        graph = helper.make_graph(
            self.nodes, "torch_jit", [helper.make_tensor_value_info(x, TensorProto.FLOAT,
                                                                    ["batch", 3, 112, 112])],
            [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["batch", embedding])],
            self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                                  producer_name="pytorch")
        model.ir_version = 6 if opset == 11 else 7
        onnx.checker.check_model(model)
        onnx.save(model, str(path))
        return path


def iresnet(path: Path, layers=(2, 2, 2, 2), widths=(64, 128, 256, 512), stem: int = 64,
            stem_stride: int = 1, embedding: int = 512, seed: int = 0, folded: bool = True,
            normalize: tuple | None = None, scale_after: str | None = None,
            scale_by: float = 1.5, conv_bias: bool = False, features_gamma: bool = False,
            features_folded: bool = False) -> Path:
    """arcface_torch's IResNet (iresnet18: layers (2, 2, 2, 2); iresnet50: (3, 4, 14, 3));
    other widths and a strided stem give our `tiny` its shape. `normalize`: (mean,
    scale) applied inside the graph by Sub and Mul of Constant nodes (value_float, as
    opset 12 writes them), as some converted models do; `scale_after`: a module whose
    output the graph multiplies by `scale_by` (a graph that computes otherwise, or one
    whose activations overflow float32); `conv_bias`
    (with folded=False): convolutions with a bias before their BatchNorm;
    `features_gamma`: the embedding's BatchNorm with a learned scale where ours has
    none (moved into its variance); `features_folded`: that BatchNorm folded into the
    fully connected layer before it, as torch's dynamo exporter (torch >= 2.9) does."""
    g = Graph(seed, folded, conv_bias)
    x = "data"
    if normalize:
        for op, value in (("Sub", normalize[0]), ("Mul", normalize[1])):
            constant = f"/normalize/{op}_constant"
            g.nodes.append(helper.make_node("Constant", [], [constant], value_float=value))
            x = g.node(op, "/normalize", [x, constant])
    x = g.conv_norm(x, "conv1", "bn1", 3, stem, 3, stem_stride)
    x = g.prelu(x, "prelu", stem)
    inplanes = stem
    for stage, (blocks, planes) in enumerate(zip(layers, widths), 1):
        for i in range(blocks):
            m = f"layer{stage}.{i}"
            stride = 2 if i == 0 else 1
            y = g.norm(x, f"{m}.bn1", inplanes)
            y = g.conv_norm(y, f"{m}.conv1", f"{m}.bn2", inplanes, planes, 3)
            y = g.prelu(y, f"{m}.prelu", planes)
            if scale_after == f"{m}.prelu":
                y = g.node("Mul", f"/{m}/scaled", [y, g.anonymous("Mul", np.float32(scale_by))])
            y = g.conv_norm(y, f"{m}.conv2", f"{m}.bn3", planes, planes, 3, stride)
            identity = x
            if i == 0:
                identity = g.conv_norm(x, f"{m}.downsample.0", f"{m}.downsample.1", inplanes,
                                       planes, 1, stride)
            x = g.node("Add", f"/layer{stage}/{m}", [y, identity])
            inplanes = planes
    x = g.norm(x, "bn2", inplanes)
    if features_folded:  # the dynamo exporter's view(): the example's batch of 1, fixed
        x = g.node("Reshape", "/view", [x, g.anonymous("Reshape", np.array([1, -1]))])
    else:
        x = g.node("Flatten", "", [x], axis=1)
    fc = g.rng.normal(0, np.sqrt(1.0 / (inplanes * 49)), (embedding, inplanes * 49))
    fc_bias = g.rng.normal(0, 0.1, embedding)
    values = g.norm_values(embedding)
    if not features_gamma:
        values["weight"] = np.ones(embedding)  # fixed at 1, as arcface_torch's
    if features_folded:
        k = values["weight"] / np.sqrt(values["running_var"] + EPS)
        fc, fc_bias = fc * k[:, None], (fc_bias - values["running_mean"]) * k + values["bias"]
    x = g.node("Gemm", "/fc", [x, g.const("fc.weight", fc), g.const("fc.bias", fc_bias)],
               alpha=1.0, beta=1.0, transB=1)
    if not features_folded:
        x = g.norm(x, "features", embedding, values)
    return g.save(path, "data", x, embedding, opset=12 if normalize else 11)


def tiny(path: Path, **options) -> Path:
    """An IResNet of our `tiny`'s shape, as the exporter would write it."""
    return iresnet(path, layers=(1, 1, 1), widths=(32, 64, 128), stem=16, stem_stride=2,
                   **options)


def mobilefacenet(path: Path, scale: int = 2, embedding: int = 512, seed: int = 0,
                  folded: bool = True) -> Path:
    """arcface_torch's MobileFaceNet (get_model("mbf"): scale 2, blocks (1, 4, 6, 2)):
    ConvBlock = conv, BatchNorm, PReLU; LinearBlock = conv, BatchNorm; DepthWise = 1x1
    ConvBlock to `groups`, its grouped 3x3 ConvBlock, a 1x1 LinearBlock (plus the input
    when residual); the GDC's fully connected layer has no bias (exported as MatMul)."""
    g = Graph(seed, folded)

    def block(x: str, module: str, cin: int, cout: int, kernel: int, stride: int = 1,
              groups: int = 1, act: bool = True) -> str:
        y = g.conv_norm(x, f"{module}.layers.0", f"{module}.layers.1", cin, cout, kernel,
                        stride, groups)
        return g.prelu(y, f"{module}.layers.2", cout) if act else y

    def depthwise(x: str, module: str, cin: int, cout: int, groups: int, stride: int,
                  residual: bool) -> str:
        y = block(x, f"{module}.layers.0", cin, groups, 1)
        y = block(y, f"{module}.layers.1", groups, groups, 3, stride, groups)
        y = block(y, f"{module}.layers.2", groups, cout, 1, act=False)
        return g.node("Add", scope(module), [x, y]) if residual else y

    narrow, wide = 64 * scale, 128 * scale
    x = block("data", "layers.0", 3, narrow, 3, 2)
    x = block(x, "layers.1", narrow, narrow, 3, 1, 64)
    x = depthwise(x, "layers.2", narrow, narrow, 128, 2, False)
    for i in range(4):
        x = depthwise(x, f"layers.3.layers.{i}", narrow, narrow, 128, 1, True)
    x = depthwise(x, "layers.4", narrow, wide, 256, 2, False)
    for i in range(6):
        x = depthwise(x, f"layers.5.layers.{i}", wide, wide, 256, 1, True)
    x = depthwise(x, "layers.6", wide, wide, 512, 2, False)
    for i in range(2):
        x = depthwise(x, f"layers.7.layers.{i}", wide, wide, 256, 1, True)
    x = block(x, "conv_sep", wide, 512, 1)
    x = g.conv_norm(x, "features.layers.0.layers.0", "features.layers.0.layers.1", 512, 512, 7,
                    groups=512)
    x = g.node("Flatten", "/features/layers.1", [x], axis=1)
    linear = g.rng.normal(0, np.sqrt(1.0 / 512), (embedding, 512))
    x = g.node("MatMul", "/features/layers.2", [x, g.anonymous("MatMul", linear.T)])
    x = g.norm(x, "features.layers.3", embedding)
    return g.save(path, "data", x, embedding)


def insightface_mxnet_model(prefix: Path, symbol: Path, seed: int = 0,
                            classifier: int = 0) -> Path:
    """PREFIX-symbol.json (a copy of `symbol`) and PREFIX-0000.params with random weights
    in MXNet's format, as insightface's MXNet-era training saved them; `classifier`: as
    a checkpoint saved during training, with the fc7 layer of that many classes after
    the embedding."""
    import mxnet as mx

    graph = mx.sym.load(str(symbol))
    if classifier:
        graph = mx.sym.FullyConnected(graph, num_hidden=classifier, name="fc7")
    rng = np.random.default_rng(seed)
    arg_shapes, _, aux_shapes = graph.infer_shape(data=(1, 3, 112, 112))
    params = {}
    for kind, names, shapes in (("arg", graph.list_arguments(), arg_shapes),
                                ("aux", graph.list_auxiliary_states(), aux_shapes)):
        for name, shape in zip(names, shapes):
            if name == "data":
                continue
            if name.endswith("_weight"):
                value = rng.normal(0, np.sqrt(1.0 / np.prod(shape[1:])), shape)
            elif name.endswith("_gamma") and "relu" in name:  # a PReLU's slopes
                value = rng.uniform(0.1, 0.3, shape)
            elif name.endswith(("_gamma", "_moving_var")):
                value = rng.uniform(0.5, 1.5, shape)
            else:  # beta, bias, moving_mean
                value = rng.normal(0, 0.1, shape)
            params[f"{kind}:{name}"] = mx.nd.array(value.astype(np.float32))
    graph.save(f"{prefix}-symbol.json")
    mx.nd.save(f"{prefix}-0000.params", params)
    return Path(f"{prefix}-symbol.json")
