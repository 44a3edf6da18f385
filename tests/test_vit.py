"""The Vision Transformers: arcface_torch's initialisation, patch masking and drop path
in training only (drawn from MXNet's seeded generator), and an inference graph
without them. (Their parameter shapes: test_backbones.py, against the recording.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import mxnet as mx
import numpy as np
import pytest

from partial_fc_mx.backbones import get_model, graph_of
from partial_fc_mx.backbones.modes import ByMode
from partial_fc_mx.backbones.summary import count_flops
from partial_fc_mx.backbones.vit import (
    PATCH,
    TOKENS,
    VIT_SIZES,
    VisionTransformer,
    ViTSize,
    drop_path,
)
from partial_fc_mx.config import Config, ConfigError
from partial_fc_mx.run.precision import build_backbone, mixed_precision_graph, training_model

ANCHOR_INIT = json.loads((Path(__file__).parent / "anchor_init.json").read_text())
"""arcface_torch's vit_t as it initialises it: [[name, mean, std], ...], recorded by
`python -m partial_fc_mx.tools.anchor_shapes --init vit_t` (docs/tests.md)."""

ANCHOR_HIDDEN = 144 - int(144 * (1 - 0.1))
"""What arcface_torch's random_masking hides (its default ratio, which its forward
always passes): 15 of the 144 tokens."""

RANDOM_OPS = {"Dropout", "_random_uniform_like", "argsort"}


def test_vit_t_starts_from_the_anchors_initialisation():
    """Parameter by parameter, in registration order, as the trainer initialises it:
    the same mean and spread (constants equal), to the sampling error of each."""
    net, _ = build_backbone(Config(network="vit_t"), mx.cpu())
    ours = [p for p in net.collect_params().values()
            if not p.name.endswith(("running_mean", "running_var"))]
    anchor = ANCHOR_INIT["vit_t"]
    assert len(ours) == len(anchor)
    for param, (name, mean, std) in zip(ours, anchor):
        values = param.data().asnumpy()
        if std == 0:
            assert values.std() == 0 and values.mean() == pytest.approx(mean), name
            continue
        spread = 5 / math.sqrt(2 * values.size)
        assert abs(values.std() / std - 1) < max(spread, 0.02), (name, values.std(), std)
        assert abs(values.mean() - mean) < 5 * std / math.sqrt(values.size) * 1.5, name


def tiny_vit(masks: bool = True, drop: float = 0.0) -> VisionTransformer:
    net = VisionTransformer(ViTSize(16, 2, drop, masks), embedding_size=8)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    return net


def patch_gradients(net, x: mx.nd.NDArray, train: bool, seed: int = 5) -> np.ndarray:
    """N x 144: the largest |d embedding / d pixel| over each 9 x 9 patch."""
    x = x.copy()
    x.attach_grad()
    mx.random.seed(seed)
    with mx.autograd.record(train_mode=train):
        y = net(x)
        loss = (y * mx.nd.array(np.linspace(-1, 1, y.size).reshape(y.shape))).sum()
    loss.backward()
    side = int(math.sqrt(TOKENS)) * PATCH  # 108: the pixels the patches cover
    grad = np.abs(x.grad.asnumpy()[:, :, :side, :side])
    n = grad.shape[0]
    per_patch = grad.reshape(n, 3, 12, PATCH, 12, PATCH).max(axis=(1, 3, 5))
    return per_patch.reshape(n, TOKENS)


def test_training_hides_15_patches_per_sample_and_inference_none():
    """A masked patch reaches the embedding through nothing (it never enters the
    blocks, and the mask token takes its place after them): in training exactly 144 - 129 patches of
    each sample get no gradient, other ones in each sample, the same ones again after
    reseeding; in inference every patch counts."""
    net = tiny_vit()
    x = mx.nd.random.uniform(-1, 1, (4, 3, 112, 112))
    trained = patch_gradients(net, x, train=True)
    hidden = trained == 0
    assert (hidden.sum(axis=1) == ANCHOR_HIDDEN).all(), hidden.sum(axis=1)
    assert len({tuple(np.flatnonzero(row)) for row in hidden}) == 4
    assert np.array_equal(patch_gradients(net, x, train=True) == 0, hidden)
    assert not np.array_equal(patch_gradients(net, x, train=True, seed=6) == 0, hidden)
    assert (patch_gradients(net, x, train=False) > 0).all()


def test_a_network_without_masking_lets_every_patch_count_in_training():
    net = tiny_vit(masks=False)
    x = mx.nd.random.uniform(-1, 1, (2, 3, 112, 112))
    assert (patch_gradients(net, x, train=True) > 0).all()


def test_drop_path_drops_whole_samples_in_training_only():
    branch = mx.nd.ones((64, 5, 3))
    with mx.autograd.record(train_mode=True):
        mx.random.seed(1)
        trained = drop_path(mx.nd, branch, 0.25).asnumpy()
    per_sample = trained.reshape(64, -1)
    assert (per_sample == per_sample[:, :1]).all()  # one decision per sample
    assert set(np.unique(per_sample)) == {0.0, np.float32(1 / 0.75)}
    assert 4 <= (per_sample[:, 0] == 0).sum() <= 28  # about a quarter of 64
    with mx.autograd.record(train_mode=False):
        assert np.array_equal(drop_path(mx.nd, branch, 0.25).asnumpy(), branch.asnumpy())


def test_training_draws_repeat_after_reseeding_and_differ_across_steps():
    net = tiny_vit(drop=0.5)
    x = mx.nd.random.uniform(-1, 1, (4, 3, 112, 112))

    def forward(seed=None):
        if seed is not None:
            mx.random.seed(seed)
        with mx.autograd.record(train_mode=True):
            return net(x).asnumpy()

    first, second = forward(3), forward()
    assert np.array_equal(forward(3), first) and not np.allclose(first, second)


@pytest.mark.parametrize("name", ["vit_t", "vit_b_dp005_mask_005"])
def test_the_inference_graph_has_no_training_only_operator(name):
    """backbone-symbol.json and ONNX are written from it; the training graph has them,
    and the mask token serves training only."""
    net = get_model(name)
    inference = json.loads(graph_of(net, training=False).tojson())["nodes"]
    training = json.loads(graph_of(net).tojson())["nodes"]
    assert not RANDOM_OPS & {node["op"] for node in inference}
    assert RANDOM_OPS <= {node["op"] for node in training}
    assert not any(n["name"].endswith("mask_token") for n in inference)


@pytest.mark.parametrize("masks", [True, False])
def test_inference_gives_the_same_embeddings_as_the_training_graph_in_inference_mode(masks):
    """What evaluation during training computes: the network itself (a GPU's float32
    run trains it) and the CPU's training model (its kernels; with a masking network,
    a ByMode beside the inference graph) give the inference graph's embeddings outside
    training, though a masking network's training graph computes 129 tokens."""
    net = tiny_vit(masks=masks, drop=0.3)
    model = training_model(net, mx.cpu(), "float32")
    assert isinstance(model, ByMode) == masks
    x = mx.nd.random.uniform(-1, 1, (3, 3, 112, 112))
    block = mx.gluon.SymbolBlock(graph_of(net, training=False),
                                 [mx.sym.var("data", dtype="float32")],
                                 params=net.collect_params())
    expected = block(x).asnumpy()
    for computes in (net, model):
        assert np.allclose(expected, computes(x).asnumpy(), rtol=1e-5, atol=1e-5)
    net.hybridize(active=False)  # imperative, as import-backbone's calibration runs it
    assert np.allclose(expected, net(x).asnumpy(), rtol=1e-5, atol=1e-5)


