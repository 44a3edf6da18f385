"""The exact lazy update (center_update = "exact"): rows that missed steps take them
when next sampled, and then equal the dense update's rows, whatever the world size,
the blocks, the learning rate and how long a row sat idle."""

from __future__ import annotations

import mxnet as mx
import numpy as np
import pytest
from conftest import config_file, logged, mpirun, run, train_args

from partial_fc_mx.pfc.center_optimizers.adamw import AdamW
from partial_fc_mx.pfc.center_optimizers.sgd import SGD
from partial_fc_mx.pfc.centers import ClassCenters, Shard, shard_of
from partial_fc_mx.pfc.idle_rows import IdleSteps
from partial_fc_mx.run.checkpoint import center_file

MU, LAMBDA = 0.9, 5e-4
CLASSES, DIM = 60, 8


def learning_rate(step: int, steps: int = 200) -> float:
    """Warmup, then polynomial decay: a different rate at every step."""
    return 0.2 * min(1.0, (step + 1) / 10) * (1 - step / steps) ** 2 + 1e-3


def sampled_rows(step: int) -> np.ndarray:
    """About 10% of the classes (global ids, sorted), the same for every world size, and
    one row in each third, so that every rank of 1, 2 or 3 samples some (as PartialFC's
    ranks always do)."""
    rows = np.flatnonzero(np.random.default_rng([5, step]).random(CLASSES) < 0.1)
    thirds = [third * CLASSES // 3 + step % (CLASSES // 3) for third in range(3)]
    return np.union1d(rows, thirds)


def gradient(step: int, rows: np.ndarray) -> np.ndarray:
    """A gradient for each sampled row that depends on (step, row) only, not on the
    weights: replayed, so rounding is not amplified by the dynamics."""
    return np.stack([np.random.default_rng([9, step, row]).normal(size=DIM) for row in rows])


def centers(shard: Shard, fused: bool = True, **options) -> ClassCenters:
    """fused: float32 rows on the CPU moved by the C++ kernels; False: by MXNet
    operators, as on a GPU."""
    return ClassCenters(shard, DIM, SGD(MU, LAMBDA, fused=fused), ctx=mx.cpu(), seed=3,
                        **options)


def run_steps(ranks: list[ClassCenters], steps: range) -> None:
    """Each rank's step on its part of the sample, as PartialFC runs it: the missed steps
    first (exact), then the sampled rows' gradient step."""
    for step in steps:
        rows, lr = sampled_rows(step), learning_rate(step)
        grads = gradient(step, rows)
        for part in ranks:
            mine = (rows >= part.shard.start) & (rows < part.shard.stop)
            index = rows[mine] - part.shard.start
            part.bring_current(index)
            w = part.sampled_weights(index)
            part.update(index, w, mx.nd.array(grads[mine]), lr)


def joined(ranks: list[ClassCenters]) -> dict[str, np.ndarray]:
    states = [part.state_dict() for part in ranks]
    return {name: np.concatenate([s[name] for s in states]) for name in ("weight", "mom")}


def per_row_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)))


@pytest.mark.parametrize("fused", [True, False])
def test_exact_equals_dense_over_200_steps_with_a_resume_on_another_world_size(fused):
    dense = centers(Shard(0, CLASSES), lazy=False)
    run_steps([dense], range(200))
    two = [centers(shard_of(CLASSES, r, 2), fused, exact=True, block_rows=7, rank=r)
           for r in (0, 1)]
    start = joined([centers(Shard(0, CLASSES))])
    for part in two:
        part.load_state_dict({name: rows[part.shard.start:part.shard.stop]
                              for name, rows in start.items()})
    run_steps(two, range(100))
    halfway = joined(two)  # every row brought current, as a checkpoint writes them
    three = [centers(shard_of(CLASSES, r, 3), fused, exact=True, block_rows=7, rank=r)
             for r in range(3)]
    for part in three:
        part.load_state_dict({name: rows[part.shard.start:part.shard.stop]
                              for name, rows in halfway.items()})
    run_steps(three, range(100, 200))
    got, want = joined(three), dense.state_dict()
    assert per_row_error(got["weight"], want["weight"]) < 1e-5
    assert per_row_error(got["mom"], want["mom"]) < 1e-5
    lazy = centers(Shard(0, CLASSES))  # what the exact update corrects
    run_steps([lazy], range(200))
    assert per_row_error(lazy.state_dict()["weight"], want["weight"]) > 1e-2


