"""Partial FC: class centers sharded over the ranks, scored on a sample per step.

Rank r of W owns the contiguous rows [start, start + count) of the C x D center
matrix, with count = C // W + (r < C % W): balanced to within one row, and
computable by every rank (and by a resume on another world size) from (C, W) alone.

One step, on every rank (N = the global batch, n = this rank's sampled centers):
  1. allgather labels (with each row's rank and checks) and the embeddings: N x D;
  2. sample: every positive class in the shard, plus uniform negatives up to n;
  3. G = x_hat @ w.T (one FullyConnected), cos = G / |w|, margin on the targets;
  4. allreduce(max), allreduce(sum exp, target logit): the exact softmax over the
     union of all ranks' samples, and the cross-entropy averaged over N;
  5. gradients: sampled centers (kept for `step`) and all N embeddings, summed over
     ranks with one allreduce; each rank keeps the rows of its own embeddings.
The centers are normalized by scaling G's columns rather than w's rows: N x n
multiplies instead of n x D, and w_hat is never materialized.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import horovod.mxnet as hvd
import mxnet as mx
import numpy as np

from .losses import CombinedMargin


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


def num_sample(shard_size: int, sample_rate: float) -> int:
    """Centers a rank scores per step when the batch's positives fit in the sample."""
    return int(sample_rate * shard_size)


class PartialFCInputError(ValueError):
    """Bad labels or embeddings on some rank; raised identically on every rank."""


