"""An ONNX backbone as layers.py's `Source`: as arcface_torch's torch2onnx.py writes it
(input `data`, opset 11, PReLU slopes of C x 1 x 1, the fully connected layer as
Gemm or, without a bias, MatMul with its weight transposed; exported in eval mode,
so most BatchNorms are folded into the convolution before them; a ViT's LayerNorms
spelled out in arithmetic below opset 17, one LayerNormalization node from it) and as
insightface distributes its models (the same, some with the input's normalization
inside the graph).

Read with onnx's protobuf only: nothing in the file executes. The graph runs in
onnxruntime for the parity check.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ..data.network_input import PIXEL_MEAN
from .layers import (
    BackboneImportError,
    Conv,
    Dense,
    Norm,
    Position,
    Slope,
    Source,
    TokenNorm,
    affine_input,
)

TORCH_SCALE = 1 / 127.5
"""arcface_torch's normalization, outside its graph: (pixel - 127.5) / 127.5."""
AFFINE = {"Sub", "Add", "Mul", "Div"}


def read_onnx(path: str | Path) -> Source:
    path = str(path)
    try:
        model = onnx.load(path)
    except Exception as error:  # protobuf's DecodeError, OSError, ...
        raise BackboneImportError(f"{path} is not a readable ONNX file: {error}") from error
    graph = model.graph
    constants = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    for node in graph.node:  # torch's exporter passes shared weights through Identity
        if node.op_type == "Constant" and node.attribute:
            constants[node.output[0]] = constant_value(node.attribute[0])
        elif node.op_type == "Identity" and node.input[0] in constants:
            constants[node.output[0]] = constants[node.input[0]]
    inputs = [i.name for i in graph.input if i.name not in constants]
    if len(inputs) != 1:
        raise BackboneImportError(f"{path} has {len(inputs)} inputs ({inputs}); a backbone "
                                  "has one, the images")
    scale, shift, start = input_normalization(graph.node, inputs[0], constants)
    source = Source(path, "onnx", input_scale=affine_input(scale, shift, path)
                    if start else TORCH_SCALE)
    source.layers = layers_of(graph.node, constants, path)
    outside = not start  # the graph takes normalized pixels: normalize them here

    def run(pixels: np.ndarray, outputs: list[str]) -> dict:
        import onnxruntime

        probe = onnx.ModelProto()
        probe.CopyFrom(model)
        names = [o.name for o in probe.graph.output]
        for name in outputs:
            if name not in names:
                probe.graph.output.append(onnx.ValueInfoProto(name=name))
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3  # torch2onnx.py leaves the output's batch at 1: a warning
        session = onnxruntime.InferenceSession(probe.SerializeToString(), options,
                                               providers=["CPUExecutionProvider"])
        feed = ((pixels - PIXEL_MEAN) * TORCH_SCALE if outside else pixels).astype(np.float32)
        wanted = [*outputs, names[0]]
        # one image at a time: torch's dynamo exporter bakes the example's batch
        # (torch2onnx.py: 1) into a Reshape, whatever the input declares
        parts = [session.run(wanted, {inputs[0]: feed[i:i + 1]}) for i in range(len(feed))]
        values = [np.concatenate(outputs_of) for outputs_of in zip(*parts)]
        return dict(zip([*outputs, ""], values))

    source.run = run
    return source


def constant_value(attribute) -> np.ndarray | None:
    """A Constant node's value: a tensor, or (opset 12 on) a float, int or list of them."""
    value = onnx.helper.get_attribute_value(attribute)
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    return np.asarray(value) if isinstance(value, (float, int, list)) else None


def input_normalization(nodes, name: str, constants: dict) -> tuple[float, float, bool]:
    """(scale, shift, found) of the scalar Sub/Add/Mul/Div chain between the input and
    the first convolution, if the graph has one."""
    scale, shift, found, current = 1.0, 0.0, False, name
    for node in nodes:
        if current not in node.input:
            continue
        others = [constants.get(i) for i in node.input if i != current]
        if node.op_type not in AFFINE or len(others) != 1 or others[0] is None \
                or others[0].size == 0 or not np.all(others[0] == others[0].flat[0]):
            break  # a scalar, or the same value for every channel
        value = float(others[0].flat[0])
        if node.op_type == "Sub" and node.input[0] == current:
            shift -= value
        elif node.op_type == "Add":
            shift += value
        elif node.op_type == "Mul":
            scale, shift = scale * value, shift * value
        elif node.op_type == "Div" and node.input[0] == current:
            scale, shift = scale / value, shift / value
        else:
            break
        found, current = True, node.output[0]
    return scale, shift, found


UNSUPPORTED = {"Relu", "LeakyRelu", "Sigmoid", "Tanh", "HardSigmoid", "HardSwish",
               "MaxPool", "AveragePool", "GlobalAveragePool", "LpNormalization"}
"""Activations and poolings none of our networks has (the ViTs' ReLU6 is a Clip, their
attention a Softmax): a graph with one is another network. (Arithmetic past the
input's normalization is left to the parity check, which names the first layer whose
output it changes.)"""


