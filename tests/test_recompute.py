"""Activation recomputation (run/recompute.py): the same embeddings, gradients and
BatchNorm statistics as the whole recorded graph; the random operators' draws
repeated in the recomputation; less activation memory in the estimate; and a real
two-process training whose losses equal those of the same run without it."""

from __future__ import annotations

import mxnet as mx
import numpy as np
import pytest
from conftest import config_file, logged, mpirun, train_args

from partial_fc_mx.backbones import get_model
from partial_fc_mx.backbones.segments import DATA, EMBEDDINGS, Segment, recompute_problem
from partial_fc_mx.backbones.vit import VisionTransformer, ViTSize
from partial_fc_mx.config import Config
from partial_fc_mx.data.transforms import FACE_SIZE
from partial_fc_mx.run.precision import mixed_precision_graph, training_model
from partial_fc_mx.run.recompute import (
    SEED_RANGE,
    Piece,
    Recomputed,
    RecomputeError,
    outputs_of,
)
from partial_fc_mx.sizing.memory import backbone_memory

CTX = mx.cpu()
BATCH = 4
EMBEDDING = 32


def built(net: mx.gluon.HybridBlock) -> mx.gluon.HybridBlock:
    """`net` initialised from seed 0, as the trainer builds it (precision.build_backbone)."""
    mx.random.seed(0)
    net.initialize(mx.init.Xavier(magnitude=2), ctx=CTX)
    net.infer_shape(mx.nd.zeros((1, 3, FACE_SIZE, FACE_SIZE), ctx=CTX))
    for parameter in net.collect_params().values():
        parameter._finish_deferred_init()
    net.hybridize(static_alloc=True, static_shape=True)
    return net


def step(make_net, recompute: bool, seed: int = 5) -> tuple:
    """One forward and backward of a fresh `make_net()` on fixed images: the embeddings,
    every gradient and every running statistic, in the parameters' order."""
    net = built(make_net())
    model = training_model(net, CTX, "float32")  # with the CPU's kernels, as it trains
    if recompute:
        model = Recomputed(model, net, CTX, "float32")
    rng = np.random.default_rng(1)
    images = mx.nd.array(rng.uniform(-1, 1, (BATCH, 3, FACE_SIZE, FACE_SIZE)), ctx=CTX)
    grad = mx.nd.array(rng.normal(size=(BATCH, EMBEDDING)), ctx=CTX)
    mx.random.seed(seed)
    if recompute:
        embeddings, backward = model.forward(images)
    else:
        with mx.autograd.record():
            embeddings = model(images)
        backward = embeddings.backward
    backward(grad)
    params = list(net.collect_params().values())
    return (embeddings.asnumpy(),
            [p.grad(CTX).asnumpy() for p in params if p.grad_req != "null"],
            [p.data(CTX).asnumpy() for p in params if p.grad_req == "null"])


def assert_same(whole: tuple, recomputed: tuple) -> None:
    for name, a, b in zip(("embeddings", "gradients", "statistics"), whole, recomputed):
        for i, (x, y) in enumerate(zip(*((a, b) if isinstance(a, list) else ([a], [b])))):
            np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-6 * np.abs(x).max(),
                                       err_msg=f"{name} {i}")


DETERMINISTIC = {
    "tiny": lambda: get_model("tiny", EMBEDDING),  # an IResNet: BatchNorm in every unit
    "mobilefacenet": lambda: get_model("mobilefacenet", EMBEDDING),
    "vit": lambda: VisionTransformer(ViTSize(64, 3, 0.0, False), EMBEDDING),
}


@pytest.mark.parametrize("network", DETERMINISTIC)
def test_recomputation_gives_the_whole_graphs_gradients_and_statistics(network):
    """Networks without random operators: every gradient, and the BatchNorms' running
    statistics moved once, as by the recorded whole graph."""
    assert_same(step(DETERMINISTIC[network], False), step(DETERMINISTIC[network], True))