def test_the_forward_reads_the_rows_the_dense_update_has():
    """Sampled after idle steps, a row is brought current before it is gathered."""
    dense, exact = centers(Shard(0, CLASSES), lazy=False), centers(Shard(0, CLASSES), exact=True)
    run_steps([dense], range(30))
    run_steps([exact], range(30))
    rows = np.arange(CLASSES)
    idle = exact.idle.last < exact.idle.done
    assert idle.any()
    exact.bring_current(rows[idle])
    gathered = exact.sampled_weights(rows[idle]).asnumpy()
    assert per_row_error(gathered, dense.state_dict()["weight"][idle]) < 1e-5


def float64_idle_loop(w: np.ndarray, m: np.ndarray, rates: list[float]) -> tuple:
    for lr in rates:
        m = MU * m - lr * LAMBDA * w
        w = w + m
    return w, m


def test_a_row_idle_for_100000_steps_matches_a_float64_loop():
    idle = IdleSteps(2, MU, LAMBDA)
    rates = [learning_rate(step, 100_000) for step in range(100_000)]
    for step, lr in enumerate(rates):
        idle.stepped(np.array([1]) if step % 1000 == 0 else np.array([], np.int64), lr)
    w, m = np.random.default_rng(0).normal(size=(2, DIM))
    a, b, c, d = idle.coefficients(np.array([0]))[0]
    want_w, want_m = float64_idle_loop(w, m, rates)
    np.testing.assert_allclose(a * w + b * m, want_w, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(c * w + d * m, want_m, rtol=1e-9, atol=1e-12)
    # the row sampled at step 99,000 missed the 999 steps after it
    a, b, c, d = idle.coefficients(np.array([1]))[0]
    np.testing.assert_allclose(a * w + b * m, float64_idle_loop(w, m, rates[99_001:])[0],
                               rtol=1e-9)


def test_float16_centers_follow_a_float64_loop_within_their_rounding():
    """Products in float64, applied in float32, stored rounded once per catch-up."""
    half = centers(Shard(0, CLASSES), exact=True, dtype="float16")
    start = half.state_dict()
    w, m = start["weight"].astype(np.float64), start["mom"].astype(np.float64)
    rates = []
    for step in range(60):
        rows, lr = sampled_rows(step), learning_rate(step)
        half.bring_current(rows)
        half.update(rows, half.sampled_weights(rows), mx.nd.array(gradient(step, rows)), lr)
        g = np.zeros_like(w)
        g[rows] = gradient(step, rows)
        m = MU * m - lr * (g + LAMBDA * w)
        w = w + m
        rates.append(lr)
    got = half.state_dict()
    assert got["weight"].dtype == np.float16
    assert per_row_error(got["weight"].astype(np.float64), w) < 5e-3


def test_exact_is_sgds_alone():
    with pytest.raises(ValueError, match="adamw optimizer of the centers has no such replay"):
        ClassCenters(Shard(0, 10), DIM, AdamW(), ctx=mx.cpu(), exact=True)


def test_a_run_with_the_exact_update_saves_current_rows_and_resumes_on_another_world_size(
        tmp_path, synthetic):
    """center_update = "exact" from a config: 2 processes write the checkpoint a dense run
    writes (every row brought current before the save), which resumes on 1 process; and
    AdamW is refused before any step."""
    config = config_file(tmp_path, synthetic, center_update="exact", sample_rate=0.1,
                         max_steps=3, save_every=3)
    work = tmp_path / "work"
    first = mpirun(2, train_args(config, work), timeout=300)
    assert first.returncode == 0, first.stdout[-3000:]
    dense = config_file(tmp_path, synthetic, name="dense.py", center_update="dense",
                        sample_rate=0.1, max_steps=3, save_every=3)
    assert mpirun(2, train_args(dense, tmp_path / "dense"), timeout=300).returncode == 0
    for rank in (0, 1):
        for name in ("weight", "mom"):
            file = f"checkpoints/step_000003/{center_file(rank, name)}"
            got, want = np.load(work / file), np.load(tmp_path / "dense" / file)
            assert per_row_error(got, want) < 1e-4, (file, per_row_error(got, want))
    more = config_file(tmp_path, synthetic, name="more.py", center_update="exact",
                       sample_rate=0.1, max_steps=5)
    resumed = run(train_args(more, work, "--resume-from", str(work)), timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "resuming from" in resumed.stdout
    steps = [step["step"] for step in logged(work)["steps"]]
    assert steps[:3] == [1, 2, 3] and steps[3:] and steps[3:] == list(range(4, steps[-1] + 1))
    refused = run(train_args(config_file(tmp_path, synthetic, name="adamw.py",
                                         center_update="exact", center_optimizer="adamw"),
                             tmp_path / "adamw"), timeout=300)
    assert refused.returncode == 2
    assert "center_update='exact' replays SGD's momentum and weight decay" in refused.stdout
