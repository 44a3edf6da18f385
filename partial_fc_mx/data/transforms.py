"""Encoded face image -> 112 x 112 RGB (a batch of them -> the backbone's input:
network_input.py).

Decoding happens per image in worker threads (OpenCV releases the GIL).
"""

from __future__ import annotations

import cv2
import numpy as np

FACE_SIZE = 112


def decode_in_workers() -> None:
    """OpenCV single-threaded: the parallelism is the loader's decoding threads, and
    OpenCV's own pool per call would oversubscribe the cores. Set when a loader starts
    (process-wide), not on import."""
    cv2.setNumThreads(1)


def decode_face(encoded: bytes, mirror: bool = False) -> tuple[np.ndarray | None, bool]:
    """(112 x 112 x 3 RGB uint8, whether it had to be resized); (None, False) if corrupt.

    Grayscale images become three equal channels.
    """
    image = cv2.imdecode(np.frombuffer(encoded, np.uint8), cv2.IMREAD_COLOR)
    if image is None:
        return None, False
    resized = image.shape[:2] != (FACE_SIZE, FACE_SIZE)
    if resized:
        image = cv2.resize(image, (FACE_SIZE, FACE_SIZE), interpolation=cv2.INTER_AREA)
    if mirror:
        image = cv2.flip(image, 1)
    return cv2.cvtColor(image, cv2.COLOR_BGR2RGB), resized


def encode_jpeg(rgb: np.ndarray, quality: int = 95) -> bytes:
    ok, buffer = cv2.imencode(".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR),
                              [cv2.IMWRITE_JPEG_QUALITY, quality])
    assert ok
    return buffer.tobytes()


def center_square(image: np.ndarray, size: int = FACE_SIZE) -> np.ndarray:
    """Crop the central square and resize it: for unaligned pictures of any shape."""
    height, width = image.shape[:2]
    side = min(height, width)
    top, left = (height - side) // 2, (width - side) // 2
    square = image[top:top + side, left:left + side]
    return cv2.resize(square, (size, size), interpolation=cv2.INTER_AREA)
