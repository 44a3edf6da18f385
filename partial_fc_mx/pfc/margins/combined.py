"""The combined margin on the target logit: s * (cos(m1 * theta + m2) - m3).

ArcFace is (1, 0.5, 0), CosFace (1, 0, 0.35..0.4), SphereFace-like m1 > 1, and any
combination. Only the target entry of each row changes, so the margin works on a
vector of target cosines and hands back the new logits and their slopes; the
Partial FC layer applies both to its logit matrix. It ignores the norms and keeps
no state.

Past theta_max = (pi - m2) / m1 the angle m1 * theta + m2 would wrap around pi and
the "penalty" would start rewarding wrong answers. There the target logit continues
as the straight line s * (cos(theta) - cos(theta_max) - 1 - m3): continuous at
theta_max (both sides equal s * (-1 - m3)), still decreasing in theta, slope s.
Cosines within EDGE of +-1 are held at +-(1 - EDGE) inside arccos, where its
slope is infinite; the gradient there is the (zero) slope of that clamp.
"""

from __future__ import annotations

import math

import mxnet as mx

EDGE = 1e-6


def margin_problem(m1: float, m2: float, m3: float, scale: float) -> str | None:
    """Why (m1, m2, m3) with `scale` is not a usable margin, or None."""
    if m1 >= 1 and 0 <= m2 < math.pi and 0 <= m3 < 2 and scale > 0:
        return None
    return (f"margin (m1={m1}, m2={m2}, m3={m3}), scale={scale}: need m1 >= 1, "
            "0 <= m2 < pi, 0 <= m3 < 2, scale > 0 (ArcFace: 1, 0.5, 0; CosFace: 1, 0, 0.4)")


class CombinedMargin:
    name = "combined"

    def __init__(self, m1: float, m2: float, m3: float, scale: float) -> None:
        if problem := margin_problem(m1, m2, m3, scale):
            raise ValueError(problem)
        self.m1, self.m2, self.m3, self.scale = m1, m2, m3, scale
        self.theta_max = (math.pi - m2) / m1
        self.additive_cosine = m1 == 1 and m2 == 0

    def observe(self, norms: mx.nd.NDArray) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def __call__(self, cos: mx.nd.NDArray,
                 norms: mx.nd.NDArray | None = None) -> tuple[mx.nd.NDArray, mx.nd.NDArray]:
        """Target logits and d(logit)/d(cos) for a vector of target cosines."""
        s = self.scale
        if self.additive_cosine:  # CosFace: a shift; no arccos, slope exactly s
            return s * (cos - self.m3), mx.nd.full(cos.shape, s, ctx=cos.context)
        held = mx.nd.clip(cos, -1 + EDGE, 1 - EDGE)
        theta = mx.nd.arccos(held)
        angle = self.m1 * theta + self.m2
        on_arc = theta <= self.theta_max
        arc_value = mx.nd.cos(angle) - self.m3
        line_value = cos - (math.cos(self.theta_max) + 1 + self.m3)
        value = mx.nd.where(on_arc, arc_value, line_value)
        inside = (cos > -1 + EDGE) * (cos < 1 - EDGE)
        arc_slope = self.m1 * mx.nd.sin(angle) / mx.nd.sin(theta) * inside
        slope = mx.nd.where(on_arc, arc_slope, mx.nd.ones_like(cos))
        return s * value, s * slope


def build(scale: float, margin_list: tuple, **options) -> CombinedMargin:
    if options:
        raise ValueError(f"margin_options={options} are for the other margins; the combined "
                         "margin takes margin_list = (m1, m2, m3)")
    if len(margin_list) != 3:
        raise ValueError(f"margin_list={margin_list} must be (m1, m2, m3)")
    return CombinedMargin(*margin_list, scale=scale)