class PartialFC:
    """The classifier of one rank: its shard of class centers, with momentum.

    Use it inside any MXNet training loop launched under Horovod:

        pfc = PartialFC(num_classes, 512, rank=hvd.rank(), world_size=hvd.size(),
                        ctx=ctx, sample_rate=0.1, margin=(1.0, 0.5, 0.0), scale=64.0)
        with autograd.record():
            embeddings = backbone(images)
        loss, grad = pfc.forward_backward(embeddings, labels)
        embeddings.backward(grad)            # then the backbone's optimizer step
        pfc.step(lr)                         # sparse SGD on the sampled centers
    """

    def __init__(
        self,
        num_classes: int,
        embedding_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        ctx: mx.Context | None = None,
        sample_rate: float = 1.0,
        margin: tuple = (1.0, 0.5, 0.0),
        scale: float = 64.0,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        fp16_centers: bool = False,
        seed: int = 0,
        timer=None,
        lazy_update: bool = True,
    ) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate={sample_rate} must be in (0, 1]")
        if fp16_centers and not lazy_update:
            raise ValueError("lazy_update=False needs float32 centers")
        if num_classes < world_size:
            raise ValueError(f"{num_classes} classes cannot be sharded over {world_size} ranks")
        self.num_classes, self.embedding_size = num_classes, embedding_size
        self.rank, self.world_size = rank, world_size
        self.ctx = ctx or mx.cpu()
        self.shard = shard_of(num_classes, rank, world_size)
        self.num_sample = num_sample(self.shard.count, sample_rate)
        self.margin = CombinedMargin(*margin, scale=scale)
        self.momentum_factor, self.weight_decay = momentum, weight_decay
        self.lazy_update = lazy_update
        self.dtype = "float16" if fp16_centers else "float32"
        self.seed = seed
        self.rng = np.random.default_rng([seed, rank])
        self.timer = timer or NoTimer()
        shape = (self.shard.count, embedding_size)
        self.weight = mx.nd.array(initial_centers(seed, self.shard, embedding_size),
                                  ctx=self.ctx, dtype=self.dtype)
        self.momentum = mx.nd.zeros(shape, ctx=self.ctx, dtype=self.dtype)
        self._pending = None  # (index, sampled weights, their gradient) until step()
        self._last_rows = None  # shard rows sampled in the last step; None: all
        self._grad_buffer = None  # d loss / d sampled centers, reused across steps

    @property
    def sampled_classes(self) -> np.ndarray:
        """Global class ids this rank scored in the last step."""
        rows = np.arange(self.shard.count) if self._last_rows is None else self._last_rows
        return rows + self.shard.start

    # ----- checkpointing -----
    def load_shard(self, weight: np.ndarray, momentum: np.ndarray) -> None:
        """Replace this rank's rows (e.g. cut from a checkpoint saved at another W)."""
        expected = (self.shard.count, self.embedding_size)
        for name, array in (("weight", weight), ("momentum", momentum)):
            if tuple(array.shape) != expected:
                raise ValueError(f"{name} shard has shape {tuple(array.shape)}, rank "
                                 f"{self.rank} of {self.world_size} expects {expected}")
        self.weight = mx.nd.array(weight, ctx=self.ctx, dtype=self.dtype)
        self.momentum = mx.nd.array(momentum, ctx=self.ctx, dtype=self.dtype)

    # ----- one step -----
    def forward_backward(self, embeddings: mx.nd.NDArray, labels,
                         grad_scale: float = 1.0) -> tuple:
        """Loss over the global batch and the gradient for this rank's embeddings.

        Returns (loss, grad): loss an NDArray of shape (1,), the same on every rank;
        grad shaped and typed like `embeddings`, multiplied by `grad_scale` (the
        loss scale of float16 training) in float32, before it is cast: scaling a
        float16 gradient afterwards cannot bring back the values it flushed to zero.
        """
        with mx.autograd.pause():  # our own backward; never part of the caller's graph
            return self._forward_backward(embeddings, labels, grad_scale)

    def _forward_backward(self, embeddings: mx.nd.NDArray, labels, grad_scale: float) -> tuple:
        with self.timer.phase("communication"):
            batch = self._gather(embeddings, labels)
        with self.timer.phase("sampling"):
            index, target_col = self.sample(batch.labels)
        with self.timer.phase("compute"):
            x = batch.embeddings.as_in_context(self.ctx)
            x_norm_inv = 1 / mx.nd.norm(x, axis=1, keepdims=True)
            x_hat = x * x_norm_inv
            w = self._sampled_weights(index)
        with self.timer.phase("gemm"):
            gram = self._gram(x_hat, w)
        with self.timer.phase("compute"):
            logits, targets, col_scale = self._logits(gram, w, target_col)
        with self.timer.phase("communication"):
            row_max = hvd.allreduce(logits.max(axis=1), op=hvd.Max, name="pfc.max")
        with self.timer.phase("compute"):
            mx.nd.broadcast_sub(logits, row_max.reshape((-1, 1)), out=logits)
            exp = mx.nd.exp(logits, out=logits)
            target_logit = mx.nd.zeros_like(row_max)
            if targets.rows is not None:
                target_logit[targets.rows] = targets.logits
            sums = mx.nd.stack(row_sums(exp), target_logit, axis=1)
        with self.timer.phase("communication"):
            sums = hvd.allreduce(sums, op=hvd.Sum, name="pfc.sum")
        with self.timer.phase("compute"):
            exp_sum, target_logit = sums[:, 0], sums[:, 1]
            loss = (mx.nd.log(exp_sum) + row_max - target_logit).mean()
            grad_gram = self._grad_gram(exp, exp_sum, col_scale, targets)
            # |w_j| also enters through cos = G / |w_j|: its part of d loss / d w_j is
            # -w_j / |w_j|^2 * sum_i dG_ij G_ij. G's buffer is free for the product (the
            # recorded GEMM's backward needs only its inputs).
            dg_g = mx.nd.elemwise_mul(grad_gram, gram, out=gram)
            per_row = col_sums(dg_g) * (col_scale / self.margin.scale) ** 2
        with self.timer.phase("gemm"):
            gram.backward(grad_gram)
        with self.timer.phase("compute"):
            grad_w = w.grad
            grad_w -= mx.nd.broadcast_mul(w, per_row.reshape((-1, 1)))
            grad_x_hat = x_hat.grad
            grad_x = grad_x_hat - x_hat * (x_hat * grad_x_hat).sum(axis=1, keepdims=True)
            grad_x = grad_x * (x_norm_inv * grad_scale)
        with self.timer.phase("communication"):
            grad_x = hvd.allreduce(grad_x, op=hvd.Sum, name="pfc.grad_x")
        self._pending = (index, w, grad_w)
        mine = grad_x[batch.mine_start:batch.mine_stop]
        return loss, mine.astype(embeddings.dtype, copy=False)

    def step(self, lr: float) -> None:
        """SGD with momentum and weight decay on the sampled rows only.

        float32 shards use MXNet's lazy row-sparse update, which touches exactly the
        sampled rows of the weights and momentum in place (no gather or scatter);
        float16 shards are updated in float32 and stored back rounded. With
        lazy_update=False every row takes its momentum and weight decay every step
        (a zero gradient where not sampled), as a dense optimizer over the shard does.
        """
        if self._pending is None:
            raise RuntimeError("PartialFC.step() needs a forward_backward() first")
        index, w, grad_w = self._pending
        self._pending = None
        options = dict(lr=lr, momentum=self.momentum_factor, wd=self.weight_decay)
        with self.timer.phase("update"):
            if self.dtype == "float16":
                self._update_rounded(index, w, grad_w, options)
            elif index is None:
                mx.nd.sgd_mom_update(self.weight, grad_w, self.momentum, out=self.weight,
                                     **options)
            else:
                rows = mx.nd.sparse.row_sparse_array((grad_w, index), shape=self.weight.shape,
                                                     ctx=self.ctx)
                mx.nd.sgd_mom_update(self.weight, rows, self.momentum,
                                     lazy_update=self.lazy_update, out=self.weight, **options)

    def _update_rounded(self, index, w, grad_w, options: dict) -> None:
        rows = slice(None) if index is None else index
        momentum = self.momentum if index is None else mx.nd.take(self.momentum, index)
        momentum = momentum.astype("float32")
        mx.nd.sgd_mom_update(w, grad_w, momentum, out=w, **options)
        self.weight[rows] = w.astype("float16")
        self.momentum[rows] = momentum.astype("float16")

    # ----- the pieces -----
    def _gather(self, embeddings: mx.nd.NDArray, labels) -> GatheredBatch:
        """Allgather, after every rank has seen every rank's labels and checks."""
        labels = labels.asnumpy() if isinstance(labels, mx.nd.NDArray) else np.asarray(labels)
        labels = labels.reshape(len(labels), -1)[:, 0] if labels.ndim > 1 else labels
        rows = embeddings.shape[0]
        width = embeddings.shape[1] if embeddings.ndim == 2 else -1
        finite = np.ones(len(labels))
        if rows == len(labels) and width > 0:
            finite = mx.nd.contrib.isfinite(embeddings.astype("float32")).min(axis=1).asnumpy()
        meta = np.stack([labels.astype(np.float64), np.full(len(labels), self.rank),
                         np.full(len(labels), rows), np.full(len(labels), width), finite], 1)
        meta = hvd.allgather(mx.nd.array(meta, dtype="float64"), name="pfc.meta").asnumpy()
        self._validate(meta)
        gathered = hvd.allgather(embeddings.astype("float32", copy=False), name="pfc.embeddings")
        mine = np.flatnonzero(meta[:, 1] == self.rank)
        start = int(mine[0]) if len(mine) else 0
        return GatheredBatch(gathered, meta[:, 0].astype(np.int64), start, start + len(mine))

    def _validate(self, meta: np.ndarray) -> None:
        label, rank, rows, width, finite = meta.T
        problems = []
        for r in np.unique(rank).astype(int):
            mine = rank == r
            if rows[mine][0] != mine.sum() or width[mine][0] != self.embedding_size:
                problems.append(f"rank {r} passed {int(rows[mine][0])} x {int(width[mine][0])} "
                                f"embeddings with {int(mine.sum())} labels; expected "
                                f"{int(mine.sum())} x {self.embedding_size}")
                continue
            bad = mine & ((label != np.floor(label)) | (label < 0) | (label >= self.num_classes))
            if bad.any():
                problems.append(f"rank {r} passed labels that are not integers in "
                                f"[0, {self.num_classes}): {label[bad][:8].tolist()}")
            nonfinite = mine & (finite == 0)
            if nonfinite.any():
                local_rows = np.flatnonzero(nonfinite[mine])[:8].tolist()
                problems.append(f"rank {r} passed non-finite embeddings (NaN/Inf) in batch rows "
                                f"{local_rows}")
        if problems:
            raise PartialFCInputError("Partial FC input rejected: " + "; ".join(problems))

    def sample(self, labels: np.ndarray) -> tuple:
        """Choose this step's centers for the global batch's `labels`.

        Every positive class in the shard is kept, even when there are more than
        num_sample of them (dropping one would corrupt that sample's loss); the rest
        are uniform negatives drawn without replacement from this rank's own stream.
        Returns the sorted shard rows as an NDArray (None: every row), and each
        label's column among them (-1 when the class lives on another rank).
        """
        local = labels - self.shard.start
        in_shard = (local >= 0) & (local < self.shard.count)
        positives = np.unique(local[in_shard])
        if self.num_sample >= self.shard.count:
            index = None
            target_col = np.where(in_shard, local, -1)
        else:
            wanted = max(self.num_sample - len(positives), 0)
            negatives = sample_excluding(self.rng, self.shard.count, positives, wanted)
            index = np.sort(np.concatenate([positives, negatives]))
            target_col = np.where(in_shard, np.searchsorted(index, local), -1)
        self._last_rows = index
        index_nd = None if index is None else mx.nd.array(index, ctx=self.ctx, dtype="int64")
        return index_nd, target_col

    def _sampled_weights(self, index) -> mx.nd.NDArray:
        w = self.weight if index is None else mx.nd.take(self.weight, index)
        return w.astype("float32", copy=False)

    def _gram(self, x_hat: mx.nd.NDArray, w: mx.nd.NDArray) -> mx.nd.NDArray:
        """G = x_hat @ w.T, recorded: its backward (both GEMMs) runs in oneDNN, the
        fastest of MXNet's GEMM paths measured on CPU (docs/benchmarks.md). The
        centers' gradient lands in a buffer kept across steps: attach_grad would
        allocate and zero n x D floats every step."""
        if self._grad_buffer is None or self._grad_buffer.shape != w.shape:
            self._grad_buffer = mx.nd.empty(w.shape, ctx=self.ctx)
        mx.autograd.mark_variables([w], [self._grad_buffer], grad_reqs="write")
        x_hat.attach_grad()
        with mx.autograd.record():
            return mx.nd.FullyConnected(x_hat, w, num_hidden=w.shape[0], no_bias=True)

    def _logits(self, gram, w, target_col: np.ndarray) -> tuple:
        """Scaled cosines with the margin on the targets in this shard."""
        col_scale = self.margin.scale / mx.nd.sqrt(row_sums(mx.nd.square(w)))  # s / |w_j|
        logits = mx.nd.broadcast_mul(gram, col_scale.reshape((1, -1)))
        targets = Targets.of(target_col, self.ctx)
        if targets.rows is not None:
            cos = mx.nd.gather_nd(logits, targets.where) / self.margin.scale
            targets.logits, targets.slopes = self.margin(cos)
            set_entries(logits, targets.where, targets.logits)
        return logits, targets, col_scale

    def _grad_gram(self, exp, exp_sum, col_scale, targets) -> mx.nd.NDArray:
        """d loss / d G, in the buffer that held exp(logits - max)."""
        batch = exp.shape[0]
        prob = mx.nd.broadcast_div(exp, exp_sum.reshape((-1, 1)), out=exp)
        if targets.rows is not None:
            p_target = mx.nd.gather_nd(prob, targets.where)
            col = mx.nd.take(col_scale, targets.cols)
            # d logit / d G_ij = slope * (1/|w_j|) on a target, s/|w_j| elsewhere
            target_grad = (p_target - 1) * targets.slopes * col / self.margin.scale
        grad = mx.nd.broadcast_mul(prob, col_scale.reshape((1, -1)) / batch, out=prob)
        if targets.rows is not None:
            set_entries(grad, targets.where, target_grad / batch)
        return grad