def test_a_vit_with_dropout_is_refused_by_name():
    with pytest.raises(ConfigError, match="vit_s has no dropout"):
        Config(network="vit_s", dropout=0.1).validate()


@pytest.mark.parametrize("name, published", [
    ("vit_t", "1.5"), ("vit_s", "5.7"), ("vit_b", "11"), ("vit_l_dp005_mask_005", "25")])
def test_vits_have_the_gflops_arcface_torch_names_them_by(name, published):
    """Its README's ViT-T-1.5G ... ViT-L-25G: multiply-adds of one image, the
    attention's batch_dot included, to the digits it gives."""
    net = get_model(name)
    net.initialize()
    _, macs = count_flops(net)
    decimals = len(published.partition(".")[2])
    assert f"{macs / 1e9:.{decimals}f}" == published


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", ["vit_t", "vit_t_dp005_mask0"])
def test_the_16_bit_graph_keeps_what_arcface_torch_keeps_in_float32(name, dtype):
    """What a GPU (float16) and a bfloat16 CPU train, built on any host: the blocks'
    dense layers in 16 bits; the attention's batch_dot, its softmax and LayerNorm in
    float32, as arcface_torch leaves autocast for them, and the patch convolution and
    the feature head (its two dense layers and their BatchNorms) in float32, as
    arcface_torch calls its ViT outside autocast (backbones/float32.py). The masking
    gathers' indices (up to 144 N) stay float32: bfloat16 would round them."""
    graph = mixed_precision_graph(graph_of(get_model(name)), dtype)
    internals = graph.get_internals()
    _, types, _ = internals.infer_type(data="float32")
    type_of = dict(zip(internals.list_outputs(), types))
    computed: dict = {}
    nodes = json.loads(graph.tojson())["nodes"]
    for node in nodes:
        if node["op"] in ("Convolution", "FullyConnected", "batch_dot", "softmax", "LayerNorm",
                          "BatchNorm"):
            computed.setdefault(node["op"], []).append(
                np.dtype(type_of[f"{node['name']}_output"]).itemsize)
        if node["op"] == "take":  # the index as computed, behind the casts AMP puts
            index = nodes[node["inputs"][1][0]]  # before an operator it keeps in float32
            while index["op"] == "amp_cast":
                index = nodes[index["inputs"][0][0]]
            computed.setdefault("take", []).append(
                np.dtype(type_of[f"{index['name']}_output"]).itemsize)
    assert computed.get("take", []) == ([4, 4] if VIT_SIZES[name].masks else [])
    blocks, head = computed["FullyConnected"][:-2], computed["FullyConnected"][-2:]
    assert len(blocks) == 4 * VIT_SIZES[name].depth and set(blocks) == {2}
    assert head == [4, 4] and set(computed["Convolution"]) == set(computed["BatchNorm"]) == {4}
    assert set(computed["batch_dot"]) == set(computed["softmax"]) == \
        set(computed["LayerNorm"]) == {4}


