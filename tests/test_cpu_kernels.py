"""The backbones' CPU kernels (run/cpu_kernels.py): PReLU (pfc/kernels/prelu.cc) and
LayerNorm (pfc/kernels/layer_norm.cc) against float64 and finite differences, the graphs
that use them and the ones that must not, and the slope gradient MXNet's own LeakyReLU
gets wrong in some compiled graphs (`mbf`'s first PReLU, the parity study's MLP)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import mxnet as mx
import numpy as np
import pytest

from partial_fc_mx.backbones import graph_of
from partial_fc_mx.config import Config
from partial_fc_mx.pfc import kernels
from partial_fc_mx.run.cpu_kernels import with_cpu_kernels
from partial_fc_mx.run.precision import build_backbone, mixed_precision_graph, training_model


def prelu_reference(x: np.ndarray, slopes: np.ndarray, dy: np.ndarray) -> tuple:
    """(out, data's gradient, slopes' gradient in float64) of PReLU over axis 1."""
    shape = (1, -1) + (1,) * (x.ndim - 2)
    a = np.broadcast_to(slopes.reshape(shape) if slopes.size > 1 else slopes, x.shape)
    out = np.where(x > 0, x, a * x)
    grad = np.where(x > 0, dy, a * dy)
    per_element = dy.astype(np.float64) * np.minimum(x, 0)
    axes = tuple(i for i in range(x.ndim) if i != 1 or slopes.size == 1)
    return out, grad, per_element.sum(axis=axes).reshape(slopes.shape)


def kernel_prelu(x: np.ndarray, slopes: np.ndarray, dy: np.ndarray, threads: int = 1) -> tuple:
    kernels.load()
    data, gamma = mx.nd.array(x), mx.nd.array(slopes)
    data.attach_grad()
    gamma.attach_grad()
    with mx.autograd.record():
        out = mx.nd.pfc_prelu(data, gamma, threads=threads)
    out.backward(mx.nd.array(dy))
    return out.asnumpy(), data.grad.asnumpy(), gamma.grad.asnumpy()


@pytest.mark.parametrize("shape, slopes", [((3, 5, 7, 4), 5), ((16, 32), 32), ((4, 6, 9), 6),
                                           ((3, 5, 7, 4), 1), ((2, 64, 56, 56), 64)])
def test_the_prelu_kernel_matches_float64(shape, slopes):
    """Forward and data gradient bit for bit (one multiply each); each slope's gradient,
    a sum over its channel, within float32's rounding of float64's."""
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape).astype(np.float32)
    a = rng.uniform(-0.5, 0.5, slopes).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    out, grad, slope_grad = kernel_prelu(x, a, dy)
    expected_out, expected_grad, expected_slope_grad = prelu_reference(x, a, dy)
    assert np.array_equal(out, expected_out) and np.array_equal(grad, expected_grad)
    scale = np.abs(dy * x).sum() / slopes
    assert np.abs(slope_grad - expected_slope_grad).max() <= 1e-6 * scale


def test_a_nan_stays_nan_and_more_threads_give_the_same_bits():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 7, 6, 6)).astype(np.float32)
    x[1, 2, 3, 4] = np.nan
    a, dy = np.full(7, 0.25, np.float32), rng.standard_normal(x.shape).astype(np.float32)
    results = [kernel_prelu(x, a, dy, threads) for threads in (1, 2, 3)]
    out, grad, slope_grad = results[0]
    assert np.isnan(out[1, 2, 3, 4]) and np.isnan(slope_grad[2])
    assert np.isfinite(np.delete(slope_grad, 2)).all() and np.isfinite(grad).all()
    for other in results[1:]:
        assert all(np.array_equal(mine, theirs, equal_nan=True)
                   for mine, theirs in zip(results[0], other))


def test_non_finite_values_give_what_mxnets_own_prelu_gives():
    """NaN and infinities in the data and in the gradient, against LeakyReLU run
    imperatively (where its gradients are right): an infinite gradient at a positive
    input makes its slope's gradient NaN (0 * inf) in both."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 4, 3, 3)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    x[0, 0, 0, 0], x[1, 1, 1, 1], x[0, 2, 2, 2] = np.nan, np.inf, -np.inf
    positive = np.argwhere(x[:, 3] > 0)[0]
    dy[positive[0], 3, positive[1], positive[2]] = np.inf
    a = np.full(4, 0.25, np.float32)
    data, gamma = mx.nd.array(x), mx.nd.array(a)
    data.attach_grad()
    gamma.attach_grad()
    with mx.autograd.record():
        out = mx.nd.LeakyReLU(data, gamma=gamma, act_type="prelu")
    out.backward(mx.nd.array(dy))
    expected = out.asnumpy(), data.grad.asnumpy(), gamma.grad.asnumpy()
    assert np.isnan(expected[2][3])
    out, grad, slope_grad = kernel_prelu(x, a, dy)
    assert np.array_equal(out, expected[0], equal_nan=True)
    assert np.array_equal(grad, expected[1], equal_nan=True)
    assert np.allclose(slope_grad, expected[2], rtol=1e-5, equal_nan=True)  # sums' order