def moving(block, statistics: list, seen: list):
    """`block`, noting the `statistics` it finds, then moving them (adding 1): a
    forward that moves them, as cuDNN's does."""
    def call(*inputs):
        seen.append([p.data(CTX).asnumpy() for p in statistics])
        outputs = block(*inputs)
        with mx.autograd.pause():
            for parameter in statistics:
                parameter.data(CTX)[:] += 1
        return outputs
    return call


def test_a_recomputation_finds_the_statistics_its_first_forward_found():
    """A BatchNorm that moves its running statistics in the forward (cuDNN's; the CPU's
    moves them in the backward) would move them twice; every segment's recomputation
    finds them as its first forward did, however that one moved them."""
    net = built(DETERMINISTIC["tiny"]())
    model = Recomputed(training_model(net, CTX, "float32"), net, CTX, "float32")
    seen = [[] for _ in model.pieces]
    model.pieces = [Piece(piece.segment, moving(piece.block, piece.statistics, calls),
                          piece.statistics) for piece, calls in zip(model.pieces, seen)]
    rng = np.random.default_rng(1)
    images = mx.nd.array(rng.uniform(-1, 1, (BATCH, 3, FACE_SIZE, FACE_SIZE)), ctx=CTX)
    grad = mx.nd.array(rng.normal(size=(BATCH, EMBEDDING)), ctx=CTX)
    embeddings, backward = model.forward(images)
    backward(grad)
    assert sum(len(first) for first, _ in seen) > 0
    for first, recomputed in seen:
        for before, again in zip(first, recomputed):
            np.testing.assert_array_equal(again, before)


RANDOM = {
    "vit": lambda: VisionTransformer(ViTSize(64, 3, 0.3, True), EMBEDDING),  # drop path, masks
    "tiny-dropout": lambda: get_model("tiny", EMBEDDING, dropout=0.5),  # the head's
}


def recorded_segments(make_net, seed: int = 5) -> tuple:
    """The reference for a network with random operators: the same segments recorded in
    one graph, each drawing from the seed Recomputed gives it, one backward."""
    net = built(make_net())
    model = Recomputed(training_model(net, CTX, "float32"), net, CTX, "float32")
    rng = np.random.default_rng(1)
    images = mx.nd.array(rng.uniform(-1, 1, (BATCH, 3, FACE_SIZE, FACE_SIZE)), ctx=CTX)
    grad = mx.nd.array(rng.normal(size=(BATCH, EMBEDDING)), ctx=CTX)
    mx.random.seed(seed)
    base = int(mx.nd.random.randint(0, SEED_RANGE, shape=(1,)).asscalar())
    values = {DATA: images}
    with mx.autograd.record():
        for index, piece in enumerate(model.pieces):
            mx.random.seed(base + index)
            outputs = outputs_of(piece.block(*(values[name] for name in piece.segment.inputs)))
            values.update(zip(piece.segment.outputs, outputs))
    values[EMBEDDINGS].backward(grad)
    params = list(net.collect_params().values())
    return (values[EMBEDDINGS].asnumpy(),
            [p.grad(CTX).asnumpy() for p in params if p.grad_req != "null"],
            [p.data(CTX).asnumpy() for p in params if p.grad_req == "null"])


@pytest.mark.parametrize("network", RANDOM)
def test_the_recomputed_forward_draws_what_the_first_one_drew(network):
    """A ViT with patch masks and drop path, an IResNet with dropout: the gradients of
    a forward whose random draws are the ones its recomputation repeats; two steps
    from one seed alike, and other draws from another seed."""
    make_net = RANDOM[network]
    recomputed = step(make_net, True)
    assert_same(recorded_segments(make_net), recomputed)
    assert_same(recomputed, step(make_net, True))
    assert not np.allclose(step(make_net, True, seed=6)[0], recomputed[0])


