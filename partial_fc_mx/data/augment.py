"""Training-time augmentation: each image shown a little differently at every step.

A few identities with a few images each (ORL: 30 people x 10) are memorized rather
than learned unless the network sees every face under small changes of framing,
pose, light and focus, the changes that separate two photos of one person. One
affine warp does the crop, scale and rotation; then contrast, brightness and blur.
Each image's parameters come from (seed, epoch, position in the epoch's order), as
the mirror flags do, so a resumed run, or one on another number of processes, sees
the same images. Only the training loader applies it; verification never does.
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np

from .transforms import FACE_SIZE


@dataclass(frozen=True)
class Augmentation:
    crop_scale: float = 1.0
    """Smallest area of the random square crop, as a share of the image (1: no crop).
    The crop is resized back to 112 x 112: a zoom in and a shift."""
    rotate: float = 0.0
    """Largest rotation, in degrees either way."""
    color: float = 0.0
    """Largest relative change of contrast, and of brightness (as a share of 255)."""
    blur: float = 0.0
    """Probability of a Gaussian blur with sigma between 0.5 and 1.5 pixels."""

    def problems(self) -> list[str]:
        """Why these values cannot work, for the config's checks."""
        problems = []
        if not 0.1 <= self.crop_scale <= 1.0:
            problems.append(f"augment_crop_scale={self.crop_scale} must be in [0.1, 1]")
        if not 0.0 <= self.rotate <= 180.0:
            problems.append(f"augment_rotate={self.rotate} must be in [0, 180] degrees")
        if not 0.0 <= self.color < 1.0:
            problems.append(f"augment_color={self.color} must be in [0, 1)")
        if not 0.0 <= self.blur <= 1.0:
            problems.append(f"augment_blur={self.blur} is a probability, in [0, 1]")
        return problems

    @property
    def active(self) -> bool:
        return self.crop_scale < 1.0 or self.rotate > 0 or self.color > 0 or self.blur > 0

    def __call__(self, image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """112 x 112 x 3 uint8 -> the same shape and type, changed as drawn from `rng`."""
        draws = rng.random(7)  # a fixed number of draws: one change never shifts another's
        if self.crop_scale < 1.0 or self.rotate > 0:
            image = self._warp(image, draws[:4])
        if self.color > 0:
            contrast = 1.0 + self.color * (2 * draws[4] - 1)
            brightness = 255.0 * self.color * (2 * draws[5] - 1)
            shift = cv2.mean(image)[0] * (1 - contrast) + brightness  # contrast about the mean
            image = cv2.addWeighted(image, contrast, image, 0.0, shift)  # rounds and clips
        if draws[6] < self.blur:
            sigma = 0.5 + draws[6] / self.blur  # the same draw, rescaled: uniform in [0.5, 1.5)
            image = cv2.GaussianBlur(image, (0, 0), sigma)
        return image

    def _warp(self, image: np.ndarray, draws: np.ndarray) -> np.ndarray:
        """Crop a random square of area in [crop_scale, 1], rotated by up to `rotate`
        degrees about its centre, and resize it to the full image."""
        side = FACE_SIZE * np.sqrt(self.crop_scale + (1 - self.crop_scale) * draws[0])
        slack = (FACE_SIZE - side) / 2
        centre_x = FACE_SIZE / 2 + slack * (2 * draws[1] - 1)
        centre_y = FACE_SIZE / 2 + slack * (2 * draws[2] - 1)
        angle = self.rotate * (2 * draws[3] - 1)
        matrix = cv2.getRotationMatrix2D((centre_x, centre_y), angle, FACE_SIZE / side)
        matrix[:, 2] += (FACE_SIZE / 2 - centre_x, FACE_SIZE / 2 - centre_y)
        return cv2.warpAffine(image, matrix, (FACE_SIZE, FACE_SIZE), flags=cv2.INTER_LINEAR,
                              borderMode=cv2.BORDER_REFLECT_101)
