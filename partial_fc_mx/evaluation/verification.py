"""Verification accuracy on insightface .bin pair sets, by the LFW protocol.

Embeddings are the sum of the image's and its mirror image's embedding (test-time
flip), L2-normalized; a pair is "same" when the cosine similarity exceeds a
threshold chosen on nine folds and scored on the tenth, ten times.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

import mxnet as mx
import numpy as np

from ..data.recordio import DataError
from ..data.transforms import decode_face, to_network_input


@dataclass
class VerificationSet:
    name: str
    images: np.ndarray
    """2K x 3 x 112 x 112 float32, network input; pair k is images 2k and 2k + 1."""
    issame: np.ndarray


@dataclass(frozen=True)
class VerificationResult:
    accuracy: float
    std: float
    threshold: float


def load_bin(path: str | Path) -> VerificationSet:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            images, issame = pickle.load(f, encoding="bytes")
    except FileNotFoundError:
        raise DataError(f"verification set {path} does not exist") from None
    except Exception as error:
        raise DataError(f"{path} is not an insightface .bin (a pickle of (images, issame)): "
                        f"{error}") from error
    if len(images) != 2 * len(issame):
        raise DataError(f"{path} holds {len(images)} images for {len(issame)} pairs; "
                        "a .bin needs exactly two images per pair")
    decoded = []
    for i, data in enumerate(images):
        face, _ = decode_face(bytes(data))
        if face is None:
            raise DataError(f"{path}: image {i} cannot be decoded")
        decoded.append(face)
    return VerificationSet(path.stem, to_network_input(np.stack(decoded)), np.asarray(issame))


def embed(net, images: np.ndarray, ctx: mx.Context, batch_size: int = 64) -> np.ndarray:
    """L2-normalized sum of the embeddings of each image and its mirror image."""
    out = []
    for start in range(0, len(images), batch_size):
        batch = mx.nd.array(images[start:start + batch_size], ctx=ctx)
        both = net(batch) + net(batch.flip(axis=3))
        out.append(both.astype("float32").asnumpy())
    embeddings = np.concatenate(out)
    return embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)


def pair_similarities(embeddings: np.ndarray) -> np.ndarray:
    return (embeddings[0::2] * embeddings[1::2]).sum(axis=1)


def ten_fold_accuracy(similarity: np.ndarray, issame: np.ndarray,
                      folds: int = 10) -> VerificationResult:
    """Threshold chosen on the other folds, accuracy measured on the held-out one."""
    order = np.arange(len(issame))
    accuracies, thresholds = [], []
    for test in np.array_split(order, folds):
        train = np.setdiff1d(order, test)
        threshold = best_threshold(similarity[train], issame[train])
        accuracies.append(np.mean((similarity[test] > threshold) == issame[test]))
        thresholds.append(threshold)
    return VerificationResult(float(np.mean(accuracies)), float(np.std(accuracies)),
                              float(np.mean(thresholds)))


def best_threshold(similarity: np.ndarray, issame: np.ndarray) -> float:
    """The cut between sorted similarities that classifies the most pairs right."""
    candidates = np.unique(similarity)
    cuts = np.concatenate([[candidates[0] - 1e-6], (candidates[:-1] + candidates[1:]) / 2])
    correct = [np.sum((similarity > cut) == issame) for cut in cuts]
    return float(cuts[int(np.argmax(correct))])


def verify(net, dataset: VerificationSet, ctx: mx.Context) -> VerificationResult:
    embeddings = embed(net, dataset.images, ctx)
    return ten_fold_accuracy(pair_similarities(embeddings), dataset.issame)
