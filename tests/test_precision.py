"""Mixed precision: the finiteness check at the sizes of real backbones, the 16-bit graph
(its float16 rules checked by type inference, which needs no GPU; its bfloat16 twin run
on this CPU where oneDNN can, its refusal checked where it cannot), the loss scaler,
gradient clipping and the files a run saves."""

from __future__ import annotations

import json
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest
from conftest import REPO, bfloat16_runs

from partial_fc_mx.backbones import get_model
from partial_fc_mx.config import Config
from partial_fc_mx.pfc.centers import HOST_CHUNK_ELEMENTS
from partial_fc_mx.run import checkpoint
from partial_fc_mx.run.export import export_onnx, load_backbone, parity
from partial_fc_mx.run.precision import (
    LossScaler,
    all_finite,
    build_backbone,
    clip_global_norm,
    fused_all_finite,
    mixed_precision_graph,
    training_model,
)

FINITE_CHECK = """
import mxnet as mx, numpy as np
from partial_fc_mx.config import Config
from partial_fc_mx.run.precision import all_finite, build_backbone, fused_all_finite
for check in (all_finite, fused_all_finite):
    for name in ("r50", "r100"):
        net, _ = build_backbone(Config(network=name, embedding_size=64), mx.cpu())
        arrays = [p.data() for p in net.collect_params().values()]
        clean = check(arrays)
        arrays[-1][:] = np.nan  # the last parameter: past any chunk of 200
        print(check.__name__, name, len(arrays), clean, check(arrays), flush=True)
    many = [mx.nd.ones(3) for _ in range(401)] + [mx.nd.ones(2, dtype="float16")] * 201
    print(check.__name__, "mixed", check(many), end=" ")
    many[400][1] = np.inf
    print(check(many), flush=True)
"""


