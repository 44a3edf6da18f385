"""Verification sets in insightface's .bin layout: pairs of faces, same person or not.

The file is a pickle of (encoded images, issame): images 2k and 2k+1 form pair k.
lfw.bin, cfp_fp.bin and agedb_30.bin have this layout; so do the held-out sets
made here from identities the model never trained on.
"""

from __future__ import annotations

import itertools
import os
import pickle
from pathlib import Path

import numpy as np


def sample_pairs(groups: list[list[bytes]], pairs: int,
                 rng: np.random.Generator) -> tuple[list[bytes], list[bool]]:
    """Up to `pairs` distinct genuine pairs and as many distinct impostor pairs, shuffled.

    `groups` holds the images of each identity.
    """
    genuine = [(g, a, g, b) for g, images in enumerate(groups)
               for a, b in itertools.combinations(range(len(images)), 2)]
    chosen = [genuine[i] for i in rng.permutation(len(genuine))[:pairs]]
    impostors: set = set()
    possible = sum(len(a) * len(b) for a, b in itertools.combinations(groups, 2))
    while len(impostors) < min(len(chosen), possible):
        g1, g2 = sorted(rng.choice(len(groups), 2, replace=False).tolist())
        impostors.add((g1, int(rng.integers(len(groups[g1]))),
                       g2, int(rng.integers(len(groups[g2])))))
    both = [(pair, True) for pair in chosen] + [(pair, False) for pair in sorted(impostors)]
    images, issame = [], []
    for k in rng.permutation(len(both)):
        (g1, a, g2, b), same = both[k]
        images += [groups[g1][a], groups[g2][b]]
        issame.append(same)
    return images, issame


def write_verification_bin(path: str | os.PathLike, images: list[bytes],
                           issame: list[bool]) -> None:
    if len(images) != 2 * len(issame):
        raise ValueError(f"{len(images)} images for {len(issame)} pairs")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial")
    with open(tmp, "wb") as f:
        pickle.dump((images, [bool(s) for s in issame]), f, protocol=4)
    os.replace(tmp, path)
