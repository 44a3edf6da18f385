"""Buffers kept across Partial FC steps: views of the shape asked for, grown only when
a step needs more, never shrunk, and reused (no allocation) for the same shape."""

from __future__ import annotations

import mxnet as mx
import numpy as np

from partial_fc_mx.pfc import buffers
from partial_fc_mx.pfc.buffers import GROWTH, Buffers


def test_a_buffer_is_reused_for_the_same_or_a_smaller_shape():
    held = Buffers(mx.cpu())
    first = held.get("logits", (4, 6))
    first[:] = 7
    assert held.nbytes() == 4 * 6 * 4
    smaller = held.get("logits", (3, 5))
    assert smaller.shape == (3, 5) and held.nbytes() == 4 * 6 * 4
    # the same memory: what the last step left is there, nothing was allocated
    assert np.all(smaller.asnumpy() == 7)
    mx.nd.exp(mx.nd.zeros((3, 5)), out=smaller)
    assert np.all(held.get("logits", (4, 6)).asnumpy().reshape(-1)[:15] == 1)


def test_a_buffer_grows_for_a_larger_shape_or_another_dtype():
    held = Buffers(mx.cpu())
    held.get("rows", (2, 3))
    grown = held.get("rows", (5, 3))
    assert grown.shape == (5, 3) and held.nbytes() == 5 * 3 * 4
    # a small growth takes GROWTH more, so a sample that grows by a row each step
    # does not reallocate every step
    assert held.get("rows", (16, 1)).shape == (16, 1)
    assert held.nbytes() == int(15 * GROWTH) * 4
    held.get("rows", (18,))
    assert held.nbytes() == int(15 * GROWTH) * 4
    half = held.get("rows", (5, 3), "float16")
    assert half.dtype == np.float16 and held.nbytes() == 5 * 3 * 2
    other = held.get("grad", (5, 3))
    assert held.nbytes() == 5 * 3 * 2 + 5 * 3 * 4 and other.dtype == np.float32


def test_growth_stops_at_what_one_mxnet_array_can_hold(monkeypatch):
    monkeypatch.setattr(buffers, "INT32_ELEMENTS", 100)
    held = Buffers(mx.cpu())
    held.get("logits", (9, 10))
    assert held.nbytes() == 90 * 4
    held.get("logits", (19, 5))  # 95 elements: 1.25x would ask for 112
    assert held.nbytes() == 100 * 4