@pytest.mark.parametrize("network", ["r18", "mbf", "vit_t", "vit_t_dp005_mask0"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_segments_keep_float32_parameters_and_boundaries(network, dtype):
    """A 16-bit run's segments, each converted by AMP as the whole graph is: every
    parameter stays a float32 input (mixed_precision_graph refuses otherwise), and
    every value passed between segments is float32 (what the estimate counts)."""
    for segment in get_model(network).segments():
        graph = mixed_precision_graph(segment.graph(), dtype, segment.inputs)
        _, outputs, _ = graph.infer_type(**dict.fromkeys(segment.inputs, "float32"))
        assert [np.dtype(kind) for kind in outputs] == [np.float32] * len(segment.outputs)


@pytest.mark.parametrize("network", ["r50", "vit_t"])
def test_the_memory_estimate_counts_the_boundaries_and_one_segment(network):
    """At a config's batch the activations are a fraction of the whole graph's; the rest
    of the estimate (weights, gradients, optimizer states) is unchanged."""
    config = Config(rec="random", num_classes=1000, num_image=1000, network=network,
                    batch_size=128)
    plain = backbone_memory(config, "float32")
    config.recompute_activations = True
    recomputed = backbone_memory(config, "float32")
    assert recomputed.activations < 0.4 * plain.activations
    assert recomputed.total - recomputed.activations == plain.total - plain.activations


class Unsegmented(mx.gluon.HybridBlock):
    def hybrid_forward(self, F, x):
        return x


def with_segments(net: mx.gluon.HybridBlock, change) -> mx.gluon.HybridBlock:
    """`net` whose segments() are change(its own)."""
    own = net.segments()
    net.segments = lambda: change(own)
    return net


@pytest.mark.parametrize("change, problem", [
    (lambda own: own[:2] + own[3:], "used by no segment"),  # a unit left out
    (lambda own: own[:3] + own[2:], "read by several segments"),  # a unit twice
])
def test_segments_that_would_train_another_network_are_refused(change, problem):
    assert recompute_problem(get_model("tiny")) is None
    with pytest.raises(RecomputeError, match="Unsegmented does not split into segments"):
        Recomputed(Unsegmented(), Unsegmented(), CTX, "float32")
    net = with_segments(get_model("tiny"), change)
    with pytest.raises(RecomputeError, match=f"segments are wrong: .*{problem}"):
        Recomputed(net, net, CTX, "float32")


def passed_through(own: list) -> list:
    """The segments with a last one that returns its input unchanged."""
    last = own[-1]
    return [*own[:-1], Segment(last.inputs, ("head",), last.function),
            Segment(("head",), (EMBEDDINGS,), lambda x: x)]


def test_a_segment_that_returns_its_input_passes_the_gradient_on():
    whole = step(DETERMINISTIC["tiny"], False)
    assert_same(whole, step(lambda: with_segments(get_model("tiny", EMBEDDING),
                                                  passed_through), True))


def test_two_processes_train_the_same_losses_with_recomputation(tmp_path, synthetic):
    """The trainer under mpirun, 2 ranks, the tiny IResNet (no random operator), SGD
    with momentum, 2 micro-batches of 12 per step: 4 steps with and without
    recompute_activations, the same losses to rounding (the BatchNorms' statistics
    enter every later step's loss)."""
    losses = {}
    for recompute in (False, True):
        config = config_file(tmp_path, synthetic, f"config{recompute}.py", max_steps=4,
                             batch_size=12, gradient_accumulation=2,
                             recompute_activations=recompute)
        work = tmp_path / str(recompute)
        result = mpirun(2, train_args(config, work), timeout=600)
        assert result.returncode == 0, result.stdout[-3000:]
        losses[recompute] = logged(work)["losses"]
        assert ("its activations recomputed" in logged(work)["text"]) == recompute
    assert sorted(losses[True]) == [1, 2, 3, 4]
    np.testing.assert_allclose([losses[True][s] for s in range(1, 5)],
                               [losses[False][s] for s in range(1, 5)], rtol=1e-5)
