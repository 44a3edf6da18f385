"""Verification accuracy on insightface .bin pair sets, by the LFW protocol.

Embeddings are the sum of the image's and its mirror image's embedding (test-time
flip), L2-normalized; a pair is "same" when the cosine similarity exceeds a
threshold chosen on nine folds and scored on the tenth, ten times. TAR at a given
FAR is reported where there are enough impostor pairs to measure that FAR (at
least 1 / FAR of them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import mxnet as mx
import numpy as np

from ..data import DataError
from ..data.network_input import to_network_input
from ..data.transforms import decode_face
from ..data.verification_set import FOLDS, read_verification_bin
from ..errors import UserError


class NonFiniteEmbeddings(UserError, ValueError):
    """A model whose embeddings of a set are not finite; the message names the set."""


@dataclass
class VerificationSet:
    name: str
    faces: np.ndarray
    """The distinct images (by encoded bytes), network input (N x 3 x 112 x 112 float32),
    each decoded and embedded once: pair sets reuse faces (ORL's held-out set: about
    1,800 images of 100 faces)."""
    issame: np.ndarray
    distinct: np.ndarray
    """For each of `faces`, its index among the 2K images of the file."""
    where: np.ndarray
    """For each of the 2K images, its row in `faces`."""

    @property
    def images(self) -> np.ndarray:
        """All 2K images, network input; pair k is images 2k and 2k + 1."""
        return self.faces[self.where]


@dataclass(frozen=True)
class VerificationResult:
    accuracy: float
    std: float
    threshold: float
    tar_at_far: dict = field(default_factory=dict)
    """{FAR: TAR} for the FARs the number of impostor pairs can resolve."""


def load_bin(path: str | Path) -> VerificationSet:
    path = Path(path)
    images, issame = read_verification_bin(path)
    if len(images) != 2 * len(issame):
        raise DataError(f"{path} holds {len(images)} images for {len(issame)} pairs; "
                        "a .bin needs exactly two images per pair")
    if len(issame) < FOLDS:
        raise DataError(f"{path} holds {len(issame)} pairs; the {FOLDS}-fold protocol needs "
                        f"at least {FOLDS} (a threshold is chosen on nine folds, scored on "
                        "the tenth)")
    first_copy: dict[bytes, int] = {}
    copy_of = np.array([first_copy.setdefault(bytes(data), i) for i, data in enumerate(images)])
    distinct, where = np.unique(copy_of, return_inverse=True)
    decoded = []
    for i in distinct:
        face, _ = decode_face(bytes(images[i]))
        if face is None:
            raise DataError(f"{path}: image {i} cannot be decoded")
        decoded.append(face)
    return VerificationSet(path.stem, to_network_input(np.stack(decoded)), np.asarray(issame),
                           distinct, where)


def mxnet_forward(net, ctx: mx.Context):
    return lambda batch: net(mx.nd.array(batch, ctx=ctx)).astype("float32").asnumpy()


def onnx_forward(session):
    name = session.get_inputs()[0].name
    return lambda batch: session.run(None, {name: batch})[0]


def flip_sum(forward, batch: np.ndarray) -> np.ndarray:
    """The sum of the embeddings of each image and of its mirror image; `forward` maps
    an N x 3 x 112 x 112 float32 batch to N x D embeddings."""
    return forward(batch) + forward(np.ascontiguousarray(batch[..., ::-1]))


def embed(forward, images: np.ndarray, batch_size: int = 64) -> np.ndarray:
    """L2-normalized flip_sum of each image."""
    return normalized(np.concatenate([flip_sum(forward, images[start:start + batch_size])
                                      for start in range(0, len(images), batch_size)]))


def normalized(embeddings: np.ndarray) -> np.ndarray:
    """Each row divided by its L2 norm."""
    return embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The cosine between each row of `a` and the same row of `b` (flattened)."""
    return (normalized(a.reshape(len(a), -1)) * normalized(b.reshape(len(b), -1))).sum(axis=1)


def pair_similarities(embeddings: np.ndarray) -> np.ndarray:
    return (embeddings[0::2] * embeddings[1::2]).sum(axis=1)


def ten_fold_accuracy(similarity: np.ndarray, issame: np.ndarray,
                      folds: int = FOLDS) -> VerificationResult:
    """Threshold chosen on the other folds, accuracy measured on the held-out one."""
    order = np.arange(len(issame))
    accuracies, thresholds = [], []
    for test in np.array_split(order, folds):
        train = np.setdiff1d(order, test)
        threshold = best_threshold(similarity[train], issame[train])
        accuracies.append(np.mean((similarity[test] > threshold) == issame[test]))
        thresholds.append(threshold)
    tars = {far: tar for far in (1e-3, 1e-4)
            if (tar := tar_at_far(similarity, issame, far)) is not None}
    return VerificationResult(float(np.mean(accuracies)), float(np.std(accuracies)),
                              float(np.mean(thresholds)), tars)


def tar_at_far(similarity: np.ndarray, issame: np.ndarray, far: float) -> float | None:
    """Share of genuine pairs above the threshold that lets `far` of impostors pass."""
    impostors = similarity[~issame]
    allowed = int(far * len(impostors))
    if allowed < 1 or not issame.any():
        return None
    # the (allowed + 1)-th largest: at most `allowed` impostors lie strictly above it
    # (a partition, not a sort: all pairs of 5,000 samples are 12.5 million)
    rank = len(impostors) - 1 - allowed
    threshold = np.partition(impostors, rank)[rank]
    return float(np.mean(similarity[issame] > threshold))


def best_threshold(similarity: np.ndarray, issame: np.ndarray) -> float:
    """The cut between sorted similarities that classifies the most pairs right."""
    order = np.argsort(similarity)
    ranked, same = similarity[order], issame[order].astype(np.int64)
    # cutting below the k-th smallest: the k below are called "different", the rest "same"
    correct = (np.concatenate([[0], np.cumsum(1 - same)])
               + np.concatenate([np.cumsum(same[::-1])[::-1], [0]]))
    cuts = np.concatenate([[ranked[0] - 1e-6], (ranked[:-1] + ranked[1:]) / 2,
                           [ranked[-1] + 1e-6]])
    return float(cuts[int(np.argmax(correct))])


def verify(forward, dataset: VerificationSet) -> VerificationResult:
    """The ten-fold accuracy (and TAR at FAR) of the model `forward` on a pair set; a
    NonFiniteEmbeddings error instead of a score of meaningless similarities."""
    with np.errstate(invalid="ignore", over="ignore"):
        embeddings = embed(forward, dataset.faces)
    if not (finite := np.isfinite(embeddings).all(axis=1)).all():
        raise NonFiniteEmbeddings(
            f"{dataset.name}: the embeddings of {int((~finite).sum())} of its "
            f"{len(embeddings)} images are not finite (inf or NaN), so the model is not "
            "scored: in eval mode a network a few steps old overflows float32 while its "
            "BatchNorm statistics are still near their start (train further), or the "
            "model is damaged")
    return ten_fold_accuracy(pair_similarities(embeddings[dataset.where]),
                             dataset.issame.astype(bool))
