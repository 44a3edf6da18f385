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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import mxnet as mx
import numpy as np

from .buffers import INT32_ELEMENTS, Buffers
from .center_optimizers import CenterOptimizer
from .host_view import fill_threads, host_view, zeros
from .idle_rows import IdleSteps


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


MAX_SUBCENTERS = 16
"""The most sub-centers per class: the papers use 3; every one costs the step a GEMM
of the sampled rows' size, and the shard K times its rows."""


def subcenter_problem(subcenters: int) -> str | None:
    """Why a count of sub-centers per class cannot be used, or None."""
    if isinstance(subcenters, bool) or not isinstance(subcenters, int) or not (
            1 <= subcenters <= MAX_SUBCENTERS):
        return (f"num_subcenters={subcenters!r} must be a whole number from 1 (plain ArcFace) "
                f"to {MAX_SUBCENTERS}; sub-center ArcFace uses 3")
    return None


def subcenter_rows(classes: Shard, subcenters: int) -> Shard:
    """The rows of a shard of classes, each class's `subcenters` rows consecutive (class
    c's are rows cK ... cK + K - 1 of the C K x D matrix): cut by classes on any world
    size, a class's rows stay together."""
    return Shard(classes.start * subcenters, classes.count * subcenters)


def subcenter_index(classes: np.ndarray | None, subcenters: int) -> np.ndarray | None:
    """The shard rows of the sorted shard classes `classes` (None: all), still sorted."""
    if classes is None or subcenters == 1:
        return classes
    return (classes[:, None] * subcenters + np.arange(subcenters)).reshape(-1)


