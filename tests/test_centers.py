"""ClassCenters: its state as a unit, and the optimizers' storage paths, in-process."""

from __future__ import annotations

import mxnet as mx
import numpy as np
import pytest

from partial_fc_mx.pfc.center_optimizers.adamw import AdamW
from partial_fc_mx.pfc.center_optimizers.sgd import SGD
from partial_fc_mx.pfc.centers import ClassCenters, shard_of, tensor_size_problem
from partial_fc_mx.pfc.idle_rows import IdleSteps
from partial_fc_mx.pfc.partial_fc import PartialFC
from partial_fc_mx.sizing.pfc_memory import LOGIT_MATRICES, estimate_memory


def centers(optimizer=None, dtype="float32", lazy=True, rows=50, rank=1, world=3, width=8):
    return ClassCenters(shard_of(rows * world, rank, world), width, optimizer or SGD(),
                        ctx=mx.cpu(), dtype=dtype, seed=3, rank=rank, lazy=lazy)


def test_state_dict_round_trips_every_array_and_the_sampler():
    source = centers(AdamW())
    rng = np.random.default_rng(0)
    source.load_state_dict({"weight": rng.normal(size=(50, 8)), "mean": rng.normal(size=(50, 8)),
                            "var": rng.random((50, 8)), "steps": rng.integers(0, 9, (50, 1))})
    source.rng.integers(0, 10, 5)  # move the stream on
    state = source.state_dict()
    assert sorted(state) == ["mean", "sampler", "steps", "var", "weight"]
    copy = centers(AdamW())
    copy.load_state_dict(state)
    again = copy.state_dict()
    for name in ("weight", "mean", "var", "steps"):
        assert again[name].tobytes() == state[name].tobytes(), name
    assert copy.rng.integers(0, 10**9, 4).tolist() == source.rng.integers(0, 10**9, 4).tolist()


def test_a_state_left_out_starts_at_zero_and_bad_states_are_refused():
    target = centers(SGD())
    target.states["mom"] += 1
    target.load_state_dict({"weight": np.ones((50, 8))})  # --load-from: weights only
    assert not target.states["mom"].asnumpy().any()
    with pytest.raises(ValueError, match="expected weight, sampler and the sgd states"):
        target.load_state_dict({"weight": np.ones((50, 8)), "mean": np.ones((50, 8))})
    with pytest.raises(ValueError, match="expected weight"):
        target.load_state_dict({"mom": np.ones((50, 8))})
    with pytest.raises(ValueError, match=r"mom shard has shape \(49, 8\), this rank expects"):
        target.load_state_dict({"weight": np.ones((50, 8)), "mom": np.ones((49, 8))})


