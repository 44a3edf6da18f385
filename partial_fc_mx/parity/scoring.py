"""The one evaluator both toolkits' embeddings are scored by: 10-fold accuracy on the
task's verification pairs (the LFW protocol of evaluation/verification.py), and TAR
at FAR = 1e-3 and 1e-4 over all pairs of held-out samples: with 1,000 held-out
identities of 5 samples, 12.5 million pairs of which 10,000 genuine, so FAR = 1e-4
rests on about 1,250 impostor pairs above the threshold."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..evaluation.verification import normalized, tar_at_far, ten_fold_accuracy

FARS = (1e-3, 1e-4)


@dataclass(frozen=True)
class Score:
    accuracy: float
    """10-fold, on the task's pairs."""
    fold_std: float
    tar: dict
    """{FAR: TAR} over all pairs of held-out samples."""


def all_pairs(embeddings: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cosine similarity and the same-identity flag of every unordered pair."""
    unit = normalized(embeddings.astype(np.float64)).astype(np.float32)
    first, second = upper_triangle(len(unit))
    similarity = (unit @ unit.T)[first, second]  # 5,000 samples: a 100 MB matrix
    return similarity, same_identity(labels.astype(np.int64).tobytes())


@functools.lru_cache(maxsize=2)
def upper_triangle(count: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column of every pair i < j (a study scores the same held-out set many
    times: made once)."""
    return np.triu_indices(count, k=1)


@functools.lru_cache(maxsize=2)
def same_identity(labels: bytes) -> np.ndarray:
    ids = np.frombuffer(labels, np.int64)
    first, second = upper_triangle(len(ids))
    return ids[first] == ids[second]


def score(embeddings: np.ndarray, labels: np.ndarray, pairs: np.ndarray,
          issame: np.ndarray) -> Score:
    if not np.isfinite(embeddings).all():
        return Score(float("nan"), float("nan"), {far: float("nan") for far in FARS})
    unit = normalized(embeddings.astype(np.float64))
    pair_similarity = (unit[pairs[:, 0]] * unit[pairs[:, 1]]).sum(axis=1)
    folds = ten_fold_accuracy(pair_similarity, issame.astype(bool))
    similarity, same = all_pairs(embeddings, labels)
    return Score(folds.accuracy, folds.std,
                 {far: tar_at_far(similarity, same, far) for far in FARS})
