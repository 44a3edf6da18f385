"""ONNX backbones as arcface_torch's torch2onnx.py writes them, built with onnx's helper
API and random weights, for the import tests (no torch here).

Written from arcface_torch's own definitions (backbones/iresnet.py, mobilefacenet.py,
vit.py):
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


def vit(path: Path, dynamo: bool, embed: int = 256, depth: int = 12, heads: int = 8,
        embedding: int = 512, seed: int = 0, norm_eps: float = EPS) -> Path:
    """arcface_torch's VisionTransformer (get_model("vit_t"): width 256, depth 12) as its
    eval-mode export writes it: the 9 x 9 patch convolution with a bias, the position
    embedding added, each block's pre-norm attention (qkv without a bias, the heads by
    Reshape/Transpose/Gather, scores scaled after the product) and ReLU6 MLP (Clip),
    the final LayerNorm, the head over all 144 tokens: Linear, BatchNorm1d (eps 2e-5),
    Linear, BatchNorm1d. `dynamo` False: the TorchScript exporter at opset 11, each
    LayerNorm spelled out (ReduceMean ... Add) and the head's BatchNorms kept; True: the
    dynamo exporter's opset 18, LayerNormalization nodes and the head's BatchNorms
    folded into its fully connected layers (Gemm with a bias). `norm_eps`: the
    LayerNorms' epsilon (ours: 1e-5)."""
    g, tokens, width = Graph(seed, folded=dynamo), 144, embed // heads

    def constant(path: str, value) -> str:
        name = f"{path}/Constant_output_0"
        g.nodes.append(helper.make_node("Constant", [], [name], name=f"{path}/Constant",
                                        value=numpy_helper.from_array(np.asarray(value))))
        return name

    def layer_norm(x: str, module: str) -> str:
        gamma = g.const(f"{module}.weight", g.rng.uniform(0.5, 1.5, embed))
        beta = g.const(f"{module}.bias", g.rng.normal(0, 0.1, embed))
        path = scope(module)
        if dynamo:
            return g.node("LayerNormalization", path, [x, gamma, beta], axis=-1,
                          epsilon=norm_eps)
        mean = g.node("ReduceMean", path, [x], axes=[-1])
        centered = g.node("Sub", path, [x, mean])
        squared = g.node("Pow", path, [centered, constant(f"{path}/pow", np.float32(2))])
        variance = g.node("ReduceMean", f"{path}/var", [squared], axes=[-1])
        shifted = g.node("Add", path, [variance, constant(f"{path}/eps",
                                                          np.float32(norm_eps))])
        deviation = g.node("Sqrt", path, [shifted])
        scaled = g.node("Mul", path, [g.node("Div", path, [centered, deviation]), gamma])
        return g.node("Add", f"{path}/beta", [scaled, beta])

    def linear(x: str, module: str, cin: int, cout: int, bias: bool = True) -> str:
        weight = g.rng.normal(0, 0.02, (cout, cin))
        y = g.node("MatMul", scope(module), [x, g.anonymous("MatMul", weight.T)])
        if bias:
            y = g.node("Add", scope(module), [g.const(f"{module}.bias",
                                                       g.rng.normal(0, 0.1, cout)), y])
        return y

    def head(x: str, module: str, norm: str, cin: int, cout: int) -> str:
        weight = g.rng.normal(0, np.sqrt(1.0 / cin), (cout, cin))
        values = g.norm_values(cout)
        if not dynamo:
            x = g.node("MatMul", scope(module), [x, g.anonymous("MatMul", weight.T)])
            return g.node("BatchNormalization", scope(norm), [x, *(
                g.const(f"{norm}.{k}", values[k]) for k in
                ("weight", "bias", "running_mean", "running_var"))], epsilon=2e-5)
        k = values["weight"] / np.sqrt(values["running_var"] + 2e-5)
        return g.node("Gemm", scope(module), [
            x, g.const(f"{module}.weight", weight * k[:, None]),
            g.const(f"{module}.weight_bias", values["bias"] - values["running_mean"] * k)],
            transB=1)

    fan_in = 3 * 81
    x = g.node("Conv", "/patch_embed/proj", [
        "data", g.const("patch_embed.proj.weight",
                        g.rng.uniform(-1, 1, (embed, 3, 9, 9)) / np.sqrt(fan_in)),
        g.const("patch_embed.proj.bias", g.rng.uniform(-1, 1, embed) / np.sqrt(fan_in))],
        kernel_shape=[9, 9], strides=[9, 9], pads=[0] * 4)
    x = g.node("Reshape", "/patch_embed", [x, g.anonymous("Reshape", np.array([0, embed, -1]))])
    x = g.node("Transpose", "/patch_embed", [x], perm=[0, 2, 1])
    x = g.node("Add", "", [x, g.const("pos_embed", g.rng.normal(0, 0.02, (1, tokens, embed)))])
    for i in range(depth):
        m = f"blocks.{i}"
        qkv = linear(layer_norm(x, f"{m}.norm1"), f"{m}.attn.qkv", embed, 3 * embed, bias=False)
        qkv = g.node("Reshape", f"/{m}/attn", [qkv, g.anonymous("Reshape", np.array(
            [0, tokens, 3, heads, width]))])
        qkv = g.node("Transpose", f"/{m}/attn", [qkv], perm=[2, 0, 3, 1, 4])
        q, k, v = (g.node("Gather", f"/{m}/attn/{part}", [qkv, g.anonymous("Gather", np.array(
            index))], axis=0) for index, part in enumerate("qkv"))
        scores = g.node("MatMul", f"/{m}/attn", [q, g.node("Transpose", f"/{m}/attn/k", [k],
                                                            perm=[0, 1, 3, 2])])
        scores = g.node("Mul", f"/{m}/attn", [scores, g.anonymous("Mul",
                                                                   np.float32(width ** -0.5))])
        attended = g.node("MatMul", f"/{m}/attn/v", [g.node("Softmax", f"/{m}/attn", [scores],
                                                            axis=-1), v])
        attended = g.node("Reshape", f"/{m}/attn/heads", [
            g.node("Transpose", f"/{m}/attn/heads", [attended], perm=[0, 2, 1, 3]),
            g.anonymous("Reshape", np.array([0, tokens, embed]))])
        x = g.node("Add", f"/{m}", [x, linear(attended, f"{m}.attn.proj", embed, embed)])
        hidden = linear(layer_norm(x, f"{m}.norm2"), f"{m}.mlp.fc1", embed, 4 * embed)
        hidden = g.node("Clip", f"/{m}/mlp/act", [hidden, constant(f"/{m}/mlp/min", np.float32(0)),
                                                  constant(f"/{m}/mlp/max", np.float32(6))])
        x = g.node("Add", f"/{m}/mlp", [x, linear(hidden, f"{m}.mlp.fc2", 4 * embed, embed)])
    x = layer_norm(x, "norm")
    x = g.node("Reshape", "", [x, g.anonymous("Reshape", np.array([0, -1]))])
    x = head(x, "feature.0", "feature.1", tokens * embed, embed)
    x = head(x, "feature.2", "feature.3", embed, embedding)
    return g.save(path, "data", x, embedding, opset=18 if dynamo else 11)


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
