"""The combined margin: values, continuity past pi, and slopes by finite differences."""

from __future__ import annotations

import math

import mxnet as mx
import numpy as np
import pytest
from pfc_reference import margin_logit

from partial_fc_mx.losses import CombinedMargin

MARGINS = {
    "arcface": (1.0, 0.5, 0.0),
    "cosface": (1.0, 0.0, 0.4),
    "combined": (1.0, 0.3, 0.2),
    "sphere-like": (1.35, 0.0, 0.0),
    "large-m2": (1.0, 1.2, 0.1),
}


def evaluate(margin: CombinedMargin, cos: np.ndarray):
    value, slope = margin(mx.nd.array(cos, dtype="float64"))
    return value.asnumpy(), slope.asnumpy()


def probe_points(m1, m2) -> np.ndarray:
    theta_max = (math.pi - m2) / m1
    thetas = np.concatenate([np.linspace(0.05, math.pi - 0.05, 41),
                             [theta_max - 0.02, theta_max - 1e-3, theta_max + 1e-3,
                              theta_max + 0.02, math.pi - 0.01]])
    thetas = thetas[(thetas > 0) & (thetas < math.pi)]
    return np.cos(thetas)


@pytest.mark.parametrize("name", MARGINS)
def test_values_follow_the_definition(name):
    m1, m2, m3 = MARGINS[name]
    cos = probe_points(m1, m2)
    value, _ = evaluate(CombinedMargin(m1, m2, m3, scale=64.0), cos)
    np.testing.assert_allclose(value, margin_logit(cos, m1, m2, m3, 64.0), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", MARGINS)
def test_slopes_match_finite_differences_including_past_pi(name):
    m1, m2, m3 = MARGINS[name]
    margin = CombinedMargin(m1, m2, m3, scale=32.0)
    cos = probe_points(m1, m2)
    h = 1e-7
    numeric = (evaluate(margin, cos + h)[0] - evaluate(margin, cos - h)[0]) / (2 * h)
    _, slope = evaluate(margin, cos)
    np.testing.assert_allclose(slope, numeric, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["arcface", "combined", "sphere-like", "large-m2"])
def test_continuous_and_decreasing_in_theta_across_theta_max(name):
    m1, m2, m3 = MARGINS[name]
    margin = CombinedMargin(m1, m2, m3, scale=1.0)
    theta_max = (math.pi - m2) / m1
    below, above = evaluate(margin, np.cos([theta_max - 1e-9, theta_max + 1e-9]))[0]
    assert abs(below - above) < 1e-6 and abs(below - (-1 - m3)) < 1e-6
    values = evaluate(margin, np.cos(np.linspace(0.01, math.pi - 0.01, 500)))[0]
    assert (np.diff(values) < 0).all()


def test_aligned_vector_gets_a_finite_gradient():
    value, slope = CombinedMargin(1.0, 0.5, 0.0, 64.0)(mx.nd.array([1.0, 1 + 1e-7, -1.0]))
    assert np.isfinite(value.asnumpy()).all() and np.isfinite(slope.asnumpy()).all()


@pytest.mark.parametrize("bad", [(0.5, 0.0, 0.0), (1.0, -0.1, 0.0), (1.0, 3.2, 0.0)])
def test_invalid_margins_are_refused(bad):
    with pytest.raises(ValueError, match="ArcFace: 1, 0.5, 0"):
        CombinedMargin(*bad, scale=64.0)