def layers_of(nodes, constants: dict, path: str) -> list:
    """The weighted layers in graph order; a MatMul's bias is the Add after it."""
    layers, biases, started, chain = [], {}, False, {}
    for node in nodes:
        options = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        weights = [constants.get(i) for i in node.input[1:]]
        output = node.output[0] if node.output else ""
        op = node.op_type
        named = f"{path}: {op} {node.name or output!r}"
        if (spelled_out := layer_norm_step(node, constants, chain)) is not None:
            layers.append(spelled_out)
            continue
        if op in ("Conv", "BatchNormalization", "PRelu", "Gemm", "LayerNormalization"):
            count = {"Conv": 1, "BatchNormalization": 4, "PRelu": 1, "Gemm": 1,
                     "LayerNormalization": 2}[op]
            if len(weights) < count or any(w is None for w in weights):
                raise BackboneImportError(f"{named} takes a weight that is not a constant of "
                                          "the file (computed in the graph): cannot import it")
            started = True
        if op == "Conv":
            layers.append(conv_layer(weights, options, output, named))
        elif op == "BatchNormalization":
            gamma, beta, mean, var = weights[:4]
            layers.append(Norm(gamma, beta, mean, var, float(options.get("epsilon", 1e-5)),
                               output, node.input[0]))
        elif op == "PRelu":
            layers.append(Slope(weights[0].reshape(-1), output))
        elif op == "LayerNormalization":
            if options.get("axis", -1) != -1:
                raise BackboneImportError(f"{named} normalizes from axis {options['axis']}; "
                                          "our ViTs normalize each token's features (-1)")
            layers.append(TokenNorm(weights[0], weights[1], float(options.get("epsilon", 1e-5)),
                                    output))
        elif op == "Gemm":
            if options.get("transA", 0) or options.get("alpha", 1.0) != 1.0 \
                    or options.get("beta", 1.0) != 1.0:
                raise BackboneImportError(f"{named} scales or transposes its input "
                                          f"({options}): not a fully connected layer of ours")
            weight = weights[0] if options.get("transB", 0) else weights[0].T
            layers.append(Dense(weight, weights[1] if len(weights) > 1 else None, output))
        elif op == "MatMul" and weights and weights[0] is not None:
            layers.append(Dense(weights[0].T, None, output))
            biases[output] = len(layers) - 1
        elif op == "Add" and (into := [i for i in node.input if i in biases]):
            bias = next((constants.get(i) for i in node.input if i not in biases), None)
            if bias is not None:
                dense = layers[biases.pop(into[0])]
                dense.bias, dense.output = bias.reshape(-1), output
        elif op == "Add" and len(layers) == 1 and isinstance(layers[0], Conv) and (table := next(
                (constants[i] for i in node.input if constants.get(i) is not None
                 and constants[i].ndim == 3 and constants[i].shape[0] == 1), None)) is not None:
            layers.append(Position(table, output))  # 1 x tokens x width after the patches
        elif op in UNSUPPORTED and started:
            raise BackboneImportError(f"{named}: our networks have no such operation there; "
                                      "not an IResNet or MobileFaceNet of arcface_torch's")
    return layers


def layer_norm_step(node, constants: dict, chain: dict) -> TokenNorm | None:
    """torch's TorchScript exporter writes a LayerNorm below opset 17 as ReduceMean,
    Sub, Pow(2), ReduceMean, Add(eps), Sqrt, Div, Mul(gamma), Add(beta). Follow that
    chain through `chain` (tensor -> (stage, what it carries)); at its last node
    return the LayerNorm, else None."""
    op, inputs = node.op_type, list(node.input)
    if not node.output or not inputs:
        return None
    output = node.output[0]
    stage = {name: chain[name] for name in inputs if name in chain}
    tensor = next((name for name in inputs if name in stage), inputs[0])
    constant = next((constants[name] for name in inputs if name != tensor
                     and constants.get(name) is not None), None)
    kind, carried = stage.get(tensor, (None, None))
    if op == "ReduceMean":
        chain[output] = ("variance", carried) if kind == "squared" else ("mean", inputs[0])
    elif op == "Sub" and len(inputs) == 2 and chain.get(inputs[1], (None,))[0] == "mean" \
            and chain[inputs[1]][1] == inputs[0]:
        chain[output] = ("centered", output)
    elif op == "Pow" and kind == "centered" and constant is not None and np.all(constant == 2):
        chain[output] = ("squared", tensor)
    elif op == "Add" and kind == "variance" and constant is not None and constant.size == 1:
        chain[output] = ("variance+eps", (carried, float(constant.flat[0])))
    elif op == "Sqrt" and kind == "variance+eps":
        chain[output] = ("deviation", carried)
    elif op == "Div" and len(inputs) == 2 and chain.get(inputs[1], (None,))[0] == "deviation" \
            and chain[inputs[1]][1][0] == inputs[0]:
        chain[output] = ("normalized", chain[inputs[1]][1][1])
    elif op == "Mul" and kind == "normalized" and constant is not None:
        chain[output] = ("scaled", (carried, constant))
    elif op == "Add" and kind == "scaled" and constant is not None:
        eps, gamma = carried
        return TokenNorm(gamma.reshape(-1), constant.reshape(-1), eps, output)
    return None


def conv_layer(weights: list, options: dict, output: str, named: str) -> Conv:
    kernel = weights[0].shape[2:]
    pads = tuple(options.get("pads", [0] * 2 * len(kernel)))
    if pads[:len(kernel)] != pads[len(kernel):] or options.get("auto_pad", "NOTSET") \
            not in ("NOTSET", b"NOTSET") or any(d != 1 for d in options.get("dilations", [])):
        raise BackboneImportError(f"{named} pads unevenly, automatically or dilates "
                                  f"({options}): not a convolution of our networks")
    return Conv(weights[0], weights[1] if len(weights) > 1 else None,
                tuple(options.get("strides", [1, 1])), pads[:len(kernel)],
                int(options.get("group", 1)), output)
