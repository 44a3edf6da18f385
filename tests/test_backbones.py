"""The backbones: their published sizes, and dropout that a resume reproduces."""

from __future__ import annotations

import json

import mxnet as mx
import numpy as np
import pytest

from partial_fc_mx.backbones import get_model
from partial_fc_mx.backbones.dropout import Dropout
from partial_fc_mx.backbones.summary import count_flops


@pytest.mark.parametrize("name, params_m, gflops", [
    ("r50", 43.6, 6.3), ("r100", 65.2, 12.1), ("mobilefacenet", 1.2, 0.22)])
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
