"""Pairs of faces for a verification set: drawn from the pictures of identities kept
out of training (heldout.py, orl.py, synthetic.py), or read from a pairs file of the
user's (`python -m partial_fc_mx make-bin`), then written in insightface's .bin layout
(data/verification_set.py)."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..data import DataError
from ..data.verification_set import FOLDS, write_verification_bin
from .pack import (
    FIXES,
    PackReport,
    encoded_face,
    is_number,
    matched_landmarks,
    plain_path,
    read_landmarks,
    unaligned_rule,
)


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


@dataclass(frozen=True)
class Pair:
    first: str
    second: str
    same: bool
    where: str
    """The pairs file and line, for errors."""


def read_pairs(path: Path) -> list[Pair]:
    """A pairs file, one pair per line, in LFW's layout (`name n1 n2`: two pictures of
    one person, `name1 n1 name2 n2`: of two people, the picture `name/name_000n.jpg`;
    a first line of one or two numbers, LFW's fold counts, is skipped) or plainly
    `path1 path2 1|0` (1: the same person)."""
    if not path.is_file():
        raise DataError(f"pairs file {path.absolute()} does not exist")
    pairs = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fields, where = line.split(), f"{path} line {number}"
        if not fields or (number == 1 and len(fields) <= 2 and all(map(is_number, fields))):
            continue
        if len(fields) == 3 and fields[2] in ("0", "1") and not is_number(fields[1]):
            pairs.append(Pair(fields[0], fields[1], fields[2] == "1", where))
        elif len(fields) == 3 and fields[1].isdigit() and fields[2].isdigit():
            pairs.append(Pair(lfw_picture(fields[0], fields[1]), lfw_picture(fields[0], fields[2]),
                              True, where))
        elif len(fields) == 4 and fields[1].isdigit() and fields[3].isdigit():
            pairs.append(Pair(lfw_picture(fields[0], fields[1]), lfw_picture(fields[2], fields[3]),
                              False, where))
        else:
            raise DataError(f"{where} is not a pair: expected 'name n1 n2', 'name1 n1 name2 n2' "
                            f"(LFW) or 'path1 path2 1|0', got {line!r}")
    if not pairs:
        raise DataError(f"pairs file {path} lists no pairs")
    return pairs


def lfw_picture(name: str, number: str) -> str:
    return f"{name}/{name}_{int(number):04d}.jpg"


def make_bin(pairs_file: str | os.PathLike, root: str | os.PathLike, out: str | os.PathLike,
             landmarks: str | os.PathLike | None = None, crop: bool = False,
             resize: bool = False) -> int:
    """An insightface .bin of the pairs a pairs file lists (pictures under `root`),
    each picture aligned from its landmarks when given, else prepared as `pack` would;
    returns the number of pairs. A picture that cannot be used is an error naming the
    line: dropping a pair would change the protocol."""
    root = Path(root)
    pairs = read_pairs(Path(pairs_file))
    if len(pairs) < FOLDS:
        raise DataError(f"{pairs_file} lists {len(pairs)} pairs; a .bin needs at least "
                        f"{FOLDS} for the {FOLDS}-fold protocol")
    points = read_landmarks(Path(landmarks)) if landmarks else {}
    matched_landmarks(points, [name for pair in pairs for name in (pair.first, pair.second)],
                      landmarks, root)
    unaligned = unaligned_rule(crop, resize)
    encoded: dict[str, bytes] = {}
    for pair in pairs:
        for relative in (pair.first, pair.second):
            if relative in encoded:
                continue
            report = PackReport()
            image = encoded_face(root / relative, report, points.get(plain_path(relative)),
                                 unaligned, f"{pair.where}: {root / relative}")
            if image is None:  # its one skip says why
                (_, why), reason = report.skipped[0], next(iter(report.reasons))
                raise DataError(f"{pair.where}: {root / relative}: {why}; "
                                f"fix: {FIXES[reason]}")
            encoded[relative] = image
    images = [encoded[name] for pair in pairs for name in (pair.first, pair.second)]
    write_verification_bin(out, images, [pair.same for pair in pairs])
    return len(pairs)
