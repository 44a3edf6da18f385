"""Training augmentation: each change does what it says, stays in range, is fixed by
(seed, epoch, position) whatever the number of processes, and never reaches the
verification sets."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
from conftest import config_file, logged, run, train_args
from test_data import pack_random, smooth_face

from partial_fc_mx.config import ConfigError, load_config
from partial_fc_mx.data.augment import Augmentation
from partial_fc_mx.data.loader import FaceLoader
from partial_fc_mx.data.recordio import RecordDataset

EVERYTHING = Augmentation(crop_scale=0.6, rotate=15, color=0.3, blur=0.5)


@pytest.fixture
def face() -> np.ndarray:
    return smooth_face(np.random.default_rng(3))


def test_the_same_seed_gives_the_same_image_and_others_differ(face):
    first = EVERYTHING(face, np.random.default_rng([0, 1, 2, 7]))
    assert np.array_equal(first, EVERYTHING(face, np.random.default_rng([0, 1, 2, 7])))
    others = [EVERYTHING(face, np.random.default_rng([0, 1, 2, k])) for k in range(8, 16)]
    assert all(not np.array_equal(first, other) for other in others)
    assert all(o.shape == (112, 112, 3) and o.dtype == np.uint8 for o in [first, *others])


def test_the_warp_is_a_crop_zoom_and_rotation_about_its_centre(face):
    crop = Augmentation(crop_scale=0.25, rotate=30)
    unchanged = crop._warp(face, np.array([1.0, 0.5, 0.5, 0.5]))  # full area, no angle
    assert np.abs(unchanged.astype(int) - face).max() <= 1
    zoomed = crop._warp(face, np.array([0.0, 0.5, 0.5, 0.5]))  # a quarter of the area, centred
    expected = cv2.resize(face[28:84, 28:84], (112, 112), interpolation=cv2.INTER_LINEAR)
    # within half a pixel (the two functions place pixel centres differently); a crop
    # two pixels off differs by 16 on average, the opposite corner by 75
    assert np.abs(zoomed.astype(int) - expected).mean() < 4
    corner = crop._warp(face, np.array([0.0, 0.0, 0.0, 0.5]))  # the top-left quarter
    expected = cv2.resize(face[:56, :56], (112, 112), interpolation=cv2.INTER_LINEAR)
    assert np.abs(corner.astype(int) - expected).mean() < 4
    turned = Augmentation(rotate=90)._warp(face, np.array([1.0, 0.5, 0.5, 1.0]))  # +90 degrees
    assert np.abs(turned.astype(int) - np.rot90(face)).mean() < 8  # the other way: 70


def test_colour_changes_stay_within_their_bounds(face):
    colour = Augmentation(color=0.2)
    shifts = [colour(face, np.random.default_rng(k)).mean() - face.mean() for k in range(200)]
    assert max(np.abs(shifts)) <= 0.2 * 255 + 1
    assert min(shifts) < -10 and max(shifts) > 10  # both ways, not a constant offset
    spread = [colour(face, np.random.default_rng(k)).std() / face.std() for k in range(200)]
    assert 0.75 < min(spread) < 0.9 and 1.1 < max(spread) < 1.25  # contrast within +-20%


def test_blur_happens_with_its_probability_and_softens(face):
    sharp = cv2.Laplacian(face, cv2.CV_64F).var()
    blurred = [Augmentation(blur=0.3)(face, np.random.default_rng(k)) for k in range(400)]
    changed = [b for b in blurred if not np.array_equal(b, face)]
    assert 0.22 < len(changed) / len(blurred) < 0.38  # 0.3 expected; 4 standard deviations
    assert all(cv2.Laplacian(b, cv2.CV_64F).var() < 0.97 * sharp for b in changed)


def test_inactive_augmentation_leaves_the_loader_as_it_was(tmp_path):
    dataset = RecordDataset(pack_random(tmp_path / "rec", 4, 10))
    plain = FaceLoader(dataset, 8, seed=2)
    off = FaceLoader(dataset, 8, seed=2, augment=Augmentation())
    assert off.augment is None
    for a, b in zip(plain.epoch(0), off.epoch(0)):
        assert np.array_equal(a.images, b.images)


def test_an_image_is_augmented_by_its_position_whatever_the_world_size(tmp_path):
    """Rank r of W takes every W-th position of a global batch: the same positions get
    the same augmented images on 1 process and on 2; the next epoch gets others."""
    dataset = RecordDataset(pack_random(tmp_path / "rec", 4, 12))  # 48 images
    one = FaceLoader(dataset, 8, seed=4, augment=EVERYTHING)
    two = [FaceLoader(dataset, 4, rank=r, world_size=2, seed=4, augment=EVERYTHING)
           for r in range(2)]
    alone = np.concatenate([b.images for b in one.epoch(0)])
    ranks = [np.concatenate([b.images for b in loader.epoch(0)]) for loader in two]
    together = np.empty_like(alone)  # positions 0, 2, 4 ... came from rank 0
    together[0::2], together[1::2] = ranks[0], ranks[1]
    assert np.array_equal(alone, together)
    plain = np.concatenate([b.images for b in FaceLoader(dataset, 8, seed=4).epoch(0)])
    assert not np.array_equal(alone, plain)
    assert not np.array_equal(alone, np.concatenate([b.images for b in one.epoch(1)]))


def test_bad_values_are_refused_by_name(tmp_path):
    path = tmp_path / "cfg.py"
    path.write_text("rec = 'x'\nnum_classes = 10\n")
    for override, named in (("augment_crop_scale=0", "augment_crop_scale=0"),
                            ("augment_rotate=-5", "augment_rotate=-5"),
                            ("augment_color=1.5", "augment_color=1.5"),
                            ("augment_blur=2", "augment_blur=2")):
        with pytest.raises(ConfigError, match=named):
            load_config(str(path), [override])


def test_training_is_augmented_and_verification_is_not(tmp_path, synthetic):
    """Two runs from the same initial weights: the same accuracy at step 0 (the
    verification pairs are not augmented), another loss at the first step."""
    config = config_file(tmp_path, synthetic, max_steps=1, verbose=1,
                         val_targets=["synthetic_heldout"])
    losses, untrained = [], []
    for name, extra in (("plain", ()), ("augmented", ("augment_rotate=20",
                                                      "augment_crop_scale=0.7"))):
        result = run(train_args(config, tmp_path / name, *extra), timeout=300)
        assert result.returncode == 0, result.stdout[-3000:]
        log = logged(tmp_path / name)
        losses.append(log["losses"][1])
        untrained.append(dict(log["accuracy"])[0])
    assert untrained[0] == untrained[1]
    assert losses[0] != losses[1]