def layer_norm_reference(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, dy: np.ndarray,
                         eps: float) -> tuple:
    """(out, data's gradient, gamma's, beta's) of LayerNorm over the last axis, float64."""
    x, dy = x.astype(np.float64), dy.astype(np.float64)
    mean = x.mean(-1, keepdims=True)
    rstd = 1 / np.sqrt(x.var(-1, keepdims=True) + eps)
    xhat = (x - mean) * rstd
    g = dy * gamma
    grad = rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    rows = (-1, x.shape[-1])
    return (xhat * gamma + beta, grad, (dy * xhat).reshape(rows).sum(0),
            dy.reshape(rows).sum(0))


def kernel_layer_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, dy: np.ndarray,
                      eps: float, threads: int = 1, op: str = "pfc_layer_norm") -> tuple:
    """The kernel's (or, with op="LayerNorm", MXNet's) out and gradients."""
    kernels.load()
    arrays = [mx.nd.array(a) for a in (x, gamma, beta)]
    for array in arrays:
        array.attach_grad()
    with mx.autograd.record():
        if op == "LayerNorm":
            out = mx.nd.LayerNorm(*arrays, axis=-1, eps=eps)
        else:
            out = mx.nd.pfc_layer_norm(*arrays, eps=eps, threads=threads)[0]
    out.backward(mx.nd.array(dy))
    return out.asnumpy(), *(array.grad.asnumpy() for array in arrays)


@pytest.mark.parametrize("shape, spread, offset, eps", [
    ((4, 145, 256), 3.0, 1.0, 1e-6), ((3, 7, 33), 3.0, 1.0, 1e-6), ((130, 64), 3.0, 1.0, 1e-5),
    ((1, 1, 5), 3.0, 1.0, 1e-6),
    ((6, 70, 48), 1e-3, 0.0, 1e-5),  # a variance of 1e-6 beside eps 1e-5: eps decides rstd
])
def test_the_layer_norm_kernel_matches_float64_as_mxnets_does(shape, spread, offset, eps):
    """Output and data's gradient within float32's rounding of float64, row by row;
    gamma's and beta's gradients, sums over every row (blocks of 64, a last one
    partial), within float32's rounding of float64's sums; no worse than MXNet's own
    by more than twice."""
    rng = np.random.default_rng(sum(shape))
    x = (rng.standard_normal(shape) * spread + offset).astype(np.float32)
    gamma, beta = (rng.standard_normal(shape[-1]).astype(np.float32) for _ in range(2))
    dy = rng.standard_normal(shape).astype(np.float32)
    expected = layer_norm_reference(x, gamma, beta, dy, eps)
    kernel = kernel_layer_norm(x, gamma, beta, dy, eps)
    mxnet = kernel_layer_norm(x, gamma, beta, dy, eps, op="LayerNorm")
    rows = np.sqrt(len(x.reshape(-1, shape[-1])))
    for name, mine, theirs, exact, tolerance in zip(
            ("out", "data's gradient", "gamma's", "beta's"), kernel, mxnet, expected,
            (1e-6, 1e-6, 2e-6 * rows, 2e-6 * rows)):
        scale = np.abs(exact).max()
        assert np.abs(mine - exact).max() <= tolerance * scale, name
        assert np.abs(mine - exact).max() <= 2 * np.abs(theirs - exact).max() + 1e-6 * scale, name


