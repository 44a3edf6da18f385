"""A float64 full-softmax classifier written the plain way, for exactness tests.

It normalizes rows explicitly and back-propagates through the normalization with the
plain chain rule (where PartialFC projects each center's gradient, weights the rows
inside its GEMMs and adds the target entries apart), so the two share no shortcut.
"""

from __future__ import annotations

import math

import numpy as np


def margin_logit(cos: np.ndarray, m1: float, m2: float, m3: float, s: float) -> np.ndarray:
    """s * (cos(m1*theta + m2) - m3), continued as a line past theta_max (margins/combined.py)."""
    theta = np.arccos(np.clip(cos, -1, 1))
    theta_max = (math.pi - m2) / m1
    line = cos - math.cos(theta_max) - 1 - m3
    return s * np.where(theta <= theta_max, np.cos(m1 * theta + m2) - m3, line)


def margin_slope(cos: np.ndarray, m1: float, m2: float, m3: float, s: float) -> np.ndarray:
    if m1 == 1 and m2 == 0:
        return np.full_like(cos, s)
    theta = np.arccos(np.clip(cos, -1, 1))
    on_arc = theta <= (math.pi - m2) / m1
    with np.errstate(divide="ignore", invalid="ignore"):
        arc = m1 * np.sin(m1 * theta + m2) / np.sin(theta)
    return s * np.where(on_arc, arc, 1.0)


class AdaFace:
    """AdaFace's target logit in float64 (margins/adaface.py), the statistics kept as
    the authors' code keeps them: EMA of the clipped norms' mean and unbiased std."""

    EPS = 1e-3

    def __init__(self, s, m, h, t_alpha, mean, std):
        self.s, self.m, self.h, self.t_alpha, self.mean, self.std = s, m, h, t_alpha, mean, std

    def observe(self, norms):
        safe = np.clip(np.asarray(norms, np.float64), 0.001, 100)
        self.mean = self.t_alpha * safe.mean() + (1 - self.t_alpha) * self.mean
        self.std = self.t_alpha * safe.std(ddof=1) + (1 - self.t_alpha) * self.std

    def z(self, norms):
        safe = np.clip(norms, 0.001, 100)
        return np.clip(self.h * (safe - self.mean) / (self.std + self.EPS), -1, 1)

    def theta_m(self, cos, norms):
        theta = np.arccos(np.clip(cos, -1 + self.EPS, 1 - self.EPS))
        return theta, np.clip(theta - self.m * self.z(norms), self.EPS, math.pi - self.EPS)

    def logit(self, cos, norms):
        _, theta_m = self.theta_m(cos, norms)
        return self.s * (np.cos(theta_m) - self.m * (1 + self.z(norms)))

    def slope(self, cos, norms):
        theta, theta_m = self.theta_m(cos, norms)
        free = (np.abs(cos) < 1 - self.EPS) & (theta_m > self.EPS) & (theta_m < math.pi - self.EPS)
        return self.s * np.where(free, np.sin(theta_m) / np.sin(theta), 0.0)


def target_logit_and_slope(margin, s, cos, norms):
    """`margin`: (m1, m2, m3) of the combined margin, or a float64 margin object."""
    if isinstance(margin, tuple):
        return margin_logit(cos, *margin, s), margin_slope(cos, *margin, s)
    return margin.logit(cos, norms), margin.slope(cos, norms)