@dataclass
class GatheredBatch:
    embeddings: mx.nd.NDArray
    labels: np.ndarray
    mine_start: int
    mine_stop: int


@dataclass
class Targets:
    """The (row, column) of every target logit that lives in this rank's sample."""

    rows: mx.nd.NDArray | None
    cols: mx.nd.NDArray | None
    where: mx.nd.NDArray | None
    logits: mx.nd.NDArray | None = None
    slopes: mx.nd.NDArray | None = None

    @classmethod
    def of(cls, target_col: np.ndarray, ctx: mx.Context) -> Targets:
        rows = np.flatnonzero(target_col >= 0)
        if len(rows) == 0:
            return cls(None, None, None)
        cols = target_col[rows]
        as_nd = lambda a: mx.nd.array(a, ctx=ctx, dtype="int64")  # noqa: E731
        return cls(as_nd(rows), as_nd(cols), as_nd(np.stack([rows, cols])))


# Row and column sums as GEMVs against a vector of ones: on CPU these run 2-10x
# faster than MXNet's sum(axis=...) reductions (docs/benchmarks.md).
def row_sums(matrix: mx.nd.NDArray) -> mx.nd.NDArray:
    ones = mx.nd.ones((1, matrix.shape[1]), ctx=matrix.context, dtype=matrix.dtype)
    return mx.nd.FullyConnected(matrix, ones, num_hidden=1, no_bias=True).reshape(-1)


