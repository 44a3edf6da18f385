"""The eigenfaces (PCA) baseline: what a model must beat to have learned anything.

PCA is fitted on the training images (grayscale pixels) and the held-out pairs are
compared by cosine similarity of their projections, under the same ten-fold
protocol as the model.
"""

from __future__ import annotations

import numpy as np

from .verification import VerificationResult, VerificationSet, pair_similarities, ten_fold_accuracy


def gray_pixels(images: np.ndarray) -> np.ndarray:
    return images.mean(axis=1).reshape(len(images), -1)


def eigenfaces_accuracy(train_images: np.ndarray, pairs: VerificationSet,
                        components: int = 50) -> VerificationResult:
    """train_images: N x 3 x H x W network input of the training identities."""
    train = gray_pixels(train_images)
    mean = train.mean(axis=0)
    _, _, basis = np.linalg.svd(train - mean, full_matrices=False)
    projected = (gray_pixels(pairs.images) - mean) @ basis[:components].T
    projected /= np.linalg.norm(projected, axis=1, keepdims=True)
    return ten_fold_accuracy(pair_similarities(projected), pairs.issame)
