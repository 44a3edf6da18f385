"""A batch of decoded faces -> the backbone's input: one vectorized pass, numpy only
(the parity study's torch environment uses it too, without OpenCV or MXNet)."""

from __future__ import annotations

import numpy as np

PIXEL_MEAN, PIXEL_SCALE = 127.5, 1 / 128
"""(pixel - 127.5) / 128, as insightface's MXNet models did inside their graph
(arcface_torch's divide by 127.5)."""


def to_network_input(images: np.ndarray) -> np.ndarray:
    """B x H x W x 3 uint8 -> B x 3 x H x W float32, (x - PIXEL_MEAN) * PIXEL_SCALE;
    C-contiguous (a transposed view would reach torch as channels-last memory)."""
    batch = images.transpose(0, 3, 1, 2).astype(np.float32, order="C")
    batch -= PIXEL_MEAN
    batch *= PIXEL_SCALE
    return batch
