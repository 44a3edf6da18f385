"""The cleaning rule of sub-center ArcFace (Deng et al., ECCV 2020), pure numpy: after
training with K sub-centers per class, a class's dominant sub-center is the one most
of its samples are nearest to; a sample farther than an angle (75 degrees in the
paper) from its class's dominant sub-center is taken for a wrong label and dropped.
With K = 1 the class center is the one sub-center: the common "drop the samples far
from their class center".

The steps are split so that the samples can be seen a chunk at a time on many
processes: `own_class_cosines` per chunk (to the sample's own class's sub-centers),
`pick_counts` summed over all chunks and ranks, `dominant` from the sums, then
`angles` per chunk again from the kept cosines.
"""

from __future__ import annotations

import numpy as np

DEFAULT_ANGLE = 75.0
"""Degrees: the sub-center ArcFace paper's threshold."""


def unit_rows(matrix: np.ndarray) -> np.ndarray:
    """Each row divided by its norm, in float32 (a zero row stays zero)."""
    matrix = np.asarray(matrix, np.float32)
    norms = np.linalg.norm(matrix, axis=-1, keepdims=True)
    return matrix / np.where(norms > 0, norms, 1)


def own_class_cosines(embeddings: np.ndarray, labels: np.ndarray,
                      subcenters: np.ndarray) -> np.ndarray:
    """The cosine of each sample to each of its own class's K sub-centers: (n x K).
    `subcenters`: the rows of the samples' classes, (n x K x D), sample i's class's at
    i (the caller reads them from wherever the centers are)."""
    return np.einsum("nd,nkd->nk", unit_rows(embeddings), unit_rows(subcenters))


def pick_counts(labels: np.ndarray, cosines: np.ndarray, num_classes: int) -> np.ndarray:
    """How many samples of each class are nearest to each of its sub-centers
    (num_classes x K, int64): summed over chunks and ranks, the dominant's evidence. A
    sample without cosines (NaN: an image that did not decode) has no vote."""
    k = cosines.shape[1]
    scored = np.isfinite(cosines).all(axis=1)
    picks = np.asarray(labels, np.int64)[scored] * k + cosines[scored].argmax(axis=1)
    return np.bincount(picks, minlength=num_classes * k).reshape(num_classes, k)


def dominant(counts: np.ndarray) -> np.ndarray:
    """Each class's dominant sub-center: the one most of its samples picked (the first
    of a tie; a class without samples keeps sub-center 0)."""
    return counts.argmax(axis=1)


def angles(labels: np.ndarray, cosines: np.ndarray, dominant_of: np.ndarray) -> np.ndarray:
    """Degrees between each sample and its class's dominant sub-center."""
    chosen = np.take_along_axis(cosines, dominant_of[np.asarray(labels)][:, None], 1)[:, 0]
    return np.degrees(np.arccos(np.clip(chosen, -1.0, 1.0)))


def histogram(degrees: np.ndarray, width: float = 5.0) -> dict[str, int]:
    """Counts of angles per `width` degrees, "0-5": n, ..., for the report."""
    edges = np.arange(0, 180 + width, width)
    counts, _ = np.histogram(degrees, edges)
    return {f"{low:g}-{high:g}": int(n) for low, high, n in zip(edges[:-1], edges[1:], counts)}
