"""Learning-rate schedules and the dynamic loss scaler."""

import mxnet as mx
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