@pytest.mark.parametrize("lazy, fused", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("width", [8, 67, 512])
def test_sgd_is_mxnets_row_sparse_update_bit_for_bit(lazy, fused, width):
    """The float32 path is exactly MXNet's sgd_mom_update (lazy or not; fused: the C++
    kernel of the CPU, else MXNet's gather-update-scatter, a GPU's path), as before the
    centers became pluggable; the float64 tests only bound it to 1e-5. Widths past one
    vector (16 floats in AVX-512) reach the kernel's vector loop, where a fused
    multiply-add would change the bits."""
    subject = centers(SGD(momentum=0.9, weight_decay=5e-4, fused=fused), lazy=lazy, width=width)
    rng = np.random.default_rng(1)
    subject.load_state_dict({"weight": rng.normal(size=(50, width)),
                             "mom": rng.normal(size=(50, width))})
    weight, momentum = subject.weight.copy(), subject.states["mom"].copy()
    index = np.array([2, 7, 30])
    grad = mx.nd.array(rng.normal(size=(3, width)))
    subject.update(index, subject.sampled_weights(index), grad, 0.1)
    sparse = mx.nd.sparse.row_sparse_array((grad, mx.nd.array(index, dtype="int64")),
                                           shape=(50, width))
    mx.nd.sgd_mom_update(weight, sparse, momentum, lr=0.1, momentum=0.9, wd=5e-4,
                         lazy_update=lazy, out=weight)
    assert subject.weight.asnumpy().tobytes() == weight.asnumpy().tobytes()
    assert subject.states["mom"].asnumpy().tobytes() == momentum.asnumpy().tobytes()


def test_the_fused_sgd_kernel_takes_float32_cpu_rows_and_refuses_a_bad_index():
    from partial_fc_mx.pfc import kernels
    from partial_fc_mx.pfc.center_optimizers.sgd import fused_kernel_applies

    kernels.load()
    assert fused_kernel_applies(centers(SGD()).blocks[0])
    assert not fused_kernel_applies(centers(SGD(), dtype="float16").blocks[0])
    weight, mom = mx.nd.ones((4, 3)), mx.nd.zeros((4, 3))
    with pytest.raises(mx.base.MXNetError, match="index 4 is outside the 4 rows"):
        mx.nd.pfc_sgd_momentum_rows(weight, mom, mx.nd.array([1, 4], dtype="int64"),
                                    mx.nd.ones((2, 3)), lr=0.1, momentum=0.9, wd=0.0,
                                    out=weight).wait_to_read()
    with pytest.raises(mx.base.MXNetError, match="in place: call it with out=weight"):
        mx.nd.pfc_sgd_momentum_rows(weight, mom, mx.nd.array([1], dtype="int64"),
                                    mx.nd.ones((1, 3)), lr=0.1, momentum=0.9, wd=0.0,
                                    out=mx.nd.zeros((4, 3))).wait_to_read()
    with pytest.raises(mx.base.MXNetError, match="cannot read the number lr"):
        mx.nd.pfc_sgd_momentum_rows(weight, mom, mx.nd.array([1], dtype="int64"),
                                    mx.nd.ones((1, 3)), lr="0,1", momentum=0.9, wd=0.0,
                                    out=weight).wait_to_read()


def test_float16_centers_keep_float32_adamw_moments():
    subject = centers(AdamW(), dtype="float16")
    assert subject.weight.dtype == np.float16
    assert {name: state.dtype for name, state in subject.states.items()} == {
        "mean": np.float32, "var": np.float32, "steps": np.float32}
    index = np.array([0, 4])
    grad = mx.nd.array(np.full((2, 8), 1e-5))  # g^2 = 1e-10: zero in float16
    subject.update(index, subject.sampled_weights(index), grad, 1e-3)
    assert (subject.states["var"].asnumpy()[[0, 4]] > 0).all()
    assert subject.states["steps"].asnumpy()[:, 0].tolist() == [1, 0, 0, 0, 1] + [0] * 45


def test_memory_estimate_counts_every_state():
    sgd = estimate_memory(1000, 512, 1, 0, 0.1, 64)
    adamw = estimate_memory(1000, 512, 1, 0, 0.1, 64, optimizer=AdamW())
    fp16 = estimate_memory(1000, 512, 1, 0, 0.1, 64, fp16_centers=True, optimizer=AdamW())
    assert sgd.centers == 1000 * 512 * 4 * 2
    assert adamw.centers == 1000 * (512 * 4 * 3 + 4)
    assert fp16.centers == 1000 * (512 * 2 + 512 * 4 * 2 + 4)
    exact = estimate_memory(1000, 512, 1, 0, 0.1, 64, center_update="exact")
    assert exact.centers == sgd.centers + 1000 * IdleSteps(1, 0.9, 5e-4).last.itemsize


def test_memory_estimate_counts_sub_centers_and_the_filters_mask():
    """K sub-centers: K times the rows and their states, K times the sampled rows and
    their logits, and the classes' N x n logits beside them; the filter one N x n mask."""
    plain = estimate_memory(1000, 512, 1, 0, 0.1, 64)
    three = estimate_memory(1000, 512, 1, 0, 0.1, 64, subcenters=3)
    filtered = estimate_memory(1000, 512, 1, 0, 0.1, 64, filtering=True)
    assert three.centers == 3 * plain.centers and three.sampled_rows == 3 * plain.sampled_rows
    n, batch = 100, 64
    assert three.logits == (LOGIT_MATRICES * 3 * n + n) * batch * 4
    assert filtered.logits == plain.logits + n * batch * 4


def test_memory_estimate_with_accumulation_samples_for_every_micro_batch():
    """4 micro-batches of 64 rows: their positives (up to 256 classes) pass the rate's
    100; the logits are one micro-batch's; the sampled rows' gradient is summed in one
    more row of D floats each."""
    one = estimate_memory(1000, 512, 1, 0, 0.1, 64)
    four = estimate_memory(1000, 512, 1, 0, 0.1, 64, micro_batches=4)
    assert one.logits == LOGIT_MATRICES * 100 * 64 * 4
    assert four.logits == LOGIT_MATRICES * 256 * 64 * 4
    assert four.sampled_rows == 256 * (one.sampled_rows // 100 + 512 * 4)
    assert four.centers == one.centers


@pytest.mark.parametrize("optimizer", [SGD(), AdamW()])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_memory_estimate_covers_the_buffers_an_update_keeps(optimizer, dtype):
    """The rows gathered for a step, their float32 copies and the gradient stay in
    buffers between steps (buffers.py); the per-step estimate must hold them."""
    subject = centers(optimizer, dtype=dtype, rows=200, rank=0, world=1)
    index = np.arange(0, 200, 4)  # 50 of 200 rows
    grad = mx.nd.ones((50, 8))
    subject.update(index, subject.sampled_weights(index), grad, 0.1)
    estimate = estimate_memory(200, 8, 1, 0, 0.25, 1, fp16_centers=dtype == "float16",
                               optimizer=optimizer)
    logits = LOGIT_MATRICES * 1 * 50 * 4
    held = subject.buffers.nbytes() + sum(block.buffers.nbytes() for block in subject.blocks)
    assert held > 0  # the gathered rows and states stay in buffers between steps
    assert held + grad.size * 4 <= estimate.working - logits


@pytest.mark.parametrize("classes, world, rate, problem", [
    # with the spare row (partial_fc.py): (4,194,302 + 1) x 512 = 2^31 - 512 elements
    (4_194_302, 1, 1.0, None),
    (4_194_303, 1, 1.0, "(4,194,303 + 1 spare) x 512 = 2,147,483,648 elements, more than "
                        "the 2,147,483,647"),
    (9_000_000, 2, 1.0, "lower sample_rate or use at least 3 processes"),
    (9_000_000, 1, 0.1, None),  # a shard past the limit is stored in blocks
    (9_000_000, 3, 1.0, None),
])
def test_sampled_centers_larger_than_one_mxnet_array_are_named_before_allocation(
        classes, world, rate, problem):
    found = tensor_size_problem(classes, world, 512, rate)
    assert found == problem if problem is None else problem in found
    if problem:
        with pytest.raises(ValueError, match="USE_INT64_TENSOR_SIZE"):
            PartialFC(classes, 512, world_size=world, sample_rate=rate)


def test_logits_larger_than_one_mxnet_array_are_named():
    # 8 processes, 1M centers each, all scored against a global batch of 4096
    found = tensor_size_problem(8_000_000, 8, 512, sample_rate=1.0, global_batch=4096)
    assert "global batch of 4096 against the 1000000 centers one process samples" in found
    assert tensor_size_problem(8_000_000, 8, 512, sample_rate=0.1, global_batch=4096) is None
    # the boundary, with the spare column: 1024 x (2,097,150 + 1) = 2^31 - 1024 elements
    assert tensor_size_problem(2_097_150, 1, 8, global_batch=1024) is None
    found = tensor_size_problem(2_097_151, 1, 8, global_batch=1024)
    assert "(+1 spare) have 2,147,483,648 elements" in found


def test_with_accumulation_the_sample_holds_every_micro_batchs_positives():
    """k micro-batches of 4096 rows: one sample for the positives of all k x 4096 (at
    most 4096 k classes), each micro-batch's 4096 rows of logits against it; from
    k = 128 (524,288 + 1 columns) they pass 2^31 elements."""
    assert tensor_size_problem(8_000_000, 8, 512, sample_rate=0.1, global_batch=4096,
                               micro_batches=127) is None
    found = tensor_size_problem(8_000_000, 8, 512, sample_rate=0.1, global_batch=4096,
                                micro_batches=128)
    assert "global batch of 4096 against the 524288 centers one process samples" in found


def test_an_int64_build_has_no_size_limit(monkeypatch):
    monkeypatch.setattr(mx.runtime.Features, "is_enabled", lambda self, name: True)
    assert tensor_size_problem(9_000_000, 1, 512) is None  # all 9M sampled


# ----- a shard stored in several blocks (past one MXNet array) -----

def old_initial_centers(seed: int, start: int, count: int, width: int) -> np.ndarray:
    """The initial centers as the code drew them before the shard had blocks: rows
    start..start+count of N(0, 0.01), one generator per 4096 global rows."""
    rows = []
    for block in range(start // 4096, (start + count - 1) // 4096 + 1):
        values = np.random.default_rng([seed, block]).standard_normal((4096, width),
                                                                      np.float32)
        values *= 0.01
        rows.append(values)
    offset = start - start // 4096 * 4096
    return np.concatenate(rows)[offset:offset + count]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("block_rows", [None, 4096, 1000, 7])
def test_initial_centers_are_todays_whatever_the_blocks_and_world_size(dtype, block_rows):
    classes, width = 10_000, 8
    expected = old_initial_centers(3, 0, classes, width).astype(dtype)
    for world in (1, 3):
        shards = [ClassCenters(shard_of(classes, r, world), width, SGD(), ctx=mx.cpu(),
                               dtype=dtype, seed=3, rank=r, block_rows=block_rows)
                  for r in range(world)]
        weight = np.concatenate([s.state_dict()["weight"] for s in shards])
        assert weight.tobytes() == expected.tobytes(), (world, block_rows)
    if block_rows == 7:
        assert len(shards[0].blocks) == 477  # 3334 rows in blocks of 7


def blocked_and_whole(optimizer, dtype, lazy):
    """The same shard twice: in blocks of 7 rows, and in one block."""
    make = lambda block_rows: ClassCenters(  # noqa: E731
        shard_of(150, 1, 3), 8, optimizer, ctx=mx.cpu(), dtype=dtype, seed=3, rank=1,
        lazy=lazy, block_rows=block_rows)
    return make(7), make(None)


@pytest.mark.parametrize("optimizer", [SGD(), AdamW()], ids=["sgd", "adamw"])
@pytest.mark.parametrize("dtype, lazy", [("float32", True), ("float16", True),
                                         ("float32", False)])
def test_blocks_gather_and_update_as_one_array_does(optimizer, dtype, lazy):
    """Rows from several blocks (a block's first and last rows, blocks untouched in
    between) are gathered, updated and stored back bit for bit as in one array, over
    steps whose samples differ, lazily and densely."""
    blocked, whole = blocked_and_whole(optimizer, dtype, lazy)
    assert len(blocked.blocks) == 8 and len(whole.blocks) == 1
    rng = np.random.default_rng(5)
    for index in (np.array([0, 6, 7, 13, 30, 49]), np.array([3]), np.arange(0, 50, 2)):
        grad = mx.nd.array(rng.normal(size=(len(index), 8)))
        w_blocked, w_whole = blocked.sampled_weights(index), whole.sampled_weights(index)
        assert w_blocked.asnumpy().tobytes() == w_whole.asnumpy().tobytes()
        blocked.update(index, w_blocked, grad, 0.1)
        whole.update(index, w_whole, grad, 0.1)
        for name, value in whole.state_dict().items():
            if name != "sampler":
                assert blocked.state_dict()[name].tobytes() == value.tobytes(), name


def test_blocked_state_round_trips_and_refuses_whole_shard_views():
    blocked, _ = blocked_and_whole(AdamW(), "float16", True)
    rng = np.random.default_rng(0)
    state = {"weight": rng.normal(size=(50, 8)), "mean": rng.normal(size=(50, 8)),
             "var": rng.random((50, 8)), "steps": rng.integers(0, 9, (50, 1))}
    blocked.load_state_dict(state)
    again = blocked.state_dict()
    assert again["weight"].tobytes() == state["weight"].astype(np.float16).tobytes()
    assert again["var"].tobytes() == state["var"].astype(np.float32).tobytes()
    with pytest.raises(ValueError, match="stored in 8 blocks of 7 rows"):
        _ = blocked.weight
    with pytest.raises(ValueError, match="more than one MXNet array holds"):
        blocked.sampled_weights(None)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_gpu_copy_path_of_the_initial_centers_writes_the_same_rows(dtype, monkeypatch):
    """A GPU's blocks are filled from host chunks copied in order (no host view of
    device memory); the rows are the in-place path's, across blocks and chunks."""
    from partial_fc_mx.pfc import centers as module

    shard, width = shard_of(30_000, 1, 2), 8  # rows 15000..29999: partial random blocks
    sizes = [4000, 9000, 2000]
    monkeypatch.setattr(module, "HOST_CHUNK_ELEMENTS", 4096 * width)  # a chunk per block
    fill_initial_centers = module.fill_initial_centers
    filled = {}
    for in_place in (True, False):
        blocks = [mx.nd.empty((n, width), dtype=dtype) for n in sizes]
        fill_initial_centers(blocks, 3, shard, in_place=in_place)
        filled[in_place] = np.concatenate([b.asnumpy() for b in blocks])
    expected = old_initial_centers(3, shard.start, shard.count, width).astype(dtype)
    assert filled[True].tobytes() == filled[False].tobytes() == expected.tobytes()
