"""Batches onto the training device: staged through pinned buffers and copied one
batch ahead. cpu(1) stands in for a GPU: the same staged path, on any machine."""

from __future__ import annotations

import mxnet as mx
import numpy as np
import pytest

from partial_fc_mx.data.device import Staging, on_device
from partial_fc_mx.data.loader import Batch


def numbered_batches(count: int, pulled: list) -> iter:
    """Batch k holds images full of k; `pulled` counts the batches taken so far."""
    for k in range(count):
        pulled.append(k)
        yield Batch(np.full((3, 3, 4, 4), k, np.float32), np.array([k, k + 1, k + 2]))


@pytest.mark.parametrize("ctx, ahead", [(mx.cpu(1), 1), (mx.cpu(0), 0)])
def test_every_batch_arrives_in_order_and_the_next_copy_is_queued_first(ctx, ahead):
    pulled = []
    seen = []
    for k, batch in enumerate(on_device(numbered_batches(7, pulled), ctx)):
        assert batch.images.context == ctx
        assert len(pulled) == min(k + 1 + ahead, 7)  # batch k+1 staged before k is used
        seen.append(batch)  # read only after all are staged: a buffer rewritten under
    assert len(seen) == 7  # a pending copy would show in an earlier batch
    for k, batch in enumerate(seen):
        assert (batch.images.asnumpy() == k).all() and batch.labels.tolist() == [k, k + 1, k + 2]


def test_staging_uses_two_pinned_buffers_in_turn():
    staging = Staging(mx.cpu(1))
    first = staging.to_device(np.ones((2, 3), np.float32))
    second = staging.to_device(np.zeros((2, 3), np.float32))
    assert [b.context for b in staging.buffers] == [mx.cpu_pinned(0)] * 2
    assert first.context == mx.cpu(1)
    assert first.asnumpy().sum() == 6 and second.asnumpy().sum() == 0
    third = staging.to_device(np.full((5,), 2, np.float32))  # a new shape: new buffers
    assert third.asnumpy().tolist() == [2] * 5 and staging.buffers[0].shape == (5,)


def test_pinned_buffers_belong_to_the_process_gpu():
    """Pinned memory is registered with one GPU's context: cpu_pinned(0) in every
    process would open a context on GPU 0 in each (no kernel runs to build these)."""
    assert Staging(mx.gpu(3)).pinned == mx.cpu_pinned(3)
    assert Staging(mx.cpu(1)).pinned == mx.cpu_pinned(0)


def test_decode_threads_default_to_the_process_share_of_the_cores(monkeypatch):
    import os

    from partial_fc_mx.dist import World
    from partial_fc_mx.run import data_source

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert data_source.decode_threads(3, World(0, 8, 0, 8)) == 3  # as configured
    assert data_source.decode_threads(0, World(0, 8, 0, 8)) == 8  # 64 cores, 8 processes
    assert data_source.decode_threads(0, World(0, 64, 0, 64)) == 2  # at least 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)))
    assert data_source.decode_threads(0, World(0, 8, 0, 8)) == 4  # bound to 4 cores
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)))
    assert data_source.decode_threads(0, World(0, 8, 0, 8)) == 8  # a socket shared by 4 ranks
