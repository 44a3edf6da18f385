"""Synthetic identities: as many classes as wanted, learnable and verifiable.

No packaged dataset offline has 100+ real identities, so many-class work uses
made-up ones: each identity is a random prototype picture (a smooth colour field
with a few ellipses), and its images are random variations of it (rotation, scale,
shift, brightness, noise). A model that learns what stays constant under those
variations can then tell apart identities it never saw, which the held-out
verification pairs measure. Every identity is generated from (seed, class id)
alone, so any subset is reproducible.

Unrelated random pictures are easy to tell apart: a small network verifies them
perfectly. Real faces resemble each other; `shared` makes that so here, each
prototype being that fraction one picture common to all identities (of the seed),
which leaves less of the image to tell people apart by, and a verification score
that can still show differences between recipes. Relatives and look-alikes resemble
each other more than strangers do: `kin` makes families of identities that share
that fraction of their own part of the picture.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from ..data.transforms import FACE_SIZE, encode_jpeg
from ..data.verification_set import write_verification_bin
from .pack import PackReport, write_records
from .pairs import sample_pairs


@dataclass
class SyntheticReport:
    train: PackReport
    heldout_classes: int
    pairs: int


def prototype(rng: np.random.Generator) -> np.ndarray:
    """A 112 x 112 RGB picture that defines one identity."""
    coarse = rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)
    image = cv2.resize(coarse, (FACE_SIZE, FACE_SIZE), interpolation=cv2.INTER_CUBIC)
    for _ in range(rng.integers(3, 7)):
        center = tuple(int(v) for v in rng.integers(16, FACE_SIZE - 16, 2))
        axes = tuple(int(v) for v in rng.integers(6, 28, 2))
        color = tuple(int(v) for v in rng.integers(0, 256, 3))
        cv2.ellipse(image, center, axes, float(rng.uniform(0, 180)), 0, 360, color, -1)
    return image


def variation(face: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One image of the identity: small pose, scale, light and sensor changes."""
    center = (FACE_SIZE / 2 + rng.uniform(-5, 5), FACE_SIZE / 2 + rng.uniform(-5, 5))
    matrix = cv2.getRotationMatrix2D(center, rng.uniform(-12, 12), rng.uniform(0.9, 1.1))
    matrix[:, 2] += rng.uniform(-6, 6, 2)
    moved = cv2.warpAffine(face, matrix, (FACE_SIZE, FACE_SIZE), borderMode=cv2.BORDER_REFLECT)
    lit = moved.astype(np.float32) * rng.uniform(0.75, 1.25) + rng.uniform(-20, 20)
    noisy = lit + rng.normal(0, 8, lit.shape)
    return np.clip(noisy, 0, 255).astype(np.uint8)


@functools.lru_cache(maxsize=4)
def shared_face(seed: int, *key: int) -> np.ndarray:
    """A picture several identities of `seed` share a part of (made once): key (1,) the
    one common to all, (2, f) family f's."""
    return prototype(np.random.default_rng(np.random.SeedSequence(seed, spawn_key=key)))


def identity_images(seed: int, class_id: int, count: int, shared: float = 0.0,
                    kin: float = 0.0, family_size: int = 10) -> list[bytes]:
    """`count` JPEG images of identity `class_id`. Its picture: its own prototype, `kin`
    of it its family's picture (identities `family_size` by family_size from 0 are
    families), then `shared` of that the picture common to all; blended in float64 and
    rounded once, so that kin = 0 gives the pictures it always gave."""
    rng = np.random.default_rng([seed, class_id])
    face = prototype(rng).astype(np.float64)
    if kin:
        face = kin * shared_face(seed, 2, class_id // family_size) + (1 - kin) * face
    if shared:
        face = shared * shared_face(seed, 1) + (1 - shared) * face
    face = np.rint(face).astype(np.uint8)
    return [encode_jpeg(variation(face, rng), quality=90) for _ in range(count)]


def prepare_synthetic(out_dir: str, num_classes: int, per_class: int = 4, heldout: int = 100,
                      pairs: int = 300, seed: int = 0, shared: float = 0.0) -> SyntheticReport:
    """Pack num_classes training identities; write synthetic_heldout.bin from others."""
    if not 0 <= shared < 1:
        raise ValueError(f"shared={shared} must be in [0, 1): the fraction of every "
                         "identity's prototype that is common to all")
    samples = ((label, image) for label in range(num_classes)
               for image in identity_images(seed, label, per_class, shared))
    report = write_records(out_dir, samples, num_classes)
    held = [identity_images(seed, num_classes + k, max(per_class, 2), shared)
            for k in range(heldout)]
    images, issame = sample_pairs(held, pairs, np.random.default_rng([seed, num_classes, heldout]))
    write_verification_bin(Path(out_dir) / "synthetic_heldout.bin", images, issame)
    return SyntheticReport(report, heldout, len(issame))
