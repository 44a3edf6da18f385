"""backbone.onnx: export with a dynamic batch, parity with MXNet, competition checks.

Face recognition competitions take submissions as backbone.onnx with a
1 x 3 x 112 x 112 float input and one embedding output; `check_onnx` reports what
their helper checks (shapes, file size, latency) and warns past a budget.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import mxnet as mx
import numpy as np
import onnx

from .. import durable
from ..data import DataError
from ..data.transforms import FACE_SIZE
from ..evaluation.verification import mxnet_forward, normalized, onnx_forward

SYMBOL, PARAMS = "backbone-symbol.json", "backbone-0000.params"


class ExportError(DataError):
    """A backbone that cannot be exported or an ONNX file that cannot be used (a data
    error too: the message names the file)."""


def backbone_files(work_dir: str | os.PathLike, model: str = "backbone") -> tuple[str, str]:
    """(symbol, params) of the backbone a work dir holds (`model`: "backbone", the
    latest, or "backbone-best"); a clear error when missing."""
    work_dir = Path(work_dir)
    symbol, params = f"{model}-symbol.json", f"{model}-0000.params"
    for name in (symbol, params):
        if not (work_dir / name).is_file():
            saved = ("training writes it at every checkpoint" if model == "backbone" else
                     "training writes it when a verification beats the best so far: it "
                     "needs val_targets")
            which = "" if model == "backbone" else "best "
            raise ExportError(f"{work_dir} has no {name}: not a work dir with a saved "
                              f"{which}backbone ({saved})")
    return str(work_dir / symbol), str(work_dir / params)


def load_backbone(work_dir: str | os.PathLike, ctx: mx.Context | None = None,
                  model: str = "backbone"):
    """A backbone a work dir holds, as a Gluon block."""
    symbol, params = backbone_files(work_dir, model)
    with warnings.catch_warnings():  # of the unused label input
        warnings.filterwarnings("ignore", message="Cannot decide type")
        return mx.gluon.SymbolBlock.imports(symbol, ["data"], params, ctx=ctx or mx.cpu())


def describe_backbone(work_dir: str | os.PathLike, model: str = "backbone") -> str:
    """Which model of a work dir is meant, with the step it was saved at (from the
    record written beside it) and, for the best one, its accuracy in training."""
    name = f"{Path(work_dir) / model}"
    try:
        record = json.loads((Path(work_dir) / f"{model}.json").read_text())
    except (OSError, ValueError):
        return f"{name} (no record of its step beside it)"
    accuracy = (f", mean verification accuracy {record['accuracy']:.5f} in training"
                if "accuracy" in record else "")
    return f"{name} (step {record.get('step', '?')}{accuracy})"


OPSET = 17
"""The opset backbone.onnx declares. MXNet's exporter takes the newest the installed
onnx knows (23 for onnx 1.18), but its LayerNorm (a ViT's) writes ReduceMean with the
`axes` attribute, which opset 18 moved to an input: 17 is the newest its converters
fit, and it does not change with the onnx version."""


@contextlib.contextmanager
def opset(version: int) -> Iterator[None]:
    """mx.onnx.export_model writing for `version`: it has no argument for it (it asks
    onnx.defs.onnx_opset_version), and it checks its graph against the checker's
    default context, which is set to the newest opset too. Process-wide while it lasts:
    exports run one at a time (the background export is a process of its own)."""
    import onnx.checker

    newest, context = onnx.defs.onnx_opset_version, onnx.checker.DEFAULT_CONTEXT
    imports = dict(context.opset_imports)
    onnx.defs.onnx_opset_version = lambda: version
    context.opset_imports = {**imports, "": version}
    try:
        yield
    finally:
        onnx.defs.onnx_opset_version = newest
        context.opset_imports = imports


def export_onnx(work_dir: str | os.PathLike) -> Path:
    """Write work_dir/backbone.onnx (batch dimension dynamic) atomically; validate it.
    It is written under this process's own name first: an `export` run by hand while
    training exports in the background must not write into the same file."""
    work_dir = Path(work_dir)
    symbol, params = backbone_files(work_dir)
    finite_embeddings(work_dir, random_faces())  # nothing written for an overflowing one
    tmp = work_dir / f".backbone.onnx.{os.getpid()}.partial"
    try:
        with opset(OPSET):
            mx.onnx.export_model(symbol, params,
                                 in_shapes=[(1, 3, FACE_SIZE, FACE_SIZE)], in_types=[np.float32],
                                 onnx_file_path=str(tmp), dynamic=True,
                                 dynamic_input_shapes=[(None, 3, FACE_SIZE, FACE_SIZE)])
        model = onnx.load(str(tmp))
        # MXNet's exporter also lists the weights as graph inputs; onnxruntime then
        # cannot fold them as constants, and checkers see many inputs instead of one
        weights = {init.name for init in model.graph.initializer}
        for graph_input in [i for i in model.graph.input if i.name in weights]:
            model.graph.input.remove(graph_input)
        used = {name for node in model.graph.node for name in node.input}
        for unused in [i for i in model.graph.initializer if i.name not in used]:
            model.graph.initializer.remove(unused)  # LayerNorm's converter leaves some
        slopes_per_channel(model)
        onnx.checker.check_model(model)
        onnx.save(model, str(tmp))
        final = work_dir / "backbone.onnx"
        durable.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)  # replaced: nothing left
    return final


def slopes_per_channel(model: onnx.ModelProto) -> None:
    """MXNet's exporter gives a PRelu its per-channel slope as a (C,) tensor, which ONNX
    broadcasts against the last axis (the width), not the channels: reshaped to
    (C, 1, 1), as insightface's own ONNX backbones have it."""
    initializers = {init.name: init for init in model.graph.initializer}
    for node in model.graph.node:
        slope = initializers.get(node.input[1]) if node.op_type == "PRelu" else None
        if slope is not None and len(slope.dims) == 1 and slope.dims[0] > 1:
            slope.dims.extend([1, 1])


def onnx_session(path: str | os.PathLike):
    import onnxruntime

    if not Path(path).is_file():
        raise ExportError(f"ONNX file {Path(path).absolute()} does not exist")
    try:
        return onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as error:
        raise ExportError(f"{path} is not a loadable ONNX model: {error}") from error


def parity(work_dir: str | os.PathLike, batch: int = 4, seed: int = 0) -> float:
    """How far onnxruntime's embeddings of the same random inputs are from MXNet's
    (float32): the larger of the raw difference relative to MXNet's largest value and
    the difference of the L2-normalized embeddings, which verification compares. An
    absolute difference would scale with the weights (an untrained r50's embeddings
    reach 1e6)."""
    x = random_faces(batch, seed)
    expected = finite_embeddings(work_dir, x)
    got = onnx_forward(onnx_session(Path(work_dir) / "backbone.onnx"))(x)
    relative = np.abs(got - expected).max() / np.abs(expected).max()
    return float(max(relative, np.abs(normalized(got) - normalized(expected)).max()))


def random_faces(batch: int = 4, seed: int = 0) -> np.ndarray:
    """Network inputs (normalized pixels) of random values."""
    return np.random.default_rng(seed).standard_normal((batch, 3, FACE_SIZE, FACE_SIZE),
                                                       dtype=np.float32)


def finite_embeddings(work_dir: str | os.PathLike, x: np.ndarray) -> np.ndarray:
    """The MXNet backbone's embeddings of `x`; an ExportError when any is not finite: such
    a model would be exported and scored silently (in eval mode, a network a few steps
    old overflows float32 while its BatchNorm statistics are still near their start)."""
    embeddings = mxnet_forward(load_backbone(work_dir), mx.cpu())(x)
    if not np.isfinite(embeddings).all():
        raise ExportError(f"{work_dir}: the backbone's own embeddings of random inputs are "
                          "not finite (inf or NaN), so backbone.onnx was not written (the "
                          "previous one, if any, is kept): a network a few steps old whose "
                          "BatchNorm statistics lag its weights overflows in eval mode; "
                          "export a later checkpoint")
    return embeddings


@dataclass
class OnnxReport:
    input_shape: list
    output_shape: list
    size_mb: float
    latency_ms: float
    warnings: list = field(default_factory=list)


def check_onnx(path: str | os.PathLike, runs: int = 20, max_mb: float = 0.0,
               max_ms: float = 0.0) -> OnnxReport:
    """Input 1x3x112x112 float32 -> one embedding; size; median latency of `runs`."""
    session = onnx_session(path)
    inputs = session.get_inputs()
    if len(inputs) != 1:
        raise ExportError(f"{path} has {len(inputs)} inputs; a face backbone takes one image "
                        "tensor")
    shape = inputs[0].shape
    expected = [3, FACE_SIZE, FACE_SIZE]
    if len(shape) != 4 or list(shape[1:]) != expected or inputs[0].type != "tensor(float)":
        raise ExportError(f"{path} takes {inputs[0].type} of shape {shape}; expected float "
                        f"N x 3 x {FACE_SIZE} x {FACE_SIZE}")
    x = np.random.default_rng(0).standard_normal((1, 3, FACE_SIZE, FACE_SIZE), dtype=np.float32)
    forward = onnx_forward(session)
    output = forward(x)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        forward(x)
        times.append(time.perf_counter() - start)
    report = OnnxReport(list(shape), list(output.shape), Path(path).stat().st_size / 2**20,
                        1e3 * statistics.median(times))
    if output.ndim != 2 or output.shape[0] != 1:
        report.warnings.append(f"output shape {list(output.shape)} is not 1 x embedding_size")
    if max_mb and report.size_mb > max_mb:
        report.warnings.append(f"size {report.size_mb:.1f} MB exceeds the budget {max_mb} MB")
    if max_ms and report.latency_ms > max_ms:
        report.warnings.append(f"latency {report.latency_ms:.2f} ms exceeds the budget "
                               f"{max_ms} ms")
    return report


def model_forward(model: str, gpu: int | None = None, name: str = "backbone"):
    """images -> embeddings of a work dir's backbone `name` (MXNet, on the CPU or GPU
    `gpu`; "backbone-best" for its best one) or of an ONNX file (onnxruntime, CPU)."""
    if model.endswith(".onnx"):
        if gpu is not None:
            raise DataError("--gpu runs a work dir's MXNet backbone; an ONNX file runs on "
                            "the CPU: give the work dir instead")
        if name != "backbone":
            raise DataError("--best picks a work dir's best backbone; give the work dir")
        return onnx_forward(onnx_session(model))
    ctx = mx.cpu() if gpu is None else mx.gpu(gpu)
    return mxnet_forward(load_backbone(model, ctx, name), ctx)
