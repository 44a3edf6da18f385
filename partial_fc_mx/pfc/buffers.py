"""Buffers that live across Partial FC steps.

On the CPU, MXNet hands every new array fresh pages from the system (its CPU
storage has no pool, and glibc maps arrays this large with mmap), so a step that
allocates its N x n logits and n x D rows anew page-faults through them every
time: a third of the step's CPU time was the kernel's (docs/benchmarks_history.md). Each
buffer is allocated once, at the largest size asked for, and handed out as a view
of the shape a step needs: the sampled count varies when a batch has more positive
classes than the sample, and the view then grows its buffer once, not every step.
"""

from __future__ import annotations

import math

import mxnet as mx
import numpy as np

GROWTH = 1.25
"""A buffer that must grow takes at least this factor more, up to INT32_ELEMENTS."""

INT32_ELEMENTS = 2**31 - 1
"""The most elements one MXNet array may hold in a build without USE_INT64_TENSOR_SIZE,
as every released MXNet 1.9 wheel is."""


class Buffers:
    def __init__(self, ctx: mx.Context) -> None:
        self.ctx = ctx
        self._buffers: dict[str, mx.nd.NDArray] = {}

    def get(self, name: str, shape: tuple, dtype: str = "float32") -> mx.nd.NDArray:
        """A `shape` view of buffer `name`, whose content is left from its last use.

        A buffer must not be asked for again while a value in it is still needed:
        names say what each holds during a step."""
        size = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.size < size or buffer.dtype != np.dtype(dtype):
            if buffer is not None and buffer.dtype == np.dtype(dtype):
                # no regrowth at each new record, and no margin past what MXNet can hold
                size = max(size, min(int(GROWTH * buffer.size), INT32_ELEMENTS))
            buffer = mx.nd.empty((size,), ctx=self.ctx, dtype=dtype)
            self._buffers[name] = buffer
        return buffer[:math.prod(shape)].reshape(shape)

    def nbytes(self) -> int:
        """Bytes held by all buffers (a step that reuses them does not grow this)."""
        return sum(b.size * np.dtype(b.dtype).itemsize for b in self._buffers.values())