class ClassCenters:
    """This rank's rows of the centers, each optimizer state, and the sampler's stream.

    The rows are stored in blocks (CenterBlock) of at most `block_rows` rows, so that
    no array passes the 2^31 - 1 elements one MXNet array of the released builds can
    hold: 10M classes of 512 on one GPU are three blocks. A shard that fits is one
    block, and then every operation is that block's, unchanged. Sampled rows are
    gathered from their blocks into one array for the GEMMs, and each block's update
    takes its slice of the sample (the sampled rows are sorted, so a block's rows are
    contiguous in the sample).
    """

    def __init__(self, shard: Shard, embedding_size: int, optimizer: CenterOptimizer, *,
                 ctx: mx.Context, dtype: str = "float32", seed: int = 0, rank: int = 0,
                 lazy: bool = True, exact: bool = False, block_rows: int | None = None,
                 initialize: bool = True) -> None:
        """`lazy=False`: every row takes every step (dense); `exact`: the sampled rows
        first take the steps they missed (idle_rows.py, SGD only)."""
        if dtype == "float16" and not lazy:
            raise ValueError("lazy_update=False needs float32 centers")
        if exact and optimizer.name != "sgd":
            raise ValueError(f"the exact lazy update replays SGD's steps; the "
                             f"{optimizer.name} optimizer of the centers has no such replay")
        self.shard, self.embedding_size, self.optimizer = shard, embedding_size, optimizer
        self.ctx, self.dtype = ctx, dtype
        self.block_rows = block_rows or rows_per_block(embedding_size)
        self.blocks = [CenterBlock(Shard(start, min(self.block_rows, shard.stop - start)),
                                   embedding_size, optimizer, ctx=ctx, dtype=dtype, lazy=lazy)
                       for start in range(shard.start, shard.stop, self.block_rows)]
        if initialize:  # else the caller loads every row (a checkpoint) next
            self.draw_initial(seed)
        self.rng = np.random.default_rng([seed, rank])
        self.buffers = Buffers(ctx)
        self._last_split = None  # (index, its split): see _split
        self.idle = (IdleSteps(shard.count, optimizer.momentum, optimizer.weight_decay)
                     if exact else None)

    @property
    def weight(self) -> mx.nd.NDArray:
        """The rows, when they are one block (state_dict() has them in any case)."""
        return self._only_block().weight

    @property
    def states(self) -> dict[str, mx.nd.NDArray]:
        """{name: rows} of each optimizer state, when the rows are one block."""
        return self._only_block().states

    def _only_block(self) -> CenterBlock:
        if len(self.blocks) > 1:
            raise ValueError(f"this rank's {self.shard.count} centers are stored in "
                             f"{len(self.blocks)} blocks of {self.block_rows} rows; use "
                             "arrays() or state_dict()")
        return self.blocks[0]

    def state_names(self) -> list[str]:
        return sorted(self.blocks[0].states)

    def widths(self) -> dict[str, int]:
        """Columns of each array of state_dict(): the weight, then every state."""
        return {name: array.shape[1] for name, array in self.blocks[0].arrays().items()}

    def arrays(self) -> dict[str, list[mx.nd.NDArray]]:
        """{"weight": [rows of each block], <state>: [...], ...} on the device (a
        checkpoint copies a part at a time to the host)."""
        return {name: [block.arrays()[name] for block in self.blocks] for name in self.widths()}

    def state_dict(self) -> dict:
        """{"weight": rows, <state>: rows, ..., "sampler": the generator's state}, every
        row current."""
        self.bring_all_current()
        return {**{name: np.concatenate([part.asnumpy() for part in parts])
                   for name, parts in self.arrays().items()},
                "sampler": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        """Replace this rank's rows (e.g. cut from a checkpoint saved at another W):
        each array a numpy array, or anything sliced by rows into one (checkpoint's
        view of the saved shards). The weight is required; a state left out starts at
        zero (--load-from), a missing sampler keeps the current stream."""
        unknown = set(state) - {*self.widths(), "sampler"}
        if unknown or "weight" not in state:
            raise ValueError(f"center state {sorted(state)}: expected weight, sampler and "
                             f"the {self.optimizer.name} states {self.state_names()}")
        for name, width in self.widths().items():
            if name in state and tuple(state[name].shape) != (self.shard.count, width):
                raise ValueError(f"{name} shard has shape {tuple(state[name].shape)}, this "
                                 f"rank expects {(self.shard.count, width)}")
        for block in self.blocks:
            low, high = block.shard.start - self.shard.start, block.shard.stop - self.shard.start
            block.load({name: rows[low:high] for name, rows in state.items()
                        if name != "sampler"})
        if "sampler" in state:
            self.rng.bit_generator.state = state["sampler"]
        if self.idle is not None:
            self.idle.all_current()

    def draw_initial(self, seed: int) -> None:
        """The rows a run starting afresh has (fill_initial_centers), e.g. under an
        imported backbone."""
        fill_initial_centers([block.weight for block in self.blocks], seed, self.shard)

    def restart_sampler(self, seed: int, rank: int, step: int) -> None:
        """A fresh negative-sampling stream, e.g. after a resume on another world size
        (the saved streams belong to other ranks)."""
        self.rng = np.random.default_rng([seed, rank, step])

    def sampled_weights(self, index: np.ndarray | None) -> mx.nd.NDArray:
        """The rows `index` (sorted; all: None) in float32, valid until the next call
        (CenterBlock.sampled_weights); from several blocks, joined in one buffer."""
        parts = [block.sampled_weights(rows) for block, rows, _ in self._split(index)]
        if len(parts) == 1:
            return parts[0]
        return mx.nd.concat(*parts, dim=0, out=self.buffers.get(
            "sampled weights", (len(index), self.embedding_size)))

    def bring_current(self, index: np.ndarray | None) -> None:
        """With the exact lazy update, give the rows `index` (sorted; None: all, which
        are current already) the steps they missed since they were last sampled."""
        if self.idle is None or index is None:
            return
        coefficients = self.idle.coefficients(index)
        if coefficients is None:
            return
        for block, rows, taken in self._split(index):
            self.optimizer.replay(block, rows, coefficients[taken])
        self.idle.last[index] = self.idle.done

    def bring_all_current(self) -> None:
        """Every row given the steps it missed, a part at a time: before a checkpoint,
        so that it holds the rows a dense update would have, and no history."""
        if self.idle is None or self.idle.start == self.idle.done:
            return
        step = max(1, HOST_CHUNK_ELEMENTS // self.embedding_size)
        for low in range(0, self.shard.count, step):
            self.bring_current(np.arange(low, min(low + step, self.shard.count)))
        self.idle.all_current()

    def update(self, index: np.ndarray | None, w: mx.nd.NDArray, grad: mx.nd.NDArray,
               lr: float) -> None:
        """One optimizer step for rows `index` (sorted; None: all) whose float32 values
        are `w` (from sampled_weights) and whose gradient is `grad`. Not lazy, a block
        the sample missed takes its step too, with a zero gradient."""
        parts = self._split(index)
        for block, rows, taken in parts:
            if len(parts) == 1:  # w itself: an update of the weight in place stays one
                self.optimizer.update(block, rows, w, grad, lr)
            else:
                self.optimizer.update(block, rows, w[taken], grad[taken], lr)
        touched = {id(block) for block, _, _ in parts}
        for block in self.blocks:
            if not block.lazy and id(block) not in touched:
                self.optimizer.update(block, None, block.weight, block.zero_gradient(), lr)
        if self.idle is not None:
            self.idle.stepped(index, lr)

    def _split(self, index: np.ndarray | None):
        """(block, its rows of `index` as an NDArray or None for all, the slice of the
        sample they are) for each block the sample touches. The step's gather and its
        update split the same index: the second call reuses the first's."""
        if self._last_split is not None and same_rows(self._last_split[0], index):
            return self._last_split[1]
        parts = self._split_anew(index)
        self._last_split = (None if index is None else index.copy(), parts)
        return parts

    def _split_anew(self, index: np.ndarray | None):
        if index is None:
            if len(self.blocks) > 1:
                raise ValueError(f"every one of this rank's {self.shard.count} centers "
                                 "cannot be scored at once: they are more than one MXNet "
                                 "array holds; lower sample_rate")
            return [(self.blocks[0], None, slice(None))]
        bounds = np.searchsorted(index, [b.shard.start - self.shard.start for b in self.blocks]
                                 + [self.shard.count])
        return [(block, mx.nd.array(index[low:high] - (block.shard.start - self.shard.start),
                                    ctx=self.ctx, dtype="int64"), slice(low, high))
                for block, low, high in zip(self.blocks, bounds[:-1], bounds[1:])
                if high > low]


def same_rows(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    """Whether two row selections (None: all) are equal."""
    return a is b or (a is not None and b is not None and np.array_equal(a, b))


class CenterBlock:
    """Consecutive rows of a shard with their optimizer states: what an optimizer
    updates (center_optimizers/).

    `weight` is stored in `dtype` (float16 halves the rows); each optimizer state in
    the dtype its optimizer asks for. An update runs on the rows a step sampled (or,
    with lazy=False, on every row, with a zero gradient where not sampled, as a dense
    optimizer over the shard does).
    """

    def __init__(self, shard: Shard, embedding_size: int, optimizer: CenterOptimizer, *,
                 ctx: mx.Context, dtype: str, lazy: bool) -> None:
        self.shard, self.ctx, self.dtype, self.lazy = shard, ctx, dtype, lazy
        self.weight = mx.nd.empty((shard.count, embedding_size), ctx=ctx, dtype=dtype)
        self.states = {name: zeros((shard.count, width), ctx, state_dtype, fill_threads())
                       for name, (width, state_dtype)
                       in optimizer.states(embedding_size, dtype).items()}
        self.buffers = Buffers(ctx)

    def arrays(self) -> dict[str, mx.nd.NDArray]:
        return {"weight": self.weight, **self.states}

    def zero_gradient(self) -> mx.nd.NDArray:
        """A zero gradient for every row (a dense step of a block no sample reached),
        allocated once: the optimizers only read it."""
        if not hasattr(self, "_zero_gradient"):
            self._zero_gradient = mx.nd.zeros(self.weight.shape, ctx=self.ctx)
        return self._zero_gradient

    def load(self, rows: dict) -> None:
        """Replace the weight (and the states given; the others start at zero) with
        host rows, a part at a time: a block can be several GiB."""
        for name, array in self.arrays().items():
            if name not in rows:
                array[:] = 0
                continue
            step = max(1, HOST_CHUNK_ELEMENTS // array.shape[1])
            for low in range(0, self.shard.count, step):
                array[low:low + step] = np.asarray(rows[name][low:low + step])

    def sampled_weights(self, index: mx.nd.NDArray | None) -> mx.nd.NDArray:
        """The rows `index` (all: None) in float32; the weight itself when it is float32
        and every row is taken, so an update of it in place is the update. Otherwise a
        buffer kept for the next step: valid until the next call."""
        return self._float32_rows("weight", self.weight, index)

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

HOST_CHUNK_ELEMENTS = 2**25
"""Elements copied between host and device at a time (128 MiB of float32)."""


def rows_per_block(embedding_size: int) -> int:
    """The most rows of `embedding_size` one MXNet array holds (4,194,303 of 512)."""
    return INT32_ELEMENTS // embedding_size


def fill_initial_centers(blocks: list[mx.nd.NDArray], seed: int, shard: Shard,
                         in_place: bool | None = None) -> None:
    """Fill the shard's rows (stored in `blocks`, consecutive) with N(0, 0.01), each
    CENTER_BLOCK of rows drawn from a generator keyed by (seed, block of the global
    class index): the same matrix on any number of processes, and no two shards alike
    (seeding every rank alike would give equal shards identical centers).

    numpy draws 2.3 s of float32 normals per GiB on one core: the random blocks are
    drawn by several threads (numpy's generators release the GIL). On the CPU
    (`in_place`) each thread scales its rows straight into the arrays' memory, in
    the stored dtype; on a GPU the threads make host chunks (128 MiB each, two per
    thread ahead of the copies this thread makes). Either way start-up holds a few
    chunks beside the rows, never a float32 copy of a float16 shard."""
    in_place = blocks[0].context.device_type == "cpu" if in_place is None else in_place
    width, dtype = blocks[0].shape[1], np.dtype(blocks[0].dtype)
    views = [host_view(block) for block in blocks] if in_place else []
    bounds = np.cumsum([shard.start] + [block.shape[0] for block in blocks]).tolist()
    first, last = shard.start // CENTER_BLOCK, (shard.stop - 1) // CENTER_BLOCK
    per_chunk = max(1, HOST_CHUNK_ELEMENTS // (CENTER_BLOCK * width))
    chunks = [range(low, min(low + per_chunk, last + 1))
              for low in range(first, last + 1, per_chunk)]

    def draw(chunk: range) -> list[tuple[int, int, np.ndarray]]:
        """Fill the rows of these random blocks; (block, row, host rows) to copy."""
        values, copies = np.empty((CENTER_BLOCK, width), np.float32), []
        for random_block in chunk:
            np.random.default_rng([seed, random_block]).standard_normal(out=values,
                                                                        dtype=np.float32)
            base = random_block * CENTER_BLOCK
            for k, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
                low, high = max(base, start), min(base + CENTER_BLOCK, stop)
                if low >= high:
                    continue
                rows = values[low - base:high - base]
                if in_place:  # computed in float32, stored rounded: as a float32 copy would
                    np.multiply(rows, CENTER_SCALE, out=views[k][low - start:high - start],
                                casting="unsafe")
                else:
                    copies.append((k, low - start,
                                   (rows * CENTER_SCALE).astype(dtype, copy=False)))
        return copies

    threads = fill_threads()
    with ThreadPoolExecutor(threads) as pool:
        ahead = 2 * threads
        pending = [pool.submit(draw, chunk) for chunk in chunks[:ahead]]
        for i in range(len(chunks)):
            copies, pending[i] = pending[i].result(), None  # freed once copied
            if i + ahead < len(chunks):
                pending.append(pool.submit(draw, chunks[i + ahead]))
            for k, row, rows in copies:
                blocks[k][row:row + len(rows)] = rows


CENTER_SCALE = np.float32(0.01)
"""The initial centers' standard deviation."""


def center_dtype(fp16_centers: bool) -> str:
    """How the rows are stored: float16 fits twice the classes in the same memory."""
    return "float16" if fp16_centers else "float32"


def tensor_size_problem(num_classes: int, world_size: int, embedding_size: int,
                        sample_rate: float = 1.0, global_batch: int = 0,
                        subcenters: int = 1, micro_batches: int = 1) -> str | None:
    """Why the n x D sampled centers or the N x n logits of a step would not fit in one
    MXNet array of this build, or None (the logits only when `global_batch` is given);
    with sub-centers, n counts each sampled class's `subcenters` rows; with
    `micro_batches` (gradient accumulation) the sample holds the positives of all of
    them, and each micro-batch's N rows meet it.
    Checked before anything is allocated, on every rank alike: MXNet itself fails only
    when the allocation is tried, and names no setting to change. (The shard itself is
    stored in blocks that each fit: ClassCenters.)"""
    if mx.runtime.Features().is_enabled("INT64_TENSOR_SIZE"):
        return None
    rows = shard_of(num_classes, 0, world_size).count  # rank 0's shard is the largest
    sampled = sampled_per_step(rows, sample_rate, global_batch * micro_batches) * subcenters
    if (sampled + SPARE_CENTERS) * embedding_size > INT32_ELEMENTS:
        fewest = math.ceil(num_classes * sample_rate * subcenters
                           / (INT32_ELEMENTS // embedding_size - SPARE_CENTERS))
        size = (sampled + SPARE_CENTERS) * embedding_size
        return (f"one process scores {sampled:,} of its {rows * subcenters:,} class centers "
                f"per step: "
                f"({sampled:,} + {SPARE_CENTERS} spare) x {embedding_size} = {size:,} elements, "
                f"{TOO_MANY_ELEMENTS}; lower sample_rate or use at least {fewest} processes")
    if global_batch * (sampled + SPARE_CENTERS) > INT32_ELEMENTS:
        return (f"the logits of a global batch of {global_batch} against the {sampled} "
                f"centers one process samples (+{SPARE_CENTERS} spare) have "
                f"{global_batch * (sampled + SPARE_CENTERS):,} elements, "
                f"{TOO_MANY_ELEMENTS}; more processes do not help (their product is about "
                f"batch_size x sample_rate x num_classes): lower sample_rate or batch_size")
    return None


TOO_MANY_ELEMENTS = (f"more than the {INT32_ELEMENTS:,} one array of this MXNet build can "
                     "hold (it was built without USE_INT64_TENSOR_SIZE, as the released "
                     "wheels are)")


def sharding_problem(num_classes: int, world_size: int, sample_rate: float) -> str | None:
    """Why `num_classes` cannot be sharded and sampled over `world_size` processes, or
    None. The smallest shard decides, so every rank gives the same answer: one rank
    refusing alone would leave the others waiting in the first collective."""
    smallest_shard = num_classes // world_size
    if smallest_shard == 0:
        return (f"num_classes={num_classes} cannot be sharded over {world_size} processes; "
                "use fewer processes")
    if num_sample(smallest_shard, sample_rate) == 0:
        return (f"sample_rate={sample_rate} samples 0 of the {smallest_shard} class centers "
                f"a process holds ({num_classes} classes / {world_size} processes): no "
                f"negatives would be scored. Use sample_rate >= "
                f"{rounded_up(1 / smallest_shard):g}")
    return None


def rounded_up(value: float, digits: int = 3) -> float:
    """`value` rounded up to `digits` significant digits (a rate rounded down could
    sample nothing again: 1/3 shown as 0.333)."""
    step = 10.0 ** (math.floor(math.log10(value)) - digits + 1)
    return round(math.ceil(value / step - 1e-6) * step, 12)


def num_sample(shard_size: int, sample_rate: float) -> int:
    """Centers a rank scores per step when the batch's positives fit in the sample."""
    return int(sample_rate * shard_size)


def sampled_per_step(shard_size: int, sample_rate: float, global_batch: int) -> int:
    """The most centers a rank scores in one step: the sample, or every positive of the
    global batch when they are more."""
    return min(shard_size, max(num_sample(shard_size, sample_rate), global_batch))


SPARE_CENTERS = 1
"""The zero row after the sampled centers in the step's arrays, whose column of the
logits carries each row's max through the softmax (rows.spare_column). One, by
construction, not a setting: the sizes checked and estimated count it."""
