"""Partial FC against the float64 full-softmax reference, with real processes.

Each (launcher, processes) pair launches tests/pfc_worker.py once, on every rank, with
all its cases in turn (start-up was most of the time); a rank prints PASS with the
errors it measured only when loss, embedding gradients and centers after two
updates are within 1e-5 (relative) of the reference (SGD with momentum or AdamW
on the centers), and unsampled rows and their optimizer states are bit-identical.
Bad input must be rejected with the same message on every rank.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from conftest import horovodrun_gloo, mpirun, run

from partial_fc_mx.pfc.partial_fc import PartialFC

WORKER = ["tests/pfc_worker.py"]


EXACT = [
    ("python", 1, "exact"),
    ("python", 1, "sampled"),
    ("horovodrun", 2, "exact"),       # 53 classes: shards of 27 and 26
    ("mpirun", 3, "exact"),           # 18, 18, 17
    ("horovodrun", 3, "sampled"),     # sample_rate 0.2 of 400 classes
    ("mpirun", 2, "sampled"),
    ("python", 1, "dense-sampled"),   # lazy_update=False: every row's momentum and decay
    ("mpirun", 2, "dense-sampled"),
    ("python", 1, "replay-sampled"),  # center_update "exact": the dense reference, 6 steps
    ("horovodrun", 2, "replay-sampled"),
    ("mpirun", 3, "blocks-replay-sampled"),
    ("mpirun", 3, "unequal"),         # batches of 4, 5 and 6 rows
    ("horovodrun", 2, "fp16"),        # float16 embeddings and float16 center storage
    ("mpirun", 2, "fp16-sampled"),
    ("horovodrun", 2, "bf16"),        # bfloat16 embeddings (MXNet's CPU low precision)
    ("python", 1, "adamw"),           # AdamW on the centers, per-row bias correction
    ("horovodrun", 3, "adamw-sampled"),
    ("mpirun", 2, "adamw-fp16-sampled"),  # float16 centers, float32 moments
    ("mpirun", 2, "adamw-dense-sampled"),  # lazy_update=False: every row, every step
    ("python", 1, "adaface"),         # AdaFace: global-batch norm statistics, W = 1, 2, 3
    ("horovodrun", 2, "adaface-sampled"),
    ("mpirun", 3, "adaface-unequal"),
    ("horovodrun", 2, "far"),         # logits 120 apart: one rank's softmax share is 0
    ("mpirun", 3, "varying"),         # the sampled count shrinks and grows: buffer views
    ("mpirun", 2, "nan-center"),      # a NaN center: a non-finite loss on every rank
    ("python", 1, "loss-scale"),      # the fp16 loss scale is applied before the cast
    ("mpirun", 2, "loss-scale"),
    ("mpirun", 3, "blocks-sampled"),  # shards in blocks of 11 rows (past one MXNet array)
    ("horovodrun", 2, "blocks-adamw-fp16-sampled"),
    ("mpirun", 2, "blocks-dense-sampled"),
    ("mpirun", 2, "composed-sampled"),  # the row passes from MXNet operators (a GPU's)
    ("horovodrun", 3, "composed-unequal"),
    # inter-class filtering (0.2) and sub-center ArcFace (K = 3), alone and together
    ("python", 1, "sub3-filter-sampled"),
    ("mpirun", 2, "filter-sampled"),
    ("horovodrun", 2, "sub3-exact"),
    ("mpirun", 3, "sub3-filter-blocks-replay-sampled"),
    ("mpirun", 3, "sub3-filter-composed-unequal"),
    ("horovodrun", 3, "filter-composed-sampled"),
    ("horovodrun", 2, "sub3-adamw-fp16-sampled"),
    ("mpirun", 2, "sub3-blocks-dense-sampled"),
    ("mpirun", 2, "sub3-nan-center"),
    # the GEMMs' inputs in bfloat16 (oneDNN 3): within the format's band (pfc_worker.GEMM16)
    ("python", 1, "gemm16-sampled"),
    ("mpirun", 2, "gemm16-blocks-sampled"),
    ("horovodrun", 3, "gemm16-unequal"),
    # gradient accumulation: 2 micro-batches held to the whole batch's reference
    ("python", 1, "accum-sampled"),
    ("mpirun", 2, "accum-blocks-replay-sampled"),
    ("horovodrun", 3, "accum-sub3-filter-unequal"),
    ("mpirun", 3, "accum-composed-sampled"),
    ("horovodrun", 2, "accum-adamw-fp16-sampled"),
]
"""(launcher, processes, case): each within 1e-5 of the float64 reference (gemm16: the
bfloat16 band)."""

BAD_INPUT = [
    ("mpirun", 2, "bad-label",
     "rank 1 passed labels that are not integers in [0, 20): [20.0, -1.0, 2.5]"),
    ("horovodrun", 3, "nonfinite",
     "rank 2 passed non-finite embeddings (NaN/Inf) in batch rows [2]"),
    ("mpirun", 3, "width", "rank 2 passed 4 x 7 embeddings with 4 labels; expected 4 x 8"),
]
"""(launcher, processes, case, the message every rank must raise)."""


def launch(launcher: str, world: int, cases: list[str]):
    args = [sys.executable, *WORKER, *cases]
    timeout = 60 + 30 * len(cases)
    if launcher == "python":
        return run(args, timeout=timeout)
    if launcher == "mpirun":
        return mpirun(world, args, timeout=timeout)
    return horovodrun_gloo(world, args, timeout=timeout)


@pytest.fixture(scope="module")
def launched():
    """Each (launcher, processes) pair starts once and runs all its cases of both tables
    in turn; `launched(launcher, world)` is that launch's result."""
    results = {}

    def result(launcher: str, world: int):
        if (launcher, world) not in results:
            cases = [case for (how, size, case, *_) in EXACT + BAD_INPUT
                     if (how, size) == (launcher, world)]
            try:
                results[launcher, world] = launch(launcher, world, cases)
            except AssertionError as error:  # a timeout: once, not again for each case
                results[launcher, world] = error
        if isinstance(results[launcher, world], AssertionError):
            raise results[launcher, world]
        return results[launcher, world]
    return result


