"""The backbones: arcface_torch's layers, their published sizes, checkpoints of the
earlier layout, and dropout that a resume reproduces."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mxnet as mx
import numpy as np
import pytest
from conftest import config_file, logged, run, train_args

from partial_fc_mx.backbones import get_model, graph_of
from partial_fc_mx.backbones.dropout import Dropout
from partial_fc_mx.backbones.layout import load_parameters
from partial_fc_mx.backbones.summary import count_flops
from partial_fc_mx.backbones.vit import VIT_SIZES

ANCHOR_SHAPES = json.loads((Path(__file__).parent / "anchor_shapes.json").read_text())
"""arcface_torch's get_model(name) parameters, [[name, shape], ...] in registration
order, recorded by `python -m partial_fc_mx.tools.anchor_shapes` (docs/tests.md)."""


def parameter_shapes(net) -> list[tuple[str, list]]:
    """(name, shape) of every parameter in registration order, from shape inference at
    one 112 x 112 image; BatchNorm's running statistics left out (torch's buffers)."""
    graph = graph_of(net)
    shapes = dict(zip(graph.list_arguments(), graph.infer_shape(data=(1, 3, 112, 112))[0]))
    return [(p.name, list(shapes[p.name])) for p in net.collect_params().values()
            if not p.name.endswith(("running_mean", "running_var"))]


@pytest.mark.parametrize("name", sorted(ANCHOR_SHAPES))
def test_each_layer_has_the_shape_of_arcface_torchs(name):
    ours, anchor = parameter_shapes(get_model(name, 512)), ANCHOR_SHAPES[name]
    assert len(ours) == len(anchor), (len(ours), len(anchor))
    for (our_name, our_shape), (their_name, their_shape) in zip(ours, anchor):
        assert our_shape == their_shape, f"{our_name} {our_shape} != {their_name} {their_shape}"


def test_the_recording_covers_every_network_both_toolkits_name():
    assert sorted(ANCHOR_SHAPES) == sorted(["mbf", "r100", "r18", "r200", "r34", "r50",
                                            *VIT_SIZES])
    assert all(len(layers) > 90 for layers in ANCHOR_SHAPES.values())


@pytest.mark.parametrize("name, params_m, gflops", [
    ("r50", 43.6, 6.3), ("r100", 65.2, 12.1), ("mobilefacenet", 1.2, 0.22),
    ("mbf", 2.1, 0.44)])
def test_backbones_have_the_published_size(name, params_m, gflops):
    net = get_model(name)
    net.initialize()
    params, macs = count_flops(net)
    assert abs(params / 1e6 - params_m) < 0.1 and abs(macs / 1e9 - gflops) < 0.05
    assert net(mx.nd.zeros((2, 3, 112, 112))).shape == (2, 512)


@pytest.mark.parametrize("name", ["r18", "mobilefacenet"])
def test_dropout_never_takes_cudnns_separately_seeded_generator(name):
    """cuDNN's dropout state is seeded once, so the per-step reseed that lets a resumed
    run repeat its masks would not reach it on a GPU: every Dropout node of the graph
    asks for MXNet's own generator (cudnn_off), the one mx.random.seed resets."""
    graph = json.loads(get_model(name, 64, dropout=0.4)(mx.sym.var("data")).tojson())
    dropouts = [node for node in graph["nodes"] if node["op"] == "Dropout"]
    assert len(dropouts) == 1
    assert dropouts[0]["attrs"]["cudnn_off"] == "True" and dropouts[0]["attrs"]["p"] == "0.4"


def test_dropout_masks_repeat_after_reseeding():
    block = Dropout(0.5)
    x = mx.nd.ones((8, 64))
    with mx.autograd.record():
        mx.random.seed(3)
        first = block(x).asnumpy()
        second = block(x).asnumpy()
        mx.random.seed(3)
        again = block(x).asnumpy()
    assert np.array_equal(first, again) and not np.array_equal(first, second)
    assert set(np.unique(first)) == {0.0, 2.0}
    assert np.array_equal(Dropout(0.0)(x).asnumpy(), x.asnumpy())


def old_layout(monkeypatch, name: str):
    """`name` as built before per-channel slopes: one PReLU slope per layer."""
    from mxnet.gluon import nn

    from partial_fc_mx.backbones import iresnet, mobilefacenet

    with monkeypatch.context() as patch:
        patch.setattr(iresnet, "prelu", lambda channels: nn.PReLU())
        patch.setattr(mobilefacenet, "prelu", lambda channels: nn.PReLU())
        return get_model(name, 64)