def test_all_finite_checks_the_parameters_of_r50_and_r100():
    """On the host (numpy) and with the GPU's fused kernel run on the CPU:
    multi_all_finite takes at most 200 arrays (201 crash MXNet 1.9.1): r50 has 396
    parameters, r100 771. In a separate process, so that a crash fails the test."""
    result = subprocess.run([sys.executable, "-c", FINITE_CHECK], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    for check in ("all_finite", "fused_all_finite"):
        assert f"{check} r50 396 True False" in result.stdout
        assert f"{check} r100 771 True False" in result.stdout
        assert f"{check} mixed True False" in result.stdout


@pytest.mark.parametrize("check", [all_finite, fused_all_finite])
def test_all_finite_checks_each_dtype(check):
    half = mx.nd.array([1.0, np.nan]).astype("float16")
    full = mx.nd.ones(3)
    assert check([full, mx.nd.ones(2).astype("float16")])
    assert not check([full, half])
    assert not check([mx.nd.array([np.inf]), half.astype("float32")])


def test_a_host_array_is_checked_to_its_last_part():
    """A block of centers larger than one host copy (HOST_CHUNK_ELEMENTS): the value
    in its last row, past the first part, is seen."""
    width = 512
    rows = HOST_CHUNK_ELEMENTS // width + 3
    block = mx.nd.zeros((rows, width))
    assert all_finite([block])
    block[rows - 1, width - 1] = np.inf
    assert not all_finite([block])
    block[rows - 1, width - 1] = 0
    block[0, 0] = np.nan
    assert not all_finite([block])


def node_types(graph: mx.sym.Symbol) -> dict:
    """{operator name: [dtype of each of its nodes' outputs]}, by type inference."""
    internals = graph.get_internals()
    _, types, _ = internals.infer_type(data="float32")
    dtype_of = dict(zip(internals.list_outputs(), types))
    found: dict = {}
    for node in json.loads(graph.tojson())["nodes"]:
        if node["op"] != "null":
            found.setdefault(node["op"], []).append(np.dtype(dtype_of[f"{node['name']}_output"]))
    return found


@pytest.mark.parametrize("network", ["r50", "r100", "mobilefacenet"])
def test_the_float16_graph_computes_in_16_bits_over_float32_parameters(network):
    """What a GPU relies on, decided by type inference alone: the convolutions, dense
    layers and PReLUs compute in float16, every parameter and BatchNorm statistic is
    float32 (the master copy the optimizer updates and the checkpoints save)."""
    graph = mixed_precision_graph(get_model(network, 512)(mx.sym.var("data")), "float16")
    arguments, outputs, auxiliary = graph.infer_type(data="float32")
    names = graph.list_arguments() + graph.list_auxiliary_states()
    assert len(names) > 200
    assert all(np.dtype(t) == np.float32 for t in arguments + auxiliary), \
        [n for n, t in zip(names, arguments + auxiliary) if np.dtype(t) != np.float32][:4]
    types = node_types(graph)
    for op in ("Convolution", "FullyConnected", "LeakyReLU"):
        assert set(types[op]) == {np.dtype("float16")}, op
    assert np.dtype(outputs[0]) == np.float32  # the embeddings Partial FC gathers


def test_a_gpu_start_up_builds_the_float16_block_over_the_same_parameters():
    """What build_backbone does with fp16 on a GPU, up to the first kernel: the float16
    block is made from the hybridized network's symbol (MXNet 1.9.1's
    convert_hybrid_block needed a cached graph that hybridize() had just cleared)."""
    net, _ = build_backbone(Config(network="tiny", embedding_size=64), mx.cpu())
    block = training_model(net, mx.gpu(), "float16")
    mine, theirs = net.collect_params(), block.collect_params()
    assert all(theirs[name] is mine[name] for name in mine.keys())
    assert dict(block._flags)["static_alloc"]


def test_the_bfloat16_graph_keeps_prelu_in_float32():
    types = node_types(mixed_precision_graph(get_model("tiny", 64)(mx.sym.var("data")),
                                             "bfloat16"))
    assert {t.itemsize for t in types["Convolution"]} == {2}  # bfloat16
    assert set(types["LeakyReLU"]) == {np.dtype("float32")}  # oneDNN has no bf16 PReLU


def refused_where_onednn_cannot(x: mx.nd.NDArray, model) -> bool:
    """True where oneDNN runs bfloat16 convolutions (AVX-512); elsewhere checks the rule
    cpu_precision's probe relies on: oneDNN's refusal is an MXNetError at the first
    read of the result, which a process can catch, not a crash."""
    if bfloat16_runs():
        return True
    with pytest.raises(mx.base.MXNetError, match="could not create a primitive descriptor"):
        model(x).asnumpy()
    return False


def test_fp16_builds_a_static_16_bit_block_over_the_same_parameters():
    """The bfloat16 block the trainer uses where the CPU runs it: it shares every
    Parameter object with the float32 network, keeps static_alloc, and computes the
    same embeddings with float32 gradients."""
    config = Config(network="tiny", embedding_size=64, fp16=True)
    net, model = build_backbone(config, mx.cpu(), "bfloat16")
    assert model is not net
    mine, theirs = net.collect_params(), model.collect_params()
    assert sorted(mine.keys()) == sorted(theirs.keys())
    assert all(theirs[name] is mine[name] for name in mine.keys())
    assert dict(model._flags)["static_alloc"] and dict(model._flags)["static_shape"]
    x = mx.nd.array(np.random.default_rng(0).standard_normal((4, 3, 112, 112)))
    if not refused_where_onednn_cannot(x, model):
        return
    with mx.autograd.record():
        low, full = model(x), net(x)
    assert low.dtype == np.float32
    cosine = (low * full).sum(axis=1) / (low.norm(axis=1) * full.norm(axis=1))
    assert cosine.min().asscalar() > 0.99  # the same network, in 8 bits of mantissa
    low.backward(mx.nd.ones_like(low))
    grads = [p.grad() for p in mine.values() if p.grad_req != "null"]
    assert {np.dtype(g.dtype) for g in grads} == {np.dtype("float32")}
    assert sum(float(g.norm().asscalar()) for g in grads) > 0


def test_float32_trains_the_network_itself_on_a_gpu_and_its_graph_with_kernels_on_the_cpu():
    """On the CPU the graph has the CPU kernels (tests/test_cpu_kernels.py), over the
    network's own Parameter objects."""
    net, model = build_backbone(Config(network="tiny", embedding_size=64, fp16=True), mx.cpu(),
                                "float32")
    mine, theirs = net.collect_params(), model.collect_params()
    assert model is not net and all(theirs[name] is mine[name] for name in mine.keys())
    assert training_model(net, mx.gpu(), "float32") is net


def test_a_16_bit_run_saves_float32_files_that_load_and_export(tmp_path):
    """backbone-*.params hold the float32 network (structure names in backbone.params),
    so the exported backbone loads, carries no cast, and exports to ONNX."""
    net, model = build_backbone(Config(network="tiny", embedding_size=64, fp16=True),
                                mx.cpu(), "bfloat16")
    x = mx.nd.array(np.random.default_rng(1).standard_normal((4, 3, 112, 112)))
    if refused_where_onednn_cannot(x, model):
        with mx.autograd.record():
            model(x).backward()
    checkpoint.save_backbone(net, tmp_path / "backbone")
    assert "amp_cast" not in (tmp_path / "backbone-symbol.json").read_text()
    saved = mx.nd.load(str(tmp_path / "backbone-0000.params"))
    assert {np.dtype(array.dtype) for array in saved.values()} == {np.dtype("float32")}
    loaded = load_backbone(tmp_path)
    np.testing.assert_array_equal(loaded(x).asnumpy(), net(x).asnumpy())
    export_onnx(tmp_path)
    assert parity(tmp_path) <= 1e-5


def test_checkpoints_are_the_same_files_in_either_precision(tmp_path):
    """The parameters are saved by the float32 network's structure, whatever the
    precision and however many networks the process built before (global names shift)."""
    get_model("tiny", 64)  # shifts MXNet's global name counters
    half, _ = build_backbone(Config(network="tiny", embedding_size=64, fp16=True), mx.cpu(),
                             "bfloat16")
    full, _ = build_backbone(Config(network="tiny", embedding_size=64), mx.cpu())
    half.save_parameters(str(tmp_path / "half.params"))
    full.save_parameters(str(tmp_path / "full.params"))
    keys = sorted(mx.nd.load(str(tmp_path / "half.params")))
    assert keys == sorted(mx.nd.load(str(tmp_path / "full.params")))
    assert "features.0.weight" in keys
    full.load_parameters(str(tmp_path / "half.params"))
    x = mx.nd.ones((1, 3, 112, 112))
    np.testing.assert_array_equal(full(x).asnumpy(), half(x).asnumpy())


def test_clipping_mixes_float16_and_float32_without_overflow():
    """Gluon's clip_global_norm adds float16 and float32 norms with add_n, which refuses
    the mix; and the squares of loss-scaled float16 gradients overflow float16."""
    rng = np.random.default_rng(0)
    scale = 64.0  # the loss scale: the arrays hold 64 x the true gradients
    true = [rng.normal(size=(30, 7)) * 20, rng.normal(size=11), rng.normal(size=(5, 5)) * 20]
    arrays = [mx.nd.array(true[0] * scale, dtype="float16"), mx.nd.array(true[1] * scale),
              mx.nd.array(true[2] * scale, dtype="float16")]  # up to ~4e3: squares ~1e7
    stored = [a.asnumpy().astype(np.float64) for a in arrays]
    unit = 1 / scale
    expected = np.sqrt(sum(((s * unit) ** 2).sum() for s in stored))
    total = clip_global_norm(arrays, 1.0, unit=unit)
    assert total == pytest.approx(expected, rel=1e-3)
    clipped = np.sqrt(sum(((a.asnumpy().astype(np.float64) * unit) ** 2).sum()
                          for a in arrays))
    assert clipped == pytest.approx(1.0, rel=2e-3)
    small = [mx.nd.array([0.3, 0.4])]
    assert clip_global_norm(small, 1.0) == pytest.approx(0.5)
    np.testing.assert_allclose(small[0].asnumpy(), [0.3, 0.4])  # under the bound: untouched


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


def test_a_resumed_scaler_continues_a_16_bit_scale_and_starts_anew_after_float32():
    assert LossScaler.resumed(True, 2.0**13).scale == 2.0**13  # a 16-bit run's own
    assert LossScaler.resumed(True, 1.0).scale == 2.0**16  # a float32 run's checkpoint
    assert LossScaler.resumed(True, None).scale == 2.0**16  # a fresh run
    assert LossScaler.resumed(False, 2.0**13).scale == 1.0  # float32: no scaling
