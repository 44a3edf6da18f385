"""Label noise of web-crawled face data, made on purpose for the noisy-label study
(docs/noisy_labels.md), seeded, with the truth kept beside it.

Two kinds, as the datasets Partial FC is for have them:
- flips: wrong labels, an image filed under another person. Each class gives a
  `fraction` of its samples (its count times the fraction, the remainder rounded up
  or down at random so that the mean is exact) to classes drawn uniformly among the
  others.
- splits: one person under two class ids. A `fraction` of the identities each have
  their samples divided at random into two halves (the odd one to either), the second
  half under a new class id after all the others.

numpy only: the torch environment of arcface_torch's arm imports the task, and with
it this module.
"""

from __future__ import annotations

import numpy as np

KINDS = ("flips", "splits")


def parse(noise: str) -> tuple[str, float]:
    """"flips0.4" -> ("flips", 0.4): the kind and its fraction, or SystemExit."""
    kind = next((k for k in KINDS if noise.startswith(k)), None)
    try:
        fraction = float(noise[len(kind):]) if kind else -1.0
    except ValueError:
        fraction = -1.0
    if kind is None or not 0 < fraction < 1:
        raise SystemExit(f"noise {noise!r}: one of {', '.join(KINDS)} followed by a "
                         "fraction in (0, 1), e.g. flips0.4 or splits0.3")
    return kind, fraction


def flip_labels(labels: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """`labels` with `fraction` of each class's samples moved to another class."""
    noisy = labels.copy()
    classes, members = by_class(labels)
    counts = np.array([len(m) for m in members])
    wanted = counts * fraction
    moved = np.floor(wanted).astype(np.int64) + (rng.random(classes) < wanted % 1)
    for c in np.flatnonzero(moved):  # a random `moved[c]` of class c's samples
        chosen = rng.choice(members[c], moved[c], replace=False)
        others = rng.integers(0, classes - 1, len(chosen))
        noisy[chosen] = others + (others >= c)  # uniform among the other classes
    return noisy


def split_identities(labels: np.ndarray, fraction: float,
                     rng: np.random.Generator) -> np.ndarray:
    """`labels` with `fraction` of the identities each split into two class ids: class
    c's second half under C + (its rank among the split ones)."""
    noisy = labels.copy()
    classes, members = by_class(labels)
    split = np.sort(rng.choice(classes, int(round(fraction * classes)), replace=False))
    for new, c in enumerate(split):
        mine = members[c]
        half = rng.permutation(mine)[:len(mine) // 2 + rng.integers(0, 2) * (len(mine) % 2)]
        noisy[half] = classes + new
    return noisy


def by_class(labels: np.ndarray) -> tuple[int, list[np.ndarray]]:
    """The class count and each class's sample indices, in sample order."""
    classes = int(labels.max()) + 1
    order = np.argsort(labels, kind="stable")
    return classes, np.split(order, np.cumsum(np.bincount(labels, minlength=classes))[:-1])


def add_noise(labels: np.ndarray, noise: str, seed: int) -> np.ndarray:
    """The training labels of a task with `noise` ("" for none), from its own generator:
    the same clean data under any noise."""
    if not noise:
        return labels
    kind, fraction = parse(noise)
    rng = np.random.default_rng([seed, 2038, 3])
    return (flip_labels if kind == "flips" else split_identities)(labels, fraction, rng)