def assert_said(result, lines: list[str]):
    """Every line printed: each rank's PASS or REJECTED for one case."""
    failed = [said for said in result.stdout.splitlines() if "FAIL rank" in said]
    for line in lines:
        assert line in result.stdout, f"no {line!r}; {failed}; the end:\n{result.stdout[-3000:]}"


@pytest.mark.parametrize("launcher, world, case", EXACT)
def test_matches_the_full_softmax_reference(launcher, world, case, launched):
    assert_said(launched(launcher, world),
                [f"PASS rank {rank}/{world} {case}:" for rank in range(world)])


@pytest.mark.parametrize("launcher, world, case, message", BAD_INPUT)
def test_bad_input_is_rejected_on_every_rank(launcher, world, case, message, launched):
    assert_said(launched(launcher, world),
                [f"REJECTED rank {rank}: Partial FC input rejected: {message}"
                 for rank in range(world)])


@pytest.mark.parametrize("launcher, world", sorted({(how, size) for how, size, *_ in EXACT}))
def test_each_launch_of_cases_ends_cleanly(launcher, world, launched):
    """Beside each case's lines: no case failed and no rank crashed, also at its exit."""
    result = launched(launcher, world)
    assert result.returncode == 0, result.stdout[-3000:]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rate_that_samples_nothing_on_some_rank_is_refused_on_every_rank(rank):
    """31 classes over 2 ranks hold 16 and 15; a rate of 1/16 samples 1 center of rank
    0's and none of rank 1's, which failed rank 1 alone inside a step while rank 0
    waited in a collective. Both constructors refuse it, before any collective."""
    with pytest.raises(ValueError, match="sample_rate=0.0625 samples 0 of the 15 class "
                                         "centers a process holds"):
        PartialFC(31, 8, rank=rank, world_size=2, sample_rate=0.0625)
    PartialFC(31, 8, rank=rank, world_size=2, sample_rate=1 / 15)  # one center each


