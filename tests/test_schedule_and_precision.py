"""Learning-rate schedules, the dynamic loss scaler and AdamW."""

import mxnet as mx
import numpy as np
import pytest

from partial_fc_mx.precision import LossScaler, PrecisionError, to_float16
from partial_fc_mx.schedule import learning_rate


def test_warmup_then_polynomial_decay_to_zero():
    lrs = [learning_rate(0.1, s, 100, 10, []) for s in range(100)]
    assert lrs[0] == pytest.approx(0.01) and lrs[9] == pytest.approx(0.1)
    assert lrs[10] == pytest.approx(0.1) and lrs[55] == pytest.approx(0.1 * 0.5 ** 2)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:])) and lrs[-1] < 1e-3


def test_multi_step_divides_by_ten_at_each_step():
    lrs = [learning_rate(0.1, s, 100, 0, [30, 60]) for s in (0, 29, 30, 59, 60, 99)]
    assert lrs == pytest.approx([0.1, 0.1, 0.01, 0.01, 0.001, 0.001])


def test_loss_scaler_halves_on_overflow_and_grows_after_clean_steps():
    scaler = LossScaler(dynamic=True, scale=1024.0, growth_interval=3)
    good, bad = [mx.nd.ones(3)], [mx.nd.array([1.0, float("inf")])]
    assert scaler.gradients_finite(good) and not scaler.gradients_finite(bad)
    scaler.update(False)
    assert scaler.scale == 512.0
    for _ in range(3):
        scaler.update(True)
    assert scaler.scale == 1024.0
    fixed = LossScaler(dynamic=False)
    assert fixed.scale == 1.0 and fixed.gradients_finite(bad)  # fp32 checks nothing


def test_float16_is_refused_on_cpu_with_the_reason():
    with pytest.raises(PrecisionError, match="fp16=True needs a GPU.*FP16 gemm on cpu"):
        to_float16(None, mx.cpu())


def test_adamw_matches_the_decoupled_update_rule():
    from partial_fc_mx.optimizers import AdamW

    rng = np.random.default_rng(0)
    w0 = rng.normal(size=5)
    grads = [rng.normal(size=5) for _ in range(3)]
    optimizer = AdamW(learning_rate=0.01, wd=0.1, beta1=0.9, beta2=0.999, epsilon=1e-8)
    weight = mx.nd.array(w0, dtype="float64")
    state = optimizer.create_state(0, weight)
    w, m, v = w0.copy(), np.zeros(5), np.zeros(5)
    for t, g in enumerate(grads, 1):
        optimizer.update(0, weight, mx.nd.array(g, dtype="float64"), state)
        m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
        correction = np.sqrt(1 - 0.999**t) / (1 - 0.9**t)
        w = w - 0.01 * (correction * m / (np.sqrt(v) + 1e-8) + 0.1 * w)
    np.testing.assert_allclose(weight.asnumpy(), w, rtol=1e-5)  # betas are float32 inside
