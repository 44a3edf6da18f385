"""One rank's class centers as a unit: its rows, the optimizer's states, the sampler.

Rank r of W owns the contiguous rows [start, start + count) of the C x D center
matrix, with count = C // W + (r < C % W): balanced to within one row, and
computable by every rank (and by a resume on another world size) from (C, W) alone.
Every optimizer state is an array with one row per center, so a checkpoint saves
each under its own name and a resume on another world size cuts all of them the
same way (checkpoint.load_centers).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import mxnet as mx
import numpy as np

from .center_optimizers import CenterOptimizer
from .center_optimizers.sgd import SGD
from .workspace import INT32_ELEMENTS, Workspace


@dataclass(frozen=True)
class Shard:
    start: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.count


def shard_of(num_classes: int, rank: int, world_size: int) -> Shard:
    base, extra = divmod(num_classes, world_size)
    start = rank * base + min(rank, extra)
    return Shard(start, base + (rank < extra))


class ClassCenters:
    """This rank's rows of the centers, each optimizer state, and the sampler's stream.

    `weight` is stored in `dtype` (float16 halves the rows); each optimizer state in
    the dtype its optimizer asks for. `update` runs the optimizer on the rows a step
    sampled (or, with lazy=False, on every row, with a zero gradient where not
    sampled, as a dense optimizer over the shard does).
    """

    def __init__(self, shard: Shard, embedding_size: int, optimizer: CenterOptimizer, *,
                 ctx: mx.Context, dtype: str = "float32", seed: int = 0, rank: int = 0,
                 lazy: bool = True) -> None:
        if dtype == "float16" and not lazy:
            raise ValueError("lazy_update=False needs float32 centers")
        self.shard, self.embedding_size, self.optimizer = shard, embedding_size, optimizer
        self.ctx, self.dtype, self.lazy = ctx, dtype, lazy
        self.weight = mx.nd.empty((shard.count, embedding_size), ctx=ctx, dtype=dtype)
        fill_initial_centers(self.weight, seed, shard)
        self.states = {name: mx.nd.zeros((shard.count, width), ctx=ctx, dtype=state_dtype)
                       for name, (width, state_dtype)
                       in optimizer.states(embedding_size, dtype).items()}
        self.rng = np.random.default_rng([seed, rank])
        self.buffers = Workspace(ctx)

    def widths(self) -> dict[str, int]:
        """Columns of each array of state_dict(): the weight, then every state."""
        return {"weight": self.embedding_size,
                **{name: state.shape[1] for name, state in self.states.items()}}

    def arrays(self) -> dict[str, mx.nd.NDArray]:
        """{"weight": rows, <state>: rows, ...} on the device (a checkpoint copies one
        at a time to the host)."""
        return {"weight": self.weight, **self.states}

    def state_dict(self) -> dict:
        """{"weight": rows, <state>: rows, ..., "sampler": the generator's state}."""
        return {**{name: array.asnumpy() for name, array in self.arrays().items()},
                "sampler": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        """Replace this rank's rows (e.g. cut from a checkpoint saved at another W).
        The weight is required; a state left out starts at zero (--load-from), a
        missing sampler keeps the current stream."""
        unknown = set(state) - {*self.widths(), "sampler"}
        if unknown or "weight" not in state:
            raise ValueError(f"center state {sorted(state)}: expected weight, sampler and "
                             f"the {self.optimizer.name} states {sorted(self.states)}")
        for name, width in self.widths().items():
            if name in state and tuple(state[name].shape) != (self.shard.count, width):
                raise ValueError(f"{name} shard has shape {tuple(state[name].shape)}, this "
                                 f"rank expects {(self.shard.count, width)}")
        self.weight = mx.nd.array(state["weight"], ctx=self.ctx, dtype=self.dtype)
        for name, current in self.states.items():
            self.states[name] = (mx.nd.array(state[name], ctx=self.ctx, dtype=current.dtype)
                                 if name in state else mx.nd.zeros_like(current))
        if "sampler" in state:
            self.rng.bit_generator.state = state["sampler"]

    def restart_sampler(self, seed: int, rank: int, step: int) -> None:
        """A fresh negative-sampling stream, e.g. after a resume on another world size
        (the saved streams belong to other ranks)."""
        self.rng = np.random.default_rng([seed, rank, step])

    def sampled_weights(self, index: mx.nd.NDArray | None) -> mx.nd.NDArray:
        """The rows `index` (all: None) in float32; the weight itself when it is float32
        and every row is taken, so an update of it in place is the update. Otherwise a
        buffer kept for the next step: valid until the next call."""
        return self._float32_rows("weight", self.weight, index)

    def update(self, index: mx.nd.NDArray | None, w: mx.nd.NDArray, grad: mx.nd.NDArray,
               lr: float) -> None:
        """One optimizer step for rows `index` (None: all) whose float32 values are `w`
        (from sampled_weights) and whose gradient is `grad`."""
        self.optimizer.update(self, index, w, grad, lr)

    def every_row(self, index: mx.nd.NDArray | None, w: mx.nd.NDArray,
                  grad: mx.nd.NDArray) -> tuple:
        """(index, w, grad) of a dense step over the whole shard when lazy is False (a
        zero gradient where not sampled: the states and decay still act), else as given.
        float32 centers only, so w is the weight itself."""
        if self.lazy or index is None:
            return index, w, grad
        full = mx.nd.zeros(self.weight.shape, ctx=self.ctx)
        full[index] = grad
        return None, self.weight, full

    def apply(self, index: mx.nd.NDArray | None, w: mx.nd.NDArray,
              rule: Callable[[mx.nd.NDArray, dict], None]) -> None:
        """Run `rule(w, states)` on rows `index` with float32 copies of the states, then
        store the rows back in their dtypes. In place where nothing needs a copy (float32
        storage, every row); otherwise gathered, updated in float32 and stored rounded."""
        rows = slice(None) if index is None else index
        work = {name: self._float32_rows(name, state, index)
                for name, state in self.states.items()}
        rule(w, work)
        if w is not self.weight:
            self.weight[rows] = self._stored(w, "taken weight", self.dtype)
        for name, state in self.states.items():
            if work[name] is not state:
                state[rows] = self._stored(work[name], f"taken {name}", state.dtype)

    def _stored(self, rows: mx.nd.NDArray, buffer: str, dtype) -> mx.nd.NDArray:
        """float32 `rows` in the storage dtype: as they are, or rounded into the buffer
        they were gathered through (free again once they are in float32)."""
        if rows.dtype == np.dtype(dtype):
            return rows
        return mx.nd.Cast(rows, dtype=dtype, out=self.buffers.get(buffer, rows.shape, dtype))

    def _float32_rows(self, name: str, array: mx.nd.NDArray,
                      index: mx.nd.NDArray | None) -> mx.nd.NDArray:
        """Rows `index` (None: all) of the weight or a state in float32: the array itself
        when it is float32 and every row is taken, else gathered and cast through
        buffers kept across steps."""
        rows = array
        if index is not None:
            shape = (len(index), array.shape[1])
            rows = mx.nd.take(array, index,
                              out=self.buffers.get(f"taken {name}", shape, array.dtype))
        if rows.dtype != np.float32:
            rows = mx.nd.Cast(rows, dtype="float32",
                              out=self.buffers.get(f"float32 {name}", rows.shape))
        return rows


CENTER_BLOCK = 4096
"""Rows per random block of the initial centers."""


def fill_initial_centers(weight: mx.nd.NDArray, seed: int, shard: Shard) -> None:
    """Fill the shard's rows with N(0, 0.01), each block of rows drawn from a generator
    keyed by (seed, block of the global class index): the same matrix on any number of
    processes, and no two shards alike (seeding every rank alike would give equal
    shards identical centers). Block by block into the stored dtype, so start-up holds
    one float32 block beside the rows: a float32 copy of a float16 shard would double
    its peak memory."""
    for block in range(shard.start // CENTER_BLOCK, (shard.stop - 1) // CENTER_BLOCK + 1):
        values = np.random.default_rng([seed, block]).standard_normal(
            (CENTER_BLOCK, weight.shape[1]), np.float32)
        values *= 0.01
        base = block * CENTER_BLOCK
        low, high = max(base, shard.start), min(base + CENTER_BLOCK, shard.stop)
        weight[low - shard.start:high - shard.start] = values[low - base:high - base]


def center_dtype(fp16_centers: bool) -> str:
    """How the rows are stored: float16 fits twice the classes in the same memory."""
    return "float16" if fp16_centers else "float32"


def tensor_size_problem(num_classes: int, world_size: int, embedding_size: int,
                        sample_rate: float = 1.0, global_batch: int = 0) -> str | None:
    """Why a rank's shard or its N x n logits would not fit in one MXNet array of this
    build, or None (the logits only when `global_batch` is given). Checked before
    anything is allocated, on every rank alike: MXNet itself fails only when the
    allocation is tried, and names no setting to change."""
    if mx.runtime.Features().is_enabled("INT64_TENSOR_SIZE"):
        return None
    rows = shard_of(num_classes, 0, world_size).count  # rank 0's shard is the largest
    if rows * embedding_size > INT32_ELEMENTS:
        fewest = math.ceil(num_classes / (INT32_ELEMENTS // embedding_size))
        return (f"{num_classes} classes over {world_size} processes give one process "
                f"{rows} x {embedding_size} class centers = {rows * embedding_size:,} "
                f"elements, {TOO_MANY_ELEMENTS}; use at least {fewest} processes")
    sampled = sampled_per_step(rows, sample_rate, global_batch)
    if global_batch * sampled > INT32_ELEMENTS:
        return (f"the logits of a global batch of {global_batch} against the {sampled} "
                f"centers one process samples have {global_batch * sampled:,} elements, "
                f"{TOO_MANY_ELEMENTS}; more processes do not help (their product is about "
                f"batch_size x sample_rate x num_classes): lower sample_rate or batch_size")
    return None


TOO_MANY_ELEMENTS = (f"more than the {INT32_ELEMENTS:,} one array of this MXNet build can "
                     "hold (it was built without USE_INT64_TENSOR_SIZE, as the released "
                     "wheels are)")


def num_sample(shard_size: int, sample_rate: float) -> int:
    """Centers a rank scores per step when the batch's positives fit in the sample."""
    return int(sample_rate * shard_size)


def sampled_per_step(shard_size: int, sample_rate: float, global_batch: int) -> int:
    """The most centers a rank scores in one step: the sample, or every positive of the
    global batch when they are more."""
    return min(shard_size, max(num_sample(shard_size, sample_rate), global_batch))


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank needs for Partial FC, apart from the backbone."""

    centers: int
    """The shard and its optimizer states, resident for the whole run."""
    working: int
    """Per step: the sampled rows (weights, gradient, states) and the logit matrices."""

    @property
    def total(self) -> int:
        return self.centers + self.working


def estimate_memory(
    num_classes: int,
    embedding_size: int,
    world_size: int,
    rank: int,
    sample_rate: float,
    global_batch: int,
    fp16_centers: bool = False,
    optimizer: CenterOptimizer | None = None,
) -> MemoryEstimate:
    """`optimizer`: the centers' (default: SGD with momentum, one state as wide as a row)."""
    optimizer = optimizer or SGD()
    rows = shard_of(num_classes, rank, world_size).count
    dtype = center_dtype(fp16_centers)
    states = optimizer.states(embedding_size, dtype).values()
    row_bytes = (embedding_size * np.dtype(dtype).itemsize
                 + sum(width * np.dtype(state_dtype).itemsize for width, state_dtype in states))
    sampled = sampled_per_step(rows, sample_rate, global_batch)
    fp32 = 4
    # float32 work copies of the sampled rows, their gradient and states, and the
    # buffers the rows stored in another dtype are gathered through
    gathered = (embedding_size * np.dtype(dtype).itemsize * (dtype != "float32")
                + sum(width * np.dtype(state_dtype).itemsize
                      for width, state_dtype in states if state_dtype != "float32"))
    sampled_rows = sampled * ((2 * embedding_size + sum(width for width, _ in states)) * fp32
                              + gathered)
    logits = 3 * global_batch * sampled * fp32
    return MemoryEstimate(rows * row_bytes, sampled_rows + logits)