@pytest.mark.parametrize("name", ["tiny", "mobilefacenet"])
def test_a_checkpoint_of_one_slope_per_layer_loads_as_the_same_function(
        name, monkeypatch, tmp_path):
    old = old_layout(monkeypatch, name)
    old.initialize(mx.init.Normal(0.1))
    old.hybridize()
    images = mx.nd.random.uniform(shape=(2, 3, 112, 112))
    old(images)
    for param in old.collect_params().values():
        if param.name.endswith("alpha"):
            assert param.shape == (1,)
            param.set_data(mx.nd.random.uniform(0.1, 0.4, shape=(1,)))
    old.save_parameters(str(tmp_path / "old.params"))
    new = get_model(name, 64)
    new.initialize()
    new.hybridize()
    load_parameters(new, tmp_path / "old.params", mx.cpu())
    slopes = [p for p in new.collect_params().values() if p.name.endswith("alpha")]
    assert slopes and all(p.shape[0] > 1 for p in slopes)
    with mx.autograd.predict_mode():
        np.testing.assert_allclose(new(images).asnumpy(), old(images).asnumpy(), rtol=1e-5,
                                   atol=1e-6)


def test_other_shape_differences_stay_errors(monkeypatch, tmp_path):
    """mobilefacenet's weights are not mbf's: the load names the parameter."""
    small = get_model("mobilefacenet", 64)
    small.initialize()
    small(mx.nd.zeros((1, 3, 112, 112)))
    small.save_parameters(str(tmp_path / "small.params"))
    wide = get_model("mbf", 64)
    wide.initialize()
    with pytest.raises(AssertionError, match="shape incompatible"):
        load_parameters(wide, tmp_path / "small.params", mx.cpu())


def test_a_run_of_the_earlier_layout_resumes_and_loads(tmp_path, synthetic):
    """A checkpoint the trainer wrote with one slope per layer (weights and SGD's
    momentum): --resume-from continues it with per-channel slopes, --load-from starts
    from its weights."""
    config = config_file(tmp_path, synthetic, max_steps=2, save_every=2)
    work = tmp_path / "work"
    old = run([sys.executable, "tests/old_layout_worker.py", "train", str(config),
               "--work-dir", str(work)], timeout=300)
    assert old.returncode == 0, old.stdout[-3000:]
    more = config_file(tmp_path, synthetic, name="more.py", max_steps=3)
    resumed = run(train_args(more, work, "--resume-from", str(work)), timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "resuming from" in resumed.stdout
    assert [step["step"] for step in logged(work)["steps"]] == [1, 2, 3]
    loaded = run(train_args(more, tmp_path / "loaded", "--load-from",
                            str(work / "checkpoints" / "step_000002")), timeout=300)
    assert loaded.returncode == 0, loaded.stdout[-3000:]


MOBILEFACENET_AT_512 = """
import mxnet as mx, numpy as np
from partial_fc_mx.backbones import get_model
net = get_model("{name}", 512)
net.initialize(mx.init.Xavier())
net.hybridize(static_alloc=True, static_shape=True)
images = mx.nd.array(np.random.default_rng(0).standard_normal((4, 3, 112, 112)),
                     dtype="float32")
with mx.autograd.record():
    loss = net(images).sum()
loss.backward()
print(net(images).asnumpy().shape)
"""


@pytest.mark.parametrize("name", ["mbf", "mobilefacenet"])
def test_mobilefacenet_with_the_default_embedding_trains_and_embeds_on_this_cpu(name):
    """Its 512-d embedding has as many channels as the GDC before it, which crashed
    oneDNN's BatchNorm on AVX-512 CPUs (backbones/mobilefacenet.py). In a process of its
    own, so that a crash fails this test only; without an ISA cap: the host's own."""
    done = run([sys.executable, "-c", MOBILEFACENET_AT_512.format(name=name)])
    assert done.returncode == 0 and "(4, 512)" in done.stdout, done.stdout


def test_mobilefacenets_embedding_is_batch_normalized_per_column():
    """The N x E x 1 x 1 view the embedding's BatchNorm reads gives the numbers of a
    BatchNorm over the N x E matrix: the batch's statistics in training, the running
    ones in inference."""
    net = get_model("mobilefacenet", 64)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    images = mx.nd.random.uniform(shape=(6, 3, 112, 112))
    net.infer_shape(images)
    for param in net.collect_params().values():
        param._finish_deferred_init()
    flatten, dropout, dense, batch_norm = net.head
    batch_norm.gamma.set_data(mx.nd.random.uniform(0.5, 1.5, shape=(64,)))
    batch_norm.beta.set_data(mx.nd.random.uniform(-1, 1, shape=(64,)))
    gamma, beta = batch_norm.gamma.data().asnumpy(), batch_norm.beta.data().asnumpy()
    eps = batch_norm._kwargs["eps"]

    def embedding() -> np.ndarray:
        return dense(dropout(flatten(net.features(images)))).asnumpy()

    with mx.autograd.record():
        trained, before = net(images).asnumpy(), embedding()
    by_batch = (before - before.mean(0)) / np.sqrt(before.var(0) + eps)
    np.testing.assert_allclose(trained, gamma * by_batch + beta, rtol=1e-4, atol=1e-4)
    inferred, after = net(images).asnumpy(), embedding()
    mean, var = batch_norm.running_mean.data().asnumpy(), batch_norm.running_var.data().asnumpy()
    by_running = (after - mean) / np.sqrt(var + eps)
    np.testing.assert_allclose(inferred, gamma * by_running + beta, rtol=1e-4, atol=1e-4)
