"""People held out of training: their pictures become a verification set of people
the model never saw, the honest measure of a face model. `pack --heldout` does it for
any folder of one subfolder per person; `pack-orl` and `pack-synthetic` for theirs.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..data import DataError
from ..data.verification_set import FOLDS, write_verification_bin
from .pack import (
    PackReport,
    check_identity_folders,
    folder_pictures,
    pack_folder,
    person_folders,
    picture_samples,
    read_landmarks,
    unaligned_rule,
)
from .pairs import sample_pairs

HELDOUT_BIN = "heldout.bin"
"""The verification set `pack --heldout` writes beside train.rec: `val_targets = ["heldout"]`."""
HELDOUT_PEOPLE = "heldout_people.txt"
"""The held-out people's names, one per line, beside heldout.bin."""


@dataclass
class HeldoutReport:
    train: PackReport
    """The training people's dataset (and every picture skipped, held-out ones too)."""
    people: list
    pairs: int


def choose_people(people: Sequence, count: int, named: Sequence[str] | None, seed: int,
                  drawable: Sequence | None = None) -> list:
    """The people to hold out, sorted: those `named`, else `count` drawn by `seed` from
    `drawable` (default: everyone). Two at least (an impostor pair needs two people),
    and someone left to train on."""
    if named:
        unknown = [name for name in named if name not in people]
        if unknown:
            near = difflib.get_close_matches(unknown[0], list(map(str, people)), n=1)
            raise DataError(f"held-out person {unknown[0]!r} is not a person folder"
                            + (f" (did you mean {near[0]!r}?)" if near else "")
                            + f"; the folders are {', '.join(map(str, people[:8]))}"
                            + (", ..." if len(people) > 8 else ""))
        chosen = sorted(set(named))
    else:
        pool = list(people if drawable is None else drawable)
        if not 2 <= count <= len(pool):
            raise DataError(f"cannot hold out {count} of {len(pool)} people who could be "
                            "drawn (two pictures or more): a verification set needs two "
                            "people at least")
        order = np.random.default_rng(seed).permutation(len(pool))
        chosen = sorted(pool[i] for i in order[:count])
    if len(chosen) < 2 or len(chosen) >= len(people):
        raise DataError(f"cannot hold out {len(chosen)} of {len(people)} people: a "
                        "verification set needs two people at least, and training one more")
    return chosen


def pairable(groups: list[list[bytes]], pairs: int,
             path: str | os.PathLike) -> list[list[bytes]]:
    """The people of `groups` (each person's encoded pictures) who have pictures, if
    they give the .bin at `path` the FOLDS pairs the verification protocol needs at
    least (up to `pairs` genuine ones and as many impostor ones)."""
    groups = [pictures for pictures in groups if pictures]
    sizes = [len(pictures) for pictures in groups]
    genuine = min(pairs, sum(n * (n - 1) // 2 for n in sizes))
    impostor = min(genuine, (sum(sizes) ** 2 - sum(n * n for n in sizes)) // 2)
    if genuine + impostor < FOLDS:
        raise DataError(f"{Path(path).absolute()}: the held-out people's usable pictures "
                        f"({sorted(sizes)} per person with any) give {genuine + impostor} "
                        f"pairs, and verification needs {FOLDS} at least; hold out more "
                        "people, or ones with more pictures, or raise --pairs")
    return groups


def write_pairs_bin(path: str | os.PathLike, groups: list[list[bytes]], pairs: int,
                    seed: int) -> int:
    """Up to `pairs` genuine and as many impostor pairs of the people's pictures
    (`groups`: each person's encoded pictures) into the .bin at `path`; the count."""
    images, issame = sample_pairs(pairable(groups, pairs, path), pairs,
                                  np.random.default_rng(seed + 1))
    write_verification_bin(path, images, issame)
    return len(issame)


def pack_folder_holding_out(src: str | os.PathLike, out_dir: str | os.PathLike, count: int,
                            named: Sequence[str] | None = None, pairs: int = 3000,
                            seed: int = 0, crop: bool = False, resize: bool = False,
                            landmarks: str | os.PathLike | None = None) -> HeldoutReport:
    """`pack_folder` of every person but the held-out ones, whose genuine and impostor
    pairs go into OUT/heldout.bin and whose names into OUT/heldout_people.txt. Their
    pictures are prepared the same way (aligned, cropped or resized) and checked before
    anything is written."""
    root = Path(src)
    check_identity_folders(root)
    people = person_folders(root)
    listed = folder_pictures(root, people)
    pictures = np.bincount([label for label, _ in listed], minlength=len(people))
    held = choose_people(people, count, named, seed,
                         drawable=[p for p, n in zip(people, pictures) if n >= 2])
    report = PackReport()
    points = read_landmarks(Path(landmarks)) if landmarks else {}
    groups: list[list[bytes]] = [[] for _ in held]
    for label, image in picture_samples(folder_pictures(root, held), root, report, points,
                                        unaligned_rule(crop, resize)):
        groups[label].append(image)
    bin_path = Path(out_dir) / HELDOUT_BIN
    pairable(groups, pairs, bin_path)  # before the training data is written
    train = pack_folder(root, out_dir, crop, resize, landmarks,
                        people=[p for p in people if p not in held], report=report)
    written = write_pairs_bin(bin_path, groups, pairs, seed)
    (Path(out_dir) / HELDOUT_PEOPLE).write_text("".join(f"{person}\n" for person in held))
    return HeldoutReport(train, held, written)