def col_sums(matrix: mx.nd.NDArray) -> mx.nd.NDArray:
    ones = mx.nd.ones((1, matrix.shape[0]), ctx=matrix.context, dtype=matrix.dtype)
    return mx.nd.dot(ones, matrix).reshape(-1)


def set_entries(matrix: mx.nd.NDArray, where: mx.nd.NDArray, values: mx.nd.NDArray) -> None:
    """matrix[where[0], where[1]] = values, in place."""
    mx.nd._internal._scatter_set_nd(lhs=matrix, rhs=values, indices=where,
                                    shape=matrix.shape, out=matrix)


CENTER_BLOCK = 4096
"""Rows per random block of the initial centers."""


def initial_centers(seed: int, shard: Shard, embedding_size: int) -> np.ndarray:
    """N(0, 0.01) rows for the shard's classes, each drawn from a generator keyed by
    (seed, block of the global class index): the same matrix on any number of
    processes, and no two shards alike (seeding every rank alike would give equal
    shards identical centers)."""
    centers = np.empty((shard.count, embedding_size), np.float32)
    for block in range(shard.start // CENTER_BLOCK, (shard.stop - 1) // CENTER_BLOCK + 1):
        values = np.random.default_rng([seed, block]).standard_normal(
            (CENTER_BLOCK, embedding_size), np.float32)
        base = block * CENTER_BLOCK
        low, high = max(base, shard.start), min(base + CENTER_BLOCK, shard.stop)
        centers[low - shard.start:high - shard.start] = values[low - base:high - base]
    centers *= 0.01
    return centers


def sample_excluding(rng: np.random.Generator, population: int, excluded: np.ndarray,
                     count: int) -> np.ndarray:
    """`count` distinct rows drawn uniformly from range(population) minus `excluded`
    (sorted, distinct): the free rows are numbered 0..free-1, drawn, then mapped back."""
    slots = distinct_uniform(rng, population - len(excluded), count)
    # the k-th free row is k + (the number of excluded rows at or before it)
    return slots + np.searchsorted(excluded - np.arange(len(excluded)), slots, side="right")


def distinct_uniform(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """k distinct ints, every k-subset of range(n) equally likely.

    Memory and time scale with k, not n (numpy's choice permutes all n): draw with
    replacement, keep the distinct values, top up, then keep a random k of them;
    each step is symmetric in the values, so the subset is uniform. Past n / 2 it
    draws the rows to leave out instead, where k is of the order of n anyway.
    """
    if k >= n:
        return np.arange(n)
    if k > n // 2:
        return np.setdiff1d(np.arange(n), distinct_uniform(rng, n, n - k), assume_unique=True)
    chosen = np.empty(0, np.int64)
    while len(chosen) < k:
        missing = k - len(chosen)
        draws = rng.integers(0, n, missing + missing // 8 + 16)
        chosen = np.unique(np.concatenate([chosen, draws]))
    return rng.choice(chosen, size=k, replace=False)


class NoTimer:
    """The default: no synchronisation, no timing."""

    def phase(self, name: str):
        return contextlib.nullcontext()


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank needs for Partial FC, apart from the backbone."""

    centers: int
    """The shard and its momentum, resident for the whole run."""
    working: int
    """Per step: the sampled rows (weights, gradient, momentum) and the logit matrices."""

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
) -> MemoryEstimate:
    rows = shard_of(num_classes, rank, world_size).count
    center_bytes = 2 if fp16_centers else 4
    sampled = min(rows, max(num_sample(rows, sample_rate), global_batch))
    fp32 = 4
    sampled_rows = 3 * sampled * embedding_size * fp32
    logits = 3 * global_batch * sampled * fp32
    return MemoryEstimate(2 * rows * embedding_size * center_bytes, sampled_rows + logits)