def loss_and_grads(x, labels, weight, margin, s, columns=None, subcenters=1, threshold=0.0):
    """Mean margin cross-entropy over the classes in `columns` (all by default).

    Returns (loss, d loss / d x, d loss / d weight) in float64; rows of `weight`
    outside `columns` get zero gradient. The margin's norms are constants, as in
    AdaFace (no gradient flows through them). `subcenters` K: `weight` holds K rows per
    class (class c's are rows cK ... cK + K - 1), a class's cosine is their max and
    its gradient goes to that row alone. `threshold` (inter-class filtering, 0: off): a
    non-target cosine above it counts as 0, with no gradient.
    """
    x, weight = np.asarray(x, np.float64), np.asarray(weight, np.float64)
    num_classes = len(weight) // subcenters
    columns = np.arange(num_classes) if columns is None else np.asarray(columns)
    w = weight.reshape(num_classes, subcenters, -1)[columns]  # n x K x D
    x_norm = np.linalg.norm(x, axis=1, keepdims=True)
    w_norm = np.linalg.norm(w, axis=2, keepdims=True)
    x_hat, w_hat = x / x_norm, w / w_norm
    sub_cos = np.clip(np.einsum("id,ckd->ick", x_hat, w_hat), -1, 1)  # N x n x K
    best = sub_cos.argmax(axis=2)
    cos = np.take_along_axis(sub_cos, best[..., None], 2)[..., 0]
    rows = np.arange(len(x))
    target = np.searchsorted(columns, labels)
    assert (columns[target] == labels).all(), "every label must be among the columns"
    filtered = cos > threshold if threshold > 0 else np.zeros(cos.shape, bool)
    filtered[rows, target] = False
    logits = s * np.where(filtered, 0.0, cos)
    target_logits, target_slopes = target_logit_and_slope(margin, s, cos[rows, target],
                                                          x_norm[:, 0])
    logits[rows, target] = target_logits
    logits -= logits.max(axis=1, keepdims=True)
    prob = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    loss = -np.log(prob[rows, target]).mean()
    grad_logits = prob.copy()
    grad_logits[rows, target] -= 1
    grad_logits /= len(x)
    grad_cos = s * grad_logits
    grad_cos[rows, target] = grad_logits[rows, target] * target_slopes
    grad_cos[filtered] = 0
    grad_sub = np.zeros_like(sub_cos)
    np.put_along_axis(grad_sub, best[..., None], grad_cos[..., None], 2)
    grad_x_hat = np.einsum("ick,ckd->id", grad_sub, w_hat)
    grad_w_hat = np.einsum("ick,id->ckd", grad_sub, x_hat)
    grad_x = (grad_x_hat - x_hat * (x_hat * grad_x_hat).sum(1, keepdims=True)) / x_norm
    grad_w = (grad_w_hat - w_hat * (w_hat * grad_w_hat).sum(2, keepdims=True)) / w_norm
    grad_weight = np.zeros_like(weight).reshape(num_classes, subcenters, -1)
    grad_weight[columns] = grad_w
    return loss, grad_x, grad_weight.reshape(weight.shape), filtered.sum() / (
        filtered.size - len(x))


def sgd_momentum(weight, states, grad, rows, lr, mu, wd):
    """MXNet's sgd_mom_update on `rows` only: v = mu*v - lr*(g + wd*w); w += v."""
    weight, momentum = weight.astype(np.float64), states["mom"].astype(np.float64)
    momentum[rows] = mu * momentum[rows] - lr * (grad[rows] + wd * weight[rows])
    weight[rows] += momentum[rows]
    return weight, {"mom": momentum}


def adamw(weight, states, grad, rows, lr, b1, b2, eps, wd):
    """AdamW on `rows` only, each row's bias correction by its own update count:
    t += 1; m, v moving averages; w -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * w)."""
    weight = weight.astype(np.float64)
    new = {name: state.astype(np.float64) for name, state in states.items()}
    t, m, v, g = new["steps"], new["mean"], new["var"], grad
    t[rows] += 1
    m[rows] = b1 * m[rows] + (1 - b1) * g[rows]
    v[rows] = b2 * v[rows] + (1 - b2) * g[rows] ** 2
    m_hat = m[rows] / (1 - b1 ** t[rows])
    v_hat = v[rows] / (1 - b2 ** t[rows])
    weight[rows] -= lr * (m_hat / (np.sqrt(v_hat) + eps) + wd * weight[rows])
    return weight, new