def test_the_rewrite_keeps_each_layer_norms_eps_and_leaves_those_it_cannot_compute():
    """eps from the graph (0.1 here, or MXNet's default where the graph names none) on
    rows whose variance is near it; a LayerNorm over another axis, or one whose mean
    and std are outputs, stays MXNet's."""
    data = mx.sym.var("data")
    rng = np.random.default_rng(7)
    x = mx.nd.array(rng.standard_normal((5, 16)) * 0.3)
    gamma, beta = mx.nd.array(rng.standard_normal(16)), mx.nd.array(rng.standard_normal(16))
    for eps in (0.1, None):
        options = {} if eps is None else {"eps": eps}
        graph = mx.sym.LayerNorm(data, mx.sym.var("g"), mx.sym.var("b"), **options)
        rewritten = with_cpu_kernels(graph, threads=2)
        assert ops(rewritten) == ["null", "null", "null", "pfc_layer_norm"]
        args = {"data": x, "g": gamma, "b": beta}
        expected = graph.eval(ctx=mx.cpu(), **args)[0].asnumpy()
        assert np.abs(rewritten[0].eval(ctx=mx.cpu(), **args)[0].asnumpy() - expected).max() \
            <= 1e-5 * np.abs(expected).max()
    kept = [mx.sym.LayerNorm(data, mx.sym.var("g"), mx.sym.var("b"), axis=0),
            mx.sym.LayerNorm(data, mx.sym.var("g"), mx.sym.var("b"), output_mean_var=True)]
    for graph in kept:
        assert "pfc_layer_norm" not in ops(with_cpu_kernels(graph, threads=1))


