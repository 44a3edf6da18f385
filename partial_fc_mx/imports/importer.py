"""`python -m partial_fc_mx import-backbone SRC WORK_DIR --network r50`: a face model
people already have (arcface_torch's ONNX export, insightface's ONNX models or its
MXNet-era model-symbol.json/params) as a work dir to fine-tune from (--load-from),
evaluate (eval) and export (export).

The import refuses unless our network, given the source's weights, computes what the
source computes: the embeddings of random inputs, from onnxruntime or MXNet, agree to
a cosine of MIN_COSINE. If they do not, it names the first layer where the two
differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mxnet as mx
import numpy as np

from ..backbones import get_model
from ..data.network_input import PIXEL_MEAN, PIXEL_SCALE
from ..data.transforms import FACE_SIZE
from ..evaluation.verification import cosines
from ..run import checkpoint
from .calibration import IMAGES, calibrate, faces, training_agreement
from .layers import BackboneImportError, Dense, Source
from .mapping import Mapping, assign, forward_hooks
from .mxnet_source import read_mxnet
from .onnx_source import read_onnx

MIN_COSINE = 0.9999
PARITY_IMAGES = 8


@dataclass
class ImportReport:
    source: Source
    network: str
    embedding_size: int
    worst_cosine: float
    folded: list
    calibrated_on: str | None
    training_cosine: float | None
    checkpoint: Path


def read_source(path: str | Path) -> Source:
    """An .onnx file, or an MXNet model: PREFIX-symbol.json, PREFIX-EPOCH.params or
    insightface's PREFIX,EPOCH."""
    if str(path).endswith(".onnx"):
        if not Path(path).is_file():
            raise BackboneImportError(f"{path} does not exist")
        return read_onnx(path)
    return read_mxnet(path)


def import_backbone(source_path: str | Path, work_dir: str | Path, network: str,
                    calibration: str | Path | None = None, seed: int = 0) -> ImportReport:
    checkpoint.refuse_used_work_dir(work_dir)  # before the minutes an r200 takes
    source = read_source(source_path)
    embedding_size = embedding_size_of(source)
    net = get_model(network, embedding_size)
    net.initialize(ctx=mx.cpu())
    net.infer_shape(mx.nd.zeros((1, 3, FACE_SIZE, FACE_SIZE)))  # no forward: a forward
    # leaves oneDNN's layouts in the weights, which set_data cannot overwrite
    mapping = assign(net, source)
    where, agreement = None, None
    if mapping.folded:  # measured on faces others than those calibrated on
        images, which = faces(calibration, seed=seed)
        half = min(IMAGES, len(images) // 2) or 1
        where = f"{half} faces of {which}"
        calibrate(net, mapping.folded, images[:half])
        agreement = training_agreement(net, images[half:] if len(images) > half else images)
    worst = parity(net, source, mapping, seed)  # of the network as it is written
    saved = checkpoint.save_imported(Path(work_dir), net, {
        "network": network, "embedding_size": embedding_size,
        "imported_from": str(Path(source.path).absolute())})
    return ImportReport(source, network, embedding_size, worst, mapping.folded, where,
                        agreement, saved)


def embedding_size_of(source: Source) -> int:
    dense = [layer for layer in source.layers if isinstance(layer, Dense)]
    if not dense:
        raise BackboneImportError(f"{source.path} has no fully connected layer: not a face "
                                  "recognition backbone of insightface's kinds")
    return int(dense[-1].weight.shape[0])


def parity(net, source: Source, mapping: Mapping, seed: int) -> float:
    """The worst cosine between our embeddings and the source's of random pixels; below
    MIN_COSINE, the error names the first layer that differs."""
    pixels = np.random.default_rng(seed).uniform(0, 255, (PARITY_IMAGES, 3, FACE_SIZE,
                                                          FACE_SIZE)).astype(np.float32)
    ours = net(normalized_pixels(pixels)).asnumpy()
    theirs = source.run(pixels, [])[""]
    if not np.isfinite(theirs).all():
        raise BackboneImportError(not_finite(source, mapping, pixels))
    with np.errstate(all="ignore"):  # ours not finite: first_difference names the layer
        worst = float(cosines(ours, theirs).min())
    if not worst >= MIN_COSINE:
        raise BackboneImportError(first_difference(net, source, mapping, pixels, worst))
    return worst


def not_finite(source: Source, mapping: Mapping, pixels: np.ndarray) -> str:
    """The source's own outputs overflow float32 (inf, NaN): say where, not that the
    networks differ; nothing can be compared."""
    outputs = source.run(pixels, [tensor for _, tensor in mapping.checkpoints])
    first = next(((name, tensor) for name, tensor in mapping.checkpoints
                  if not np.isfinite(outputs[tensor]).all()), None)
    where = (f" from its {first[1]!r} (our {first[0]}) on" if first else
             " after its last weighted layer")
    return (f"{source.path}: the source's own outputs are not finite (inf or NaN){where}, "
            "for face-sized inputs: its weights or BatchNorm statistics overflow float32 "
            "(an untrained model with random statistics does), so its embeddings cannot be "
            "compared with ours and nothing was imported. Import a trained model")


def normalized_pixels(pixels: np.ndarray) -> mx.nd.NDArray:
    """N x 3 x H x W float pixels as our networks take them (data/network_input.py)."""
    return mx.nd.array((pixels - PIXEL_MEAN) * PIXEL_SCALE)


def first_difference(net, source: Source, mapping: Mapping, pixels: np.ndarray,
                     worst: float) -> str:
    """Which layer's output first differs between ours and the source's."""
    outputs: dict[str, np.ndarray] = {}
    with forward_hooks(net, [name for name, _ in mapping.checkpoints],
                       lambda name, inputs, output: outputs.__setitem__(name, output.asnumpy())):
        net(normalized_pixels(pixels))
    theirs = source.run(pixels, [tensor for _, tensor in mapping.checkpoints])
    for name, tensor in mapping.checkpoints:
        with np.errstate(all="ignore"):
            agreement = float(cosines(outputs[name], theirs[tensor]).min())
        if not agreement >= MIN_COSINE:
            return (f"{source.path} imported as {type(net).__name__} computes other "
                    f"embeddings (worst cosine {worst:.6f} < {MIN_COSINE}); the first layer "
                    f"that differs is our {name} against its {tensor!r} (cosine "
                    f"{agreement:.6f}): either --network is not the model's architecture, or the "
                    "source computes something there that ours does not")
    return (f"{source.path}: our embeddings differ from the source's (worst cosine "
            f"{worst:.6f} < {MIN_COSINE}) although every mapped layer agrees: the source "
            "computes something after its last weighted layer that ours does not")
