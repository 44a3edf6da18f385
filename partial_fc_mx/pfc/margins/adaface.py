"""AdaFace (Kim, Jain and Liu, CVPR 2022): a margin that adapts to image quality,
with the embedding's norm as the proxy for quality.

    z = clip(h * (|x| - mean) / (std + eps), -1, 1)      how good, relative to the batch
    target logit = s * (cos(theta - m * z) - (m + m * z))

A poor image (z = -1) gets ArcFace's angular margin m and no additive one, so the
loss does not chase it; a good one (z = 1) gets CosFace-like 2m and an angle
*reduced* by m, which emphasises its hard examples. mean and std are exponential
moving averages (t_alpha) of the batch's norm statistics. As in the authors' code,
the norms (clipped to [0.001, 100]) and the statistics are constants for the
gradient, cos is held within eps of +-1 and theta - m z within [eps, pi - eps]
(the slope is zero where a clip holds), and std is the unbiased one.

Under Partial FC every rank sees the whole global batch's embeddings, so the
statistics are those of the global batch, identical on every rank; the moving
averages are checkpointed (meta.json) so a resume continues them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import mxnet as mx
import numpy as np

EPS = 1e-3
NORM_RANGE = (0.001, 100.0)


@dataclass
class BatchStatistics:
    """The moving averages of the norms' mean and std; the authors start at 20, 100."""

    mean: float = 20.0
    std: float = 100.0


class AdaFace:
    name = "adaface"

    def __init__(self, scale: float = 64.0, m: float = 0.4, h: float = 0.333,
                 t_alpha: float = 0.01) -> None:
        if not (scale > 0 and 0 <= m < math.pi / 2 and h > 0 and 0 < t_alpha <= 1):
            raise ValueError(f"adaface scale={scale}, m={m}, h={h}, t_alpha={t_alpha}: need "
                             "scale > 0, 0 <= m < pi/2, h > 0, 0 < t_alpha <= 1 (the paper: "
                             "m=0.4, h=0.333, t_alpha=0.01)")
        self.scale, self.m, self.h, self.t_alpha = scale, m, h, t_alpha
        self.statistics = BatchStatistics()

    def observe(self, norms: mx.nd.NDArray) -> None:
        """Fold the global batch's norm statistics into the moving averages; in float64
        on the host, so every rank computes the same numbers from the same norms."""
        safe = np.clip(norms.asnumpy().astype(np.float64), *NORM_RANGE)
        stats, alpha = self.statistics, self.t_alpha
        stats.mean = alpha * float(safe.mean()) + (1 - alpha) * stats.mean
        stats.std = alpha * float(safe.std(ddof=1) if len(safe) > 1 else 0.0) \
            + (1 - alpha) * stats.std

    def quality(self, norms: mx.nd.NDArray) -> mx.nd.NDArray:
        """z in [-1, 1]: how far each norm is above the batch's, in units of std / h."""
        safe = mx.nd.clip(norms, *NORM_RANGE)
        z = (safe - self.statistics.mean) * (self.h / (self.statistics.std + EPS))
        return mx.nd.clip(z, -1, 1)

    def __call__(self, cos: mx.nd.NDArray, norms: mx.nd.NDArray) -> tuple:
        """(target logits, d logit / d cos); zero slope where a clip holds. Only the
        targets are clipped here: the other logits stay s * cos, unclipped."""
        z = self.quality(norms.astype(cos.dtype))
        held = mx.nd.clip(cos, -1 + EPS, 1 - EPS)
        theta = mx.nd.arccos(held)
        shifted = theta - self.m * z
        theta_m = mx.nd.clip(shifted, EPS, math.pi - EPS)
        value = mx.nd.cos(theta_m) - self.m * (1 + z)
        inside = (cos > -1 + EPS) * (cos < 1 - EPS) * (shifted > EPS) * (shifted < math.pi - EPS)
        slope = mx.nd.sin(theta_m) / mx.nd.sin(theta) * inside
        return self.scale * value, self.scale * slope

    def state_dict(self) -> dict:
        return asdict(self.statistics)

    def load_state_dict(self, state: dict) -> None:
        self.statistics = BatchStatistics(float(state["mean"]), float(state["std"]))


def build(scale: float, margin_list: tuple, **options) -> AdaFace:
    """`options`: m, h, t_alpha (margin_list is the combined margin's, unused here)."""
    return AdaFace(scale, **options)