def test_more_threads_give_the_layer_norms_same_bits_and_a_nan_stays_in_its_row():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 50, 24)).astype(np.float32)
    x[1, 7, 3] = np.nan
    gamma, beta = np.ones(24, np.float32), np.zeros(24, np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    results = [kernel_layer_norm(x, gamma, beta, dy, 1e-5, threads) for threads in (1, 2, 3)]
    out, grad = results[0][:2]
    assert np.isnan(out[1, 7]).all() and np.isfinite(np.delete(out.reshape(-1, 24), 57, 0)).all()
    assert np.isnan(grad[1, 7]).all() and np.isfinite(np.delete(grad.reshape(-1, 24), 57, 0)).all()
    for other in results[1:]:
        assert all(np.array_equal(mine, theirs, equal_nan=True)
                   for mine, theirs in zip(results[0], other))


def ops(graph: mx.sym.Symbol) -> list[str]:
    return [node["op"] for node in json.loads(graph.tojson(remove_amp_cast=False))["nodes"]]


def types(graph: mx.sym.Symbol) -> list[str]:
    return [str(kind) for kind in graph.get_internals().infer_type(data="float32")[1]]


def test_only_the_cpu_training_graph_uses_the_kernel():
    """On the CPU, float32 and bfloat16 (AMP keeps PReLU in float32, and every one of
    its casts stays) train with the kernel in place of every PReLU; the network's own
    graph, which checkpoints, the inference symbol and the ONNX export are written
    from, keeps LeakyReLU; float16 (a GPU's), float32 on a GPU and a network whose
    gradients accumulate (the kernel only writes them) keep it too."""
    net, model = build_backbone(Config(network="mobilefacenet", embedding_size=64), mx.cpu())
    own, trained = ops(graph_of(net)), ops(model(mx.sym.var("data")))
    assert own.count("LeakyReLU") > 10 and "pfc_prelu" not in own
    assert trained.count("pfc_prelu") == own.count("LeakyReLU") and "LeakyReLU" not in trained
    bfloat16 = training_model(net, mx.cpu(), "bfloat16")(mx.sym.var("data"))
    assert ops(bfloat16).count("pfc_prelu") == own.count("LeakyReLU")
    assert "LeakyReLU" not in ops(bfloat16)
    converted = mixed_precision_graph(graph_of(net), "bfloat16")  # AMP's casts all kept
    assert Counter(types(bfloat16)) == Counter(types(converted))
    assert sum("bfloat16" in kind for kind in types(bfloat16)) > 100
    float16 = ops(training_model(net, mx.cpu(), "float16")(mx.sym.var("data")))
    assert "pfc_prelu" not in float16 and float16.count("LeakyReLU") == own.count("LeakyReLU")
    assert training_model(net, mx.gpu(), "float32") is net
    net.collect_params()[first_slopes_of(net).name].grad_req = "add"  # the kernel only writes
    assert training_model(net, mx.cpu(), "float32") is net


def test_a_vits_cpu_training_graph_computes_every_layer_norm_with_the_kernel():
    """vit_t's 25 LayerNorms: the kernel's in float32 and bfloat16 (AMP keeps them in
    float32), in the training graph and in the inference graph beside it (modes.py),
    MXNet's in the network's own graph and in float16 (a GPU's)."""
    net, model = build_backbone(Config(network="vit_t", embedding_size=64), mx.cpu())
    own = ops(graph_of(net))
    assert own.count("LayerNorm") == 25 and "pfc_layer_norm" not in own
    for block in (model.training, model.inference):
        trained = ops(block(mx.sym.var("data")))
        assert trained.count("pfc_layer_norm") == 25 and "LayerNorm" not in trained
    bfloat16 = training_model(net, mx.cpu(), "bfloat16").training(mx.sym.var("data"))
    assert ops(bfloat16).count("pfc_layer_norm") == 25
    kinds = Counter(types(bfloat16))  # AMP's casts all kept; the kernel's mean and 1 / std
    expected = Counter(types(mixed_precision_graph(graph_of(net), "bfloat16")))
    float32 = str(np.float32)
    assert kinds[float32] == expected[float32] + 2 * 25
    assert {k: n for k, n in kinds.items() if k != float32} == {
        k: n for k, n in expected.items() if k != float32} and len(kinds) == 2
    float16 = ops(training_model(net, mx.cpu(), "float16").training(mx.sym.var("data")))
    assert "pfc_layer_norm" not in float16 and float16.count("LayerNorm") == 25


def first_slopes_of(net: mx.gluon.HybridBlock) -> mx.gluon.Parameter:
    """The first PReLU's slopes (parameters are listed in the order they were made)."""
    return next(p for name, p in net.collect_params().items() if name.endswith("alpha"))


def slope_gradients(block, images: mx.nd.NDArray, cotangent: mx.nd.NDArray,
                    params: mx.gluon.ParameterDict | None = None) -> dict[str, np.ndarray]:
    """The gradients of `params` (default: `block`'s own) from one recorded forward."""
    with mx.autograd.record():
        embeddings = block(images)
    embeddings.backward(cotangent)
    params = block.collect_params() if params is None else params
    return {name: p.grad().asnumpy().copy() for name, p in params.items()
            if p.grad_req != "null"}


def finite_difference(block, images, cotangent, parameter, channel: int,
                      step: float = 1e-2) -> float:
    """d(sum(cotangent * block(images))) / d(parameter[channel]), central, in train mode."""
    original = parameter.data().copy()

    def loss(shift: float) -> float:
        shifted = original.copy()
        shifted[channel] += shift
        parameter.set_data(shifted)
        with mx.autograd.record(train_mode=True):
            out = block(images)
        return float((out.astype("float64") * cotangent.astype("float64")).sum().asscalar())

    difference = (loss(step) - loss(-step)) / (2 * step)
    parameter.set_data(original)
    return difference


def test_a_grouped_convolution_after_prelu_leaves_mxnets_slope_gradient_wrong_not_the_kernels():
    """MXNet 1.9.1's LeakyReLU, here followed by a convolution of 64 groups over 128
    channels (as in `mbf`), returns on the CPU the slopes' gradient times the slopes (a
    quarter of it at the initial 0.25) in this compiled graph; its data gradient is
    right. The kernel's is the finite difference's: PReLU is linear in its slopes and
    nothing else here depends on them, so the difference is exact."""
    kernels.load()
    data, slopes = mx.sym.var("data"), mx.sym.var("slopes")
    first = mx.sym.Convolution(data, num_filter=128, kernel=(3, 3), stride=(2, 2), pad=(1, 1),
                               no_bias=True, name="first")
    graphs = {"LeakyReLU": mx.sym.LeakyReLU(first, gamma=slopes, act_type="prelu"),
              "kernel": mx.sym.pfc_prelu(first, slopes, threads=1)}
    images = mx.nd.array(np.random.default_rng(0).standard_normal((2, 3, 32, 32)))
    cotangent = mx.nd.array(np.random.default_rng(1).standard_normal((2, 128, 16, 16)))
    gradients = {}
    for label, activation in graphs.items():
        graph = mx.sym.Convolution(activation, num_filter=128, num_group=64, kernel=(3, 3),
                                   pad=(1, 1), no_bias=True, name="grouped")
        block = mx.gluon.SymbolBlock(graph, [data])
        mx.random.seed(0)
        block.initialize(mx.init.Normal(0.1))
        block.hybridize(static_alloc=True, static_shape=True)
        gradients[label] = slope_gradients(block, images, cotangent)
        exact = np.array([finite_difference(block, images, cotangent,
                                            block.collect_params()["slopes"], c)
                          for c in range(4)])
    kernel, mxnet = gradients["kernel"]["slopes"][:4], gradients["LeakyReLU"]["slopes"][:4]
    assert np.abs(kernel - exact).max() <= 1e-4 * np.abs(exact).max(), (kernel, exact)
    slopes = block.collect_params()["slopes"].data().asnumpy()[:4]
    assert np.abs(mxnet - slopes * exact).max() <= 1e-4 * np.abs(exact).max(), (mxnet, exact)
    assert np.array_equal(gradients["kernel"]["first_weight"],
                          gradients["LeakyReLU"]["first_weight"])


def test_the_parity_mlps_slope_gradient_is_wrong_in_mxnet_and_right_in_the_kernel():
    """The scale task's MLP (Dense, BatchNorm, PReLU, twice): there too LeakyReLU's
    slopes' gradient is the true one times the slopes, and the kernel's is the finite
    difference's. The defect is not tied to a grouped convolution."""
    from partial_fc_mx.parity.ours import mlp
    from partial_fc_mx.parity.recipe import Recipe
    from partial_fc_mx.parity.task import INPUT

    mx.random.seed(0)
    net = mlp(Recipe(Path("/t"), Path("/o"), hidden=64, embedding_size=16))
    net.initialize()
    net.hybridize(static_alloc=True)
    rng = np.random.default_rng(4)
    inputs = mx.nd.array(rng.standard_normal((32, INPUT)))
    cotangent = mx.nd.array(rng.standard_normal((32, 16)))
    net(inputs)
    model = training_model(net, mx.cpu(), "float32")
    own, trained = (slope_gradients(block, inputs, cotangent) for block in (net, model))
    slopes = [(name, p) for name, p in net.collect_params().items() if name.endswith("alpha")]
    assert len(slopes) == 2
    for name, parameter in slopes:
        channel = int(np.argmax(np.abs(trained[name])))
        exact = finite_difference(net, inputs, cotangent, parameter, channel, step=1e-3)
        assert abs(trained[name][channel] - exact) <= 0.02 * abs(exact)
        value = parameter.data().asnumpy()
        assert np.allclose(own[name], value * trained[name], rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("network", ["r18", "mobilefacenet", "mbf", "vit_t"])
def test_a_backbones_training_graph_has_the_gradients_of_its_own(network):
    """One training-mode forward and backward of the CPU's training graph against the
    network's own: every parameter's gradient within float32 rounding, except where
    MXNet's is wrong (mbf's first slopes, above): there the finite difference decides.
    Rounding, as the network's own graph itself shows it: its gradients moved by
    images 1e-7 off (relative, at random), which moves a 12-block ViT's by 1e-4. vit_t's
    masks and drop path are drawn from the same seed for both."""
    net, model = build_backbone(Config(network=network, embedding_size=64), mx.cpu())
    rng = np.random.default_rng(2)
    images = mx.nd.array(rng.uniform(-1, 1, (4, 3, 112, 112)))  # 2: BatchNorm near-degenerate
    cotangent = mx.nd.array(rng.standard_normal((4, 64)))
    nudged = images * mx.nd.array(1 + 1e-7 * rng.standard_normal(images.shape))

    def gradients(block, inputs=images):
        mx.random.seed(5)
        return slope_gradients(block, inputs, cotangent, net.collect_params())

    own, trained, own_nudged = gradients(net), gradients(model), gradients(net, nudged)
    wrong_in_mxnet = {first_slopes_of(net).name} if network == "mbf" else set()
    for name in set(own) - wrong_in_mxnet:
        rounding = np.linalg.norm(own_nudged[name] - own[name])
        size = np.linalg.norm(own[name])
        assert np.linalg.norm(trained[name] - own[name]) <= 1e-5 * size + 2 * rounding + 1e-6, \
            (name, rounding / size)
    if network == "mbf":
        first_slopes = first_slopes_of(net)
        channel = int(np.argmax(np.abs(trained[first_slopes.name])))
        exact = finite_difference(net, images, cotangent, first_slopes, channel, step=1e-3)
        assert abs(trained[first_slopes.name][channel] - exact) <= 0.02 * abs(exact)
        assert abs(own[first_slopes.name][channel] - exact) > 0.5 * abs(exact)
