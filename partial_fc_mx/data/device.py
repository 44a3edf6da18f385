"""Batches onto the training device, each copied while the step before it computes.

A GPU copies from host memory by DMA only out of pinned (page-locked) pages; from a
numpy array the copy is staged through a driver buffer and blocks the host. Each
batch is written into one of two pinned buffers and its copy to the device is queued
on MXNet's engine, one batch ahead: the copy runs beside the step that is computing,
and the next step finds its images on the device. A buffer is rewritten only after
the copy out of it is done (MXNet orders the write after the read).

On the CPU the process's default context holds the step's arrays already: one copy
out of numpy, as before. Any other context (a GPU, or cpu(1) in the tests) takes the
staged path, so it runs on machines without a GPU too.
"""

from __future__ import annotations

from collections.abc import Iterator

import mxnet as mx
import numpy as np

from .loader import Batch


def on_device(batches: Iterator[Batch], ctx: mx.Context) -> Iterator[Batch]:
    """`batches` with their images as NDArrays on `ctx`, the next one's copy queued
    before the current one is handed out."""
    if ctx == mx.cpu():
        for batch in batches:
            yield Batch(mx.nd.array(batch.images, ctx=ctx), batch.labels)
        return
    staging = Staging(ctx)
    ahead = None
    for batch in batches:
        copied = Batch(staging.to_device(batch.images), batch.labels)
        if ahead is not None:
            yield ahead
        ahead = copied
    if ahead is not None:
        yield ahead


class Staging:
    """Two pinned host buffers used in turn, for copies to `ctx`. Pinned memory is
    registered with one GPU's driver context: `ctx`'s own (cpu_pinned(0) would open a
    context on GPU 0 in every process of the host, taking memory from rank 0's GPU)."""

    def __init__(self, ctx: mx.Context) -> None:
        self.ctx = ctx
        self.pinned = mx.cpu_pinned(ctx.device_id if ctx.device_type == "gpu" else 0)
        self.buffers: list[mx.nd.NDArray] = []
        self.turn = 0

    def to_device(self, images: np.ndarray) -> mx.nd.NDArray:
        """`images` on the device: written into the next pinned buffer (waiting, if need
        be, for the copy out of it queued two batches ago), the copy to the device
        queued."""
        if not self.buffers or self.buffers[0].shape != images.shape:
            self.buffers = [mx.nd.empty(images.shape, ctx=self.pinned, dtype=images.dtype)
                            for _ in range(2)]
        buffer = self.buffers[self.turn]
        self.turn = 1 - self.turn
        buffer[:] = images
        return buffer.copyto(self.ctx)
