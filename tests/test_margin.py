"""The margins: values against their definitions, continuity past pi, slopes by finite
differences; AdaFace's batch statistics."""

from __future__ import annotations

import math

import mxnet as mx
import numpy as np
import pytest
from pfc_reference import AdaFace as ReferenceAdaFace
from pfc_reference import margin_logit

from partial_fc_mx.pfc.margins.adaface import AdaFace
from partial_fc_mx.pfc.margins.combined import CombinedMargin

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


def adaface_with(mean: float, std: float, **settings) -> AdaFace:
    margin = AdaFace(32.0, **settings)
    margin.load_state_dict({"mean": mean, "std": std})
    return margin


def adaface_probe() -> tuple:
    """Every pair of angles over (0, pi) and norms giving every quality z (clipped at -1
    and 1 too), so theta - m z is clipped near 0 and near pi for some of them."""
    thetas = np.linspace(0.013, math.pi - 0.013, 41)
    norms = np.linspace(2.0, 38.0, 9)  # z = 0.333 (n - 20) / 5
    theta_grid, norm_grid = np.meshgrid(thetas, norms)
    return np.cos(theta_grid.ravel()), norm_grid.ravel()


def evaluate_adaface(margin: AdaFace, cos: np.ndarray, norms: np.ndarray):
    value, slope = margin(mx.nd.array(cos, dtype="float64"), mx.nd.array(norms, dtype="float64"))
    return value.asnumpy(), slope.asnumpy()


def test_adaface_values_follow_the_definition():
    cos, norms = adaface_probe()
    margin = adaface_with(20.0, 5.0)
    reference = ReferenceAdaFace(32.0, 0.4, 0.333, 0.01, 20.0, 5.0)
    value, slope = evaluate_adaface(margin, cos, norms)
    # rtol 1e-6, not 1e-9: MXNet's clip takes its bounds (1 - eps, ...) as float32
    np.testing.assert_allclose(value, reference.logit(cos, norms), rtol=1e-6)
    np.testing.assert_allclose(slope, reference.slope(cos, norms), rtol=1e-6)
    z = reference.z(norms)
    assert (z == -1).any() and (z == 1).any() and (abs(z) < 1).any()
    shifted = np.arccos(cos) - 0.4 * z
    assert (shifted < 1e-3).any() and (shifted > math.pi - 1e-3).any()
    assert (slope == 0).sum() > 0  # where a clip holds
    # the ends: a poor image gets ArcFace's margin, a good one 2m additive and -m angular
    theta = np.arccos(0.5)
    low, high = evaluate_adaface(margin, np.array([0.5, 0.5]), np.array([1.0, 99.0]))[0]
    assert abs(low - 32.0 * math.cos(theta + 0.4)) < 1e-9
    assert abs(high - 32.0 * (math.cos(theta - 0.4) - 0.8)) < 1e-9


def test_adaface_slopes_match_finite_differences():
    cos, norms = adaface_probe()
    margin = adaface_with(20.0, 5.0)
    h = 1e-7
    numeric = (evaluate_adaface(margin, cos + h, norms)[0]
               - evaluate_adaface(margin, cos - h, norms)[0]) / (2 * h)
    np.testing.assert_allclose(evaluate_adaface(margin, cos, norms)[1], numeric,
                               rtol=1e-5, atol=1e-5)


def test_adaface_statistics_are_moving_averages_of_the_batch():
    margin = AdaFace(64.0, t_alpha=0.1)
    norms = np.array([10.0, 14.0, 300.0])  # 300 is clipped to 100 first
    margin.observe(mx.nd.array(norms))
    safe = np.clip(norms, 0.001, 100)
    expected = {"mean": 0.1 * safe.mean() + 0.9 * 20, "std": 0.1 * safe.std(ddof=1) + 0.9 * 100}
    assert margin.state_dict() == pytest.approx(expected, rel=1e-12)
    again = AdaFace(64.0, t_alpha=0.1)
    again.load_state_dict(margin.state_dict())
    assert again.state_dict() == margin.state_dict()


@pytest.mark.parametrize("settings", [{"m": -0.1}, {"h": 0}, {"t_alpha": 0}, {"t_alpha": 1.5}])
def test_invalid_adaface_settings_are_refused(settings):
    with pytest.raises(ValueError, match="the paper: m=0.4, h=0.333"):
        AdaFace(64.0, **settings)
