"""Learning-rate schedules and the backbone's AdamW."""

import mxnet as mx
import numpy as np
import pytest

from partial_fc_mx.run.checkpoint import TrainState
from partial_fc_mx.run.schedule import Schedule


def test_warmup_then_polynomial_decay_to_zero():
    schedule = Schedule.of(epoch_images=800, reference_batch=8, num_epoch=1, max_steps=0,
                   warmup_epoch=0.1, lr_steps=[])
    lrs = [schedule.learning_rate(0.1, 8 * s) for s in range(100)]
    assert lrs[0] == pytest.approx(0.01) and lrs[9] == pytest.approx(0.1)
    assert lrs[10] == pytest.approx(0.1) and lrs[55] == pytest.approx(0.1 * 0.5 ** 2)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:])) and lrs[-1] < 1e-3
    assert schedule.learning_rate(0.1, 900) == 0.0  # past the end: clamped, never negative


@pytest.mark.parametrize("power", [1.0, 2.0])
def test_the_decay_at_lr_power_is_arcface_torchs_at_that_power(power):
    """PolynomialLRWarmup's closed form without warmup, step s of T: base (1 - s/T)^power
    (train_v2.py's power is 1, its earlier PolyScheduler's 2)."""
    schedule = Schedule.of(800, 8, num_epoch=2, max_steps=0, warmup_epoch=0, lr_steps=[],
                           power=power)
    ours = [schedule.learning_rate(0.1, 8 * step) for step in range(200)]
    assert ours == pytest.approx([0.1 * (1 - step / 200) ** power for step in range(200)])


def test_multi_step_divides_by_ten_at_each_step():
    schedule = Schedule.of(800, 8, num_epoch=1, max_steps=0, warmup_epoch=0, lr_steps=[60, 30])
    lrs = [schedule.learning_rate(0.1, 8 * s) for s in (0, 29, 30, 59, 60, 99)]
    assert lrs == pytest.approx([0.1, 0.1, 0.01, 0.01, 0.001, 0.001])


def simulate(schedule: Schedule, state: TrainState, global_batch: int) -> list[int]:
    """The trainer's progression: the start position of every step to the end."""
    starts = []
    state.advance(global_batch, schedule.epoch_images, steps=0)
    while not schedule.done(state.epoch, state.images_in_epoch):
        starts.append(schedule.position(state.epoch, state.images_in_epoch))
        state.advance(global_batch, schedule.epoch_images)
    return starts


def assert_contiguous(starts: list[int], first: int, global_batch: int, images: int):
    """Each step takes the next global batch of its epoch; an epoch ends when no full
    batch is left, and the next one starts at its beginning."""
    expected = first
    for start in starts:
        if expected % images + global_batch > images:
            expected = (expected // images + 1) * images
        assert start == expected
        expected += global_batch


@pytest.mark.parametrize("seed", range(30))
def test_a_resume_on_another_world_size_covers_the_same_progress(seed):
    rng = np.random.default_rng(seed)
    per_rank, (before, after) = int(rng.integers(1, 9)), rng.integers(1, 5, 2)
    images = int(rng.integers(per_rank * max(before, after), 300))
    max_steps = int(rng.integers(1, 60)) if seed % 3 == 0 else 0
    schedule = Schedule.of(images, per_rank * before, num_epoch=int(rng.integers(1, 4)),
                   max_steps=max_steps, warmup_epoch=0, lr_steps=[])
    uninterrupted = simulate(schedule, TrainState(), per_rank * before)
    assert len(uninterrupted) == (max_steps or schedule.steps_left(0, 0, per_rank * before))
    assert_contiguous(uninterrupted, 0, per_rank * before, images)
    stop = int(rng.integers(0, len(uninterrupted)))  # steps done before the resume
    state = TrainState()
    state.advance(per_rank * before, images, steps=0)
    for _ in range(stop):
        state.advance(per_rank * before, images)
    resume_at = schedule.position(state.epoch, state.images_in_epoch)
    left = schedule.steps_left(state.epoch, state.images_in_epoch, per_rank * after)
    resumed = simulate(schedule, state, per_rank * after)
    assert len(resumed) == left
    assert_contiguous(resumed, resume_at, per_rank * after, images)
    last_start = (resumed or uninterrupted[:stop] or [0])[-1]
    assert last_start < schedule.end <= schedule.position(state.epoch, state.images_in_epoch)
    if not max_steps:  # an epoch run ends at the start of the epoch after the last one
        assert (state.epoch, state.images_in_epoch) == (schedule.end // images, 0)


def test_adamw_matches_the_decoupled_update_rule():
    from partial_fc_mx.run.backbone_optimizer import BackboneAdamW

    rng = np.random.default_rng(0)
    w0 = rng.normal(size=5)
    grads = [rng.normal(size=5) for _ in range(3)]
    optimizer = BackboneAdamW(learning_rate=0.01, wd=0.1, beta1=0.9, beta2=0.999, epsilon=1e-8)
    weight = mx.nd.array(w0, dtype="float64")
    state = optimizer.create_state(0, weight)
    w, m, v = w0.copy(), np.zeros(5), np.zeros(5)
    for t, g in enumerate(grads, 1):
        optimizer.update(0, weight, mx.nd.array(g, dtype="float64"), state)
        m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
        correction = np.sqrt(1 - 0.999**t) / (1 - 0.9**t)
        w = w - 0.01 * (correction * m / (np.sqrt(v) + 1e-8) + 0.1 * w)
    np.testing.assert_allclose(weight.asnumpy(), w, rtol=1e-5)  # betas are float32 inside
