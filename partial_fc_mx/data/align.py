"""Face alignment from five landmarks to the 112 x 112 ArcFace crop.

The five points (left eye, right eye, nose tip, left and right mouth corners, as a
detector such as RetinaFace or MTCNN gives them) are mapped onto ArcFace's reference
template by the similarity transform (rotation, uniform scale, translation) that
fits them best in the least-squares sense (Umeyama's closed form), and the picture
is warped with it. Every model trained on MS1MV3/Glint360K saw faces cropped this
way, so a face packed or evaluated here must be cropped the same way.
"""

from __future__ import annotations

import cv2
import numpy as np

from . import DataError
from .transforms import FACE_SIZE

ARCFACE_TEMPLATE = np.array([[38.2946, 51.6963], [73.5318, 51.5014], [56.0252, 71.7366],
                             [41.5493, 92.3655], [70.7299, 92.2041]])
"""Where the five points lie in the 112 x 112 crop (x, y in pixels)."""

MIN_SPREAD = 0.05
"""The smaller spread of the centered points over the larger: below it they lie on a
line (or a point) and cannot fix a face's orientation."""


def similarity_transform(source: np.ndarray, target: np.ndarray) -> np.ndarray:
    """The 2 x 3 matrix of the similarity transform that maps `source` (N x 2) closest
    to `target` (N x 2) in the least-squares sense, without reflection."""
    source, target = np.asarray(source, np.float64), np.asarray(target, np.float64)
    source_mean, target_mean = source.mean(axis=0), target.mean(axis=0)
    a, b = source - source_mean, target - target_mean
    u, singular, vt = np.linalg.svd(b.T @ a / len(source))
    sign = np.diag([1.0, np.sign(np.linalg.det(u) * np.linalg.det(vt)) or 1.0])
    rotation = u @ sign @ vt
    scale = np.trace(np.diag(singular) @ sign) / a.var(axis=0).sum()
    matrix = np.empty((2, 3))
    matrix[:, :2] = scale * rotation
    matrix[:, 2] = target_mean - scale * rotation @ source_mean
    return matrix


def check_landmarks(points, image_shape: tuple | None, where: str) -> np.ndarray:
    """The five points as a 5 x 2 float array, or a DataError naming `where` when they
    are not five finite points inside the picture (of `image_shape`; None: anywhere)
    or lie on a line."""
    try:
        points = np.asarray(points, np.float64).reshape(5, 2)
    except ValueError:
        raise DataError(f"{where}: expected 5 landmarks (10 numbers x1 y1 ... x5 y5), got "
                        f"{np.size(points)} numbers") from None
    if not np.isfinite(points).all():
        raise DataError(f"{where}: the landmarks are not all finite numbers: {points.tolist()}")
    height, width = image_shape[:2] if image_shape else (np.inf, np.inf)
    outside = ~((points[:, 0] >= 0) & (points[:, 0] < width)
                & (points[:, 1] >= 0) & (points[:, 1] < height))
    if image_shape and outside.any():
        raise DataError(f"{where}: landmark(s) {np.flatnonzero(outside).tolist()} at "
                        f"{points[outside].round(1).tolist()} lie outside the {width}x{height} "
                        "picture; are they for this picture, in pixels, in x y order?")
    if lie_on_a_line(points):
        raise DataError(f"{where}: the 5 landmarks {points.round(1).tolist()} lie on a line "
                        "(or one point); they cannot place a face. Fix or drop this entry")
    return points


def lie_on_a_line(points: np.ndarray) -> np.ndarray:
    """Whether each set of finite points (... x 5 x 2) lies on a line or a point."""
    spread = np.linalg.svd(points - points.mean(axis=-2, keepdims=True), compute_uv=False)
    return (spread[..., 0] == 0) | (spread[..., 1] < MIN_SPREAD * spread[..., 0])


def unusable_landmarks(landmarks: np.ndarray) -> np.ndarray:
    """The rows of N x 5 x 2 landmarks that check_landmarks refuses whatever the
    picture: not finite, or on a line (all at once: IJB-C has 469,375)."""
    finite = np.isfinite(landmarks).all(axis=(1, 2))
    safe = np.where(finite[:, None, None], landmarks, 0.0)  # refused below either way
    return np.flatnonzero(~finite | lie_on_a_line(safe))


def align_face(image: np.ndarray, landmarks, where: str) -> np.ndarray:
    """The FACE_SIZE x FACE_SIZE crop of `image` (H x W x C) whose five landmarks land
    on ARCFACE_TEMPLATE, after check_landmarks; `where` names the picture in errors."""
    return warp_to_template(image, check_landmarks(landmarks, image.shape, where))


def warp_to_template(image: np.ndarray, points: np.ndarray) -> np.ndarray:
    """align_face for 5 x 2 points already checked; points outside the picture are
    warped too (what lies outside is filled with black)."""
    matrix = similarity_transform(points, ARCFACE_TEMPLATE)
    return cv2.warpAffine(image, matrix, (FACE_SIZE, FACE_SIZE), flags=cv2.INTER_LINEAR,
                          borderValue=0.0)