def test_initial_centers_depend_on_the_class_not_on_the_world_size():
    """Each class's initial center comes from (seed, class index): the same matrix on
    any number of processes, and shards of equal size do not start alike."""
    full = PartialFC(10000, 8, rank=0, world_size=1, seed=5).weight.asnumpy()
    for world in (2, 3, 7):
        shards = [PartialFC(10000, 8, rank=r, world_size=world, seed=5).weight.asnumpy()
                  for r in range(world)]
        assert np.concatenate(shards).tobytes() == full.tobytes()
    first, second = np.split(full, 2)
    assert not np.allclose(first, second)
    assert abs(full.std() - 0.01) < 2e-4 and abs(full.mean()) < 2e-4
    other = PartialFC(10000, 8, rank=0, world_size=1, seed=6).weight.asnumpy()
    assert not np.allclose(other, full)
    # float16 shards are written block by block into the stored dtype: every row, rounded
    halves = [PartialFC(10000, 8, rank=r, world_size=3, seed=5, fp16_centers=True)
              .weight.asnumpy() for r in range(3)]
    assert np.concatenate(halves).tobytes() == full.astype(np.float16).tobytes()


def test_the_backward_gemms_and_the_row_projection_match_float64():
    """FullyConnected's backward operator gives both gradient GEMMs; the centers'
    gradient then loses its part along each center, a chunk of rows at a time (chunks
    of 7 rows over 40: the last one partial)."""
    import mxnet as mx

    from partial_fc_mx.pfc.gemm import fully_connected_backward
    from partial_fc_mx.pfc.rows import project_out_rows

    rng = np.random.default_rng(3)
    g, x, w = (rng.standard_normal(shape).astype(np.float32)
               for shape in ((6, 40), (6, 8), (40, 8)))
    grad_x, grad_w = mx.nd.zeros((6, 8)), mx.nd.zeros((40, 8))
    fully_connected_backward(mx.nd.array(g), mx.nd.array(x), mx.nd.array(w), grad_x, grad_w)
    m = g.T.astype(np.float64) @ x
    assert np.allclose(grad_x.asnumpy(), g.astype(np.float64) @ w, atol=1e-4)
    assert np.allclose(grad_w.asnumpy(), m, atol=1e-4)
    inverse = 1 / (w.astype(np.float64) ** 2).sum(axis=1)
    scale = rng.uniform(0.5, 2, 40)
    project_out_rows(grad_w, mx.nd.array(w), mx.nd.array(inverse), mx.nd.array(scale),
                     mx.nd.zeros((7, 8)))
    expected = scale[:, None] * (m - ((m * w).sum(axis=1) * inverse)[:, None] * w)
    assert np.allclose(grad_w.asnumpy(), expected, atol=1e-4)
    assert np.allclose((grad_w.asnumpy() * w).sum(axis=1), 0, atol=1e-3)  # orthogonal to w


def test_the_target_terms_add_their_entries_of_both_gemms():
    """The target entries, left out of the GEMMs, add exactly what they would have
    added there, also when several rows share a target column."""
    import mxnet as mx

    from partial_fc_mx.pfc.partial_fc import (
        Targets,
        add_target_terms_to_centers,
        add_target_terms_to_embeddings,
    )

    rng = np.random.default_rng(4)
    x, v = rng.standard_normal((6, 8)), rng.standard_normal((40, 8))
    target_col = np.array([3, -1, 3, 39, 0, -1])  # rows 0 and 2 share column 3
    targets = Targets.of(target_col, mx.cpu())
    target_grad = rng.standard_normal(4)
    entries = np.zeros((6, 40))
    entries[[0, 2, 3, 4], [3, 3, 39, 0]] = target_grad
    grad_x, grad_v = rng.standard_normal((6, 8)), rng.standard_normal((40, 8))
    got_x, got_v = mx.nd.array(grad_x), mx.nd.array(grad_v)
    add_target_terms_to_embeddings(got_x, mx.nd.array(v), targets, mx.nd.array(target_grad))
    add_target_terms_to_centers(got_v, mx.nd.array(x), targets, mx.nd.array(target_grad))
    assert np.allclose(got_x.asnumpy(), grad_x + entries @ v, atol=1e-5)
    assert np.allclose(got_v.asnumpy(), grad_v + entries.T @ x, atol=1e-5)