def numpy_vit(net: VisionTransformer, x: np.ndarray, hidden: np.ndarray) -> np.ndarray:
    """arcface_torch's forward in training, written out in NumPy: only the kept tokens
    (`hidden` False) enter the blocks, the mask token fills the hidden ones after the
    final LayerNorm, the head's BatchNorms use the batch's statistics (drop path off)."""
    value = {p.name: p.data().asnumpy() for p in net.collect_params().values()}

    def get(block, name):
        return value[block.prefix + name]

    def layer_norm(t, block):
        mean, var = t.mean(-1, keepdims=True), t.var(-1, keepdims=True)
        return (t - mean) / np.sqrt(var + 1e-5) * get(block, "gamma") + get(block, "beta")

    def dense(t, block):
        out = t @ get(block, "weight").T
        return out + get(block, "bias") if block.bias is not None else out

    def batch_norm(z, block):
        return ((z - z.mean(0)) / np.sqrt(z.var(0) + 2e-5) * get(block, "gamma")
                + get(block, "beta"))

    n, width, side = x.shape[0], net.size.embed, 12 * PATCH
    patches = x[:, :, :side, :side].reshape(n, 3, 12, PATCH, 12, PATCH)
    patches = patches.transpose(0, 2, 4, 1, 3, 5).reshape(n, TOKENS, -1)
    conv = net.patch_embed
    tokens = (patches @ get(conv, "weight").reshape(width, -1).T + get(conv, "bias")
              + get(net, "pos_embed")[0])
    rows = []
    for sample in range(n):
        keep = np.flatnonzero(~hidden[sample])
        t, heads, d = tokens[sample, keep], 8, width // 8
        for block in net.blocks:
            q, k, v = (layer_norm(t, block.norm1) @ get(block.attn.qkv, "weight").T).reshape(
                len(keep), 3, heads, d).transpose(1, 2, 0, 3)
            scores = q @ k.transpose(0, 2, 1) * d ** -0.5
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            weights /= weights.sum(-1, keepdims=True)
            t = t + dense((weights @ v).transpose(1, 0, 2).reshape(len(keep), width),
                          block.attn.proj)
            hidden_layer = np.clip(dense(layer_norm(t, block.norm2), block.mlp.fc1), 0, 6)
            t = t + dense(hidden_layer, block.mlp.fc2)
        full = np.repeat(get(net, "mask_token")[0], TOKENS, 0)
        full[keep] = layer_norm(t, net.norm)
        rows.append(full.reshape(-1))
    first, first_bn, second, second_bn = net.feature
    features = batch_norm(np.stack(rows) @ get(first, "weight").T, first_bn)
    return batch_norm(features @ get(second, "weight").T, second_bn)


def test_training_computes_arcface_torchs_forward_over_the_kept_tokens():
    """The gathered masking equals the anchor's forward. Weights large enough
    that ReLU6 clips and the attention's scale matters; LayerNorm and BatchNorm
    parameters away from 1 and 0."""
    mx.random.seed(0)
    net = tiny_vit()
    rng = np.random.RandomState(0)
    for param in net.collect_params().values():
        if param.name.endswith(("gamma", "beta", "bias", "mask_token")):
            param.set_data(mx.nd.array(rng.uniform(0.5, 1.5, param.shape)))
        elif param.name.endswith("weight") and param.shape[0] in (48, 64):  # qkv, fc1
            param.set_data(mx.nd.array(rng.normal(0, 1.0, param.shape)))
    x = mx.nd.random.uniform(-1, 1, (4, 3, 112, 112))
    hidden = patch_gradients(net, x, train=True) == 0
    mx.random.seed(5)  # the draws patch_gradients made
    with mx.autograd.record(train_mode=True):
        ours = net(x).asnumpy()
    reference = numpy_vit(net, x.asnumpy(), hidden)
    assert np.abs(ours - reference).max() < 1e-4 * np.abs(reference).max()


def test_the_drop_path_rate_grows_linearly_over_the_blocks():
    for name in ("vit_t", "vit_b_dp005_mask_005", "vit_h"):
        size, net = VIT_SIZES[name], get_model(name)
        rates = [block.drop_path_rate for block in net.blocks]
        assert np.allclose(rates, np.linspace(0, size.drop_path, size.depth)), name
