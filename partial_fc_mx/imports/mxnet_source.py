"""An insightface MXNet-era model (`model-symbol.json` and `model-0000.params`, as
its recognition/ArcFace code saved them) as layers.py's `Source`. Those graphs
normalize their input inside (`(data - 127.5) * 0.0078125`), use BatchNorm epsilon
2e-5 (MXNet's default where unset: 1e-3, and a scale fixed at 1 unless
fix_gamma=False) and a bias on the fully connected layer before the embedding's
BatchNorm.

The symbol is JSON and the parameters MXNet's NDArray format: nothing in either file
executes. The graph runs in MXNet for the parity check.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import mxnet as mx
import numpy as np

from .layers import BackboneImportError, Conv, Dense, Norm, Slope, Source, affine_input

SCALARS = {"_minus_scalar": (1, -1), "_plus_scalar": (1, 1), "_mul_scalar": (0, 1),
           "_div_scalar": (0, -1)}
"""How each scalar operation moves (scale, shift): (whether it moves the shift alone
(else it multiplies both), the direction: the sign, or the power of the factor)."""
NO_OPS = {"identity", "_copy"}


def model_files(path: str | Path) -> tuple[Path, Path]:
    """(symbol, params) from `prefix-symbol.json`, `prefix-0000.params`, or insightface's
    `prefix,epoch`."""
    text, epoch = str(path), None
    if named := re.fullmatch(r"(.*),(\d+)", text) or re.fullmatch(r"(.*)-(\d{4})\.params", text):
        text, epoch = named.group(1), int(named.group(2))
    prefix = re.sub(r"-symbol\.json$", "", text)
    symbol = Path(f"{prefix}-symbol.json")
    if epoch is None:  # the one epoch there is, or 0
        saved = sorted(Path(prefix).parent.glob(f"{Path(prefix).name}-[0-9][0-9][0-9][0-9].params"))
        if len(saved) > 1:
            raise BackboneImportError(
                f"{prefix} has parameters of several epochs ({', '.join(p.name for p in saved)}):"
                f" name one, e.g. {prefix},{int(saved[-1].name[-11:-7])}")
        epoch = int(saved[0].name[-11:-7]) if saved else 0
    params = Path(f"{prefix}-{epoch:04d}.params")
    for needed in (symbol, params):
        if not needed.is_file():
            raise BackboneImportError(f"{needed} does not exist: an MXNet model is a pair "
                                      "PREFIX-symbol.json and PREFIX-EPOCH.params")
    return symbol, params


EMBEDDING = "fc1"
"""The node insightface's MXNet models name their embedding: a checkpoint saved during
training continues past it (the fc7 classifier, the loss), which is cut away."""


def read_mxnet(path: str | Path) -> Source:
    symbol_path, params_path = model_files(path)
    where = str(symbol_path)
    try:
        nodes = json.loads(symbol_path.read_text())["nodes"]
        saved = mx.nd.load(str(params_path))
        symbol = mx.sym.load(where)
    except (OSError, ValueError, KeyError, TypeError, mx.base.MXNetError) as error:
        raise BackboneImportError(f"{symbol_path} / {params_path} is not a readable MXNet "
                                  f"model: {error}") from error
    params = {name.split(":", 1)[-1]: value.asnumpy() for name, value in saved.items()}
    cut = next((i for i, node in enumerate(nodes) if node["name"] == EMBEDDING), None)
    if cut is not None:
        nodes, symbol = nodes[:cut + 1], symbol.get_internals()[f"{EMBEDDING}_output"]
    scale, shift, found = input_normalization(nodes)
    if not found:
        raise BackboneImportError(
            f"{where} does not normalize its input inside the graph as insightface's "
            "MXNet models do ((data - 127.5) * 0.0078125)")
    source = Source(where, "mxnet", input_scale=affine_input(scale, shift, where))
    try:
        source.layers = layers_of(nodes, params, where)
    except (ValueError, SyntaxError, KeyError) as error:  # an attribute MXNet never wrote
        raise BackboneImportError(f"{where}: a damaged attribute ({error!r})") from error

    def run(pixels: np.ndarray, outputs: list[str]) -> dict:
        internals = symbol.get_internals()
        group = mx.sym.Group([*(internals[name] for name in outputs), symbol])
        needed = [*group.list_arguments(), *group.list_auxiliary_states()]
        missing = [name for name in needed if name != "data" and name not in params]
        if missing:
            raise BackboneImportError(f"{params_path} lacks {', '.join(missing[:3])}, which "
                                      f"{where} uses")
        arrays = {name: mx.nd.array(params[name]) for name in needed if name != "data"}
        auxiliary = set(group.list_auxiliary_states())
        executor = group.bind(mx.cpu(), {**{k: v for k, v in arrays.items()
                                            if k not in auxiliary},
                                         "data": mx.nd.array(pixels)},
                              aux_states={k: v for k, v in arrays.items() if k in auxiliary},
                              grad_req="null")
        values = [value.asnumpy() for value in executor.forward(is_train=False)]
        return dict(zip([*outputs, ""], values))

    source.run = run
    return source


def attributes(node: dict) -> dict:
    """A node's attributes as MXNet wrote them (key "attrs"; "param" or "attr" in files
    of older versions)."""
    return node.get("attrs") or node.get("param") or node.get("attr") or {}


def flag(value: str | None, default: bool) -> bool:
    return default if value is None else value.strip().lower() in ("true", "1")


def numbers(value: str | None, default: tuple) -> tuple:
    """"(1, 1)" -> (1, 1), read as a literal (never evaluated as code)."""
    if value is None:
        return default
    parsed = ast.literal_eval(value)
    return tuple(parsed) if isinstance(parsed, (tuple, list)) else (parsed,) * len(default)


def input_normalization(nodes: list) -> tuple[float, float, bool]:
    """(scale, shift, found) of the scalar operations applied to `data` before anything
    else, following the chain of nodes that consume it."""
    scale, shift, found = 1.0, 0.0, False
    current = next((i for i, n in enumerate(nodes) if n["op"] == "null" and n["name"] == "data"),
                   None)
    for index, node in enumerate(nodes):
        if current is None or not node["inputs"] or node["inputs"][0][0] != current:
            continue
        op = node["op"]
        if op in NO_OPS:
            current = index
            continue
        if op not in SCALARS:
            break
        value = float(attributes(node)["scalar"])
        shift_only, sign = SCALARS[op]
        if shift_only:
            shift += sign * value
        else:
            factor = value if sign > 0 else 1 / value
            scale, shift = scale * factor, shift * factor
        found, current = True, index
    return scale, shift, found


def layers_of(nodes: list, params: dict, path: str) -> list:
    def weight(node: dict, position: int) -> np.ndarray:
        name = nodes[node["inputs"][position][0]]["name"]
        if name not in params:
            raise BackboneImportError(f"{path}: {node['name']} needs {name}, which the "
                                      "params file does not hold")
        return params[name]

    layers = []
    for node in nodes:
        op, options, output = node["op"], attributes(node), f"{node['name']}_output"
        if op == "Convolution":
            kernel = numbers(options.get("kernel"), (1, 1))
            layers.append(Conv(weight(node, 1), None if flag(options.get("no_bias"), False)
                               else weight(node, 2),
                               numbers(options.get("stride"), (1,) * len(kernel)),
                               numbers(options.get("pad"), (0,) * len(kernel)),
                               int(options.get("num_group", 1)), output))
        elif op == "BatchNorm":
            gamma = weight(node, 1)
            if flag(options.get("fix_gamma"), True):
                gamma = np.ones_like(gamma)
            source = nodes[node["inputs"][0][0]]["name"]
            layers.append(Norm(gamma, weight(node, 2), weight(node, 3), weight(node, 4),
                               float(options.get("eps", 1e-3)), output, f"{source}_output"))
        elif op == "LeakyReLU" and options.get("act_type") == "prelu":
            layers.append(Slope(weight(node, 1).reshape(-1), output))
        elif op == "FullyConnected":
            layers.append(Dense(weight(node, 1), None if flag(options.get("no_bias"), False)
                                else weight(node, 2), output))
        elif op in ("Activation", "LeakyReLU"):
            raise BackboneImportError(
                f"{path}: {node['name']} is a {op} ({options.get('act_type')}); our "
                "networks use a PReLU there: not an IResNet or MobileFaceNet of ours")
    return layers
