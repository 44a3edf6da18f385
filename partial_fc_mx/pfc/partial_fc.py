"""Partial FC: class centers sharded over the ranks, scored on a sample per step.

Each rank holds a shard of the C x D class centers with their optimizer states
(centers.py). One step, on every rank (N = the global batch, n = this rank's sampled centers):
  1. allgather labels (with each row's rank and checks) and the embeddings: N x D;
  2. sample: every positive class in the shard, plus uniform negatives up to n;
  3. v = w s / |w| (n x D), logits = x_hat @ v.T (one FullyConnected), the margin on
     the targets, in one N x n buffer that then holds the probabilities;
  4. allreduce(max), allreduce(sum exp, target logit): the exact softmax over the
     union of all ranks' samples, and the cross-entropy averaged over N;
  5. gradients: all N embeddings' (summed over ranks with one allreduce, each rank
     keeps the rows of its own), then the sampled centers', while that allreduce runs
     (kept for `step`).
Gradient accumulation (`accumulate`, then k forward_backward calls, then `step`): the
k micro-batches are one global batch of their k N samples. Their centers are sampled
once, from all their labels (what that batch would draw); each sample's softmax is
its own row's in any case, so each micro-batch computes its rows' loss and gradients
with the weight 1 / (k N) the large batch gives them, and the centers' gradients add
up until `step`: the large batch's, computed N rows at a time.
At a global batch of 1024, a pass over the N x n matrix costs twice one over the
n x D rows: the centers are normalized as rows (v), and each row's share of the
global softmax enters the backward GEMMs through their N x D input and output, so
the N x n matrix is written by the GEMM, maxed, softmaxed and read by the GEMMs, no
more. The three GEMMs are explicit (no autograd), gemm.py's: FullyConnected's forward and
its backward operator in float32, or bfloat16 inputs with float32 output by oneDNN 3 on
a CPU that computes them (config pfc_gemm). What runs row by row besides
(the scaling to v, the softmax, the gradient's projection) is rows.py's: C++ kernels
of one pass per row on the CPU, MXNet operators elsewhere. The N x n and n x D matrices
live in buffers kept across steps (buffers.py): a fresh array per step costs its
page faults every step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import horovod.mxnet as hvd
import mxnet as mx
import numpy as np

from .. import dist
from ..errors import UserError
from .buffers import Buffers
from .center_optimizers import CenterOptimizer
from .center_optimizers.sgd import SGD
from .centers import (
    SPARE_CENTERS,
    ClassCenters,
    center_dtype,
    num_sample,
    shard_of,
    sharding_problem,
    subcenter_index,
    subcenter_problem,
    subcenter_rows,
    tensor_size_problem,
)
from .gemm import FullyConnectedGemm, OneDNNGemm
from .idle_rows import CENTER_UPDATES
from .margins import Margin
from .margins.combined import CombinedMargin
from .rows import InterclassFilter, filter_problem, row_passes, row_sums, set_entries, spare_column
from .sampling import sample_excluding


class PartialFCInputError(UserError, ValueError):
    """Bad labels or embeddings on some rank; raised identically on every rank."""


class PartialFC:
    """The classifier of one rank: its shard of class centers, with their optimizer.

    Use it inside any MXNet training loop launched under Horovod:

        pfc = PartialFC(num_classes, 512, rank=hvd.rank(), world_size=hvd.size(),
                        ctx=ctx, sample_rate=0.1, margin=(1.0, 0.5, 0.0), scale=64.0)
        with autograd.record():
            embeddings = backbone(images)
        loss, grad = pfc.forward_backward(embeddings, labels)
        embeddings.backward(grad)            # then the backbone's optimizer step
        pfc.step(lr)                         # the optimizer on the sampled centers

    On the CPU the constructor builds (on first use) and loads the C++ kernels
    (kernels/), which can fail on one host and not another (no compiler there): build
    it where every rank hears of a failure on any (dist.run_agreed, as train.start
    does), so that no rank is left waiting in the first collective.
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
        margin: tuple | Margin = (1.0, 0.5, 0.0),
        scale: float = 64.0,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        fp16_centers: bool = False,
        seed: int = 0,
        timer=None,
        lazy_update: bool = True,
        center_update: str | None = None,
        optimizer: CenterOptimizer | None = None,
        center_block_rows: int | None = None,
        initialize_centers: bool = True,
        interclass_filtering_threshold: float = 0.0,
        num_subcenters: int = 1,
        gemm: FullyConnectedGemm | OneDNNGemm | None = None,
    ) -> None:
        """`margin`: (m1, m2, m3) of the combined margin with `scale`, or a margin of
        margins/ (which has its own scale). `optimizer`: the centers'
        (center_optimizers/); by default SGD with `momentum` and `weight_decay`.
        `center_update`: "lazy" (the sampled rows move), "exact" (and first take the
        SGD steps they missed: the dense update's rows at the sample's cost) or "dense"
        (every row every step); by default "lazy", or "dense" where lazy_update is
        False. `center_block_rows`: rows per stored block of the shard (default: as many as
        one MXNet array holds; tests lower it). `initialize_centers=False` leaves
        the rows undrawn, for a caller that loads them from a checkpoint next.
        `interclass_filtering_threshold` (arcface_torch's, 0: off): a negative whose
        cosine is above it counts as cosine 0 in the softmax, with no gradient; the
        fraction filtered is `filtered_fraction` after each step. `num_subcenters` K
        (sub-center ArcFace): K rows per class, the class's cosine their max. `gemm`: the
        three GEMMs' (gemm.py; by default float32, FullyConnected's)."""
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate={sample_rate} must be in (0, 1]")
        if problem := subcenter_problem(num_subcenters) or filter_problem(
                interclass_filtering_threshold):
            raise ValueError(problem)
        if problem := sharding_problem(num_classes, world_size, sample_rate):
            raise ValueError(problem)  # on every rank alike, before any collective
        # the sampled rows only: the logits' size depends on the batch (Config checks both)
        if problem := tensor_size_problem(num_classes, world_size, embedding_size, sample_rate,
                                          subcenters=num_subcenters):
            raise ValueError(problem)
        update = center_update or ("lazy" if lazy_update else "dense")
        if update not in CENTER_UPDATES:
            raise ValueError(f"center_update={update!r} must be one of "
                             f"{', '.join(CENTER_UPDATES)}")
        self.num_classes, self.embedding_size = num_classes, embedding_size
        self.rank, self.world_size = rank, world_size
        self.center_update = update
        self.ctx = ctx or mx.cpu()
        self.seed = seed
        self.subcenters = num_subcenters
        self.filter_threshold = interclass_filtering_threshold
        self.filtered_fraction: mx.nd.NDArray | None = None  # the last step's, when filtering
        self.shard = shard_of(num_classes, rank, world_size)
        self.centers = ClassCenters(
            subcenter_rows(self.shard, num_subcenters), embedding_size,
            optimizer or SGD(momentum=momentum, weight_decay=weight_decay), ctx=self.ctx,
            dtype=center_dtype(fp16_centers), seed=seed, rank=rank,
            lazy=update != "dense", exact=update == "exact", block_rows=center_block_rows,
            initialize=initialize_centers)
        self.num_sample = num_sample(self.shard.count, sample_rate)
        self.margin = CombinedMargin(*margin, scale=scale) if isinstance(margin, tuple) \
            else margin
        self.timer = timer or NoTimer()
        self._pending = None  # (index, sampled weights, their gradient) until step()
        self._accumulation: Accumulation | None = None  # between accumulate() and step()
        self._last_rows = None  # shard rows sampled in the last step; None: all
        self.buffers = Buffers(self.ctx)  # logits, both GEMM gradients, row chunks
        self.rows = row_passes(self.ctx, self.buffers)  # fused kernels on the CPU
        self.gemm = gemm or FullyConnectedGemm()

    @property
    def weight(self) -> mx.nd.NDArray:
        """This rank's rows of the class centers (when they are one block): with
        sub-centers, class c's K rows are rows cK ... cK + K - 1 of the shard."""
        return self.centers.weight

    @property
    def sampled_classes(self) -> np.ndarray:
        """Global class ids this rank scored in the last step."""
        rows = np.arange(self.shard.count) if self._last_rows is None else self._last_rows
        return rows + self.shard.start

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
        accumulation = self._accumulation
        with self.timer.phase("sampling"):
            if accumulation is None:
                index, target_col = self.sample(batch.labels)
                rows = subcenter_index(index, self.subcenters)
            else:  # the accumulated batch's sample, drawn once
                accumulation.check(batch.labels)  # every rank sees the same labels
                index, rows = accumulation.index, accumulation.rows
                target_col = self._target_columns(index, batch.labels)
        with self.timer.phase("compute"):
            x = batch.embeddings.as_in_context(self.ctx)
            x_norm = mx.nd.norm(x, axis=1, keepdims=True)  # scaled sums: no overflow
            x_hat = x / x_norm
            norms = x_norm.reshape(-1)
            if accumulation is None:
                self.margin.observe(norms)
                self.centers.bring_current(rows)  # exact update: steps the rows missed
                w = self.centers.sampled_weights(rows)
                v, w_scale = self._scaled_centers(w)
            else:  # the same rows for every micro-batch: scaled once, in accumulate()
                w, v, w_scale = accumulation.w, accumulation.v, accumulation.w_scale
            loss_rows = len(x) if accumulation is None else accumulation.samples
        with self.timer.phase("gemm"):
            logits = self._buffer("logits", x_hat, v)
            self.gemm.logits(x_hat, v, out=logits)
        with self.timer.phase("compute"):
            classes = self._class_logits(logits)  # the logits themselves when K = 1
            targets = self._apply_margin(classes, norms, target_col)
            # this rank's softmax, in place; with the row's max in the spare column, its
            # entry there is exp(0) / (1 + local_sum): this rank's exp-sum, which a NaN
            # anywhere in the row makes non-finite, where the max alone would skip it
            local_max, filtered = self._softmax(classes, targets, target_col)
            prob = classes
        with self.timer.phase("communication"):
            row_max = hvd.allreduce(local_max, op=hvd.Max, name="pfc.max")
        with self.timer.phase("compute"):
            shift = mx.nd.exp(local_max - row_max)
            with_spare = 1 / mx.nd.gather_nd(prob, spare_column(prob))
            local_sum = (with_spare - 1) * shift
            target_logit = mx.nd.zeros_like(row_max)
            if targets.rows is not None:
                target_logit[targets.rows] = targets.logits
            # filtering: each row's entries filtered and scored here, summed with the rest
            counts = [] if filtered is None else [filtered, mx.nd.full(
                filtered.shape, prob.shape[1] - SPARE_CENTERS, ctx=self.ctx)]
            sums = mx.nd.stack(local_sum, target_logit, *counts, axis=1)
        with self.timer.phase("communication"):
            sums = hvd.allreduce(sums, op=hvd.Sum, name="pfc.sum")
        with self.timer.phase("compute"):
            exp_sum, target_logit = sums[:, 0], sums[:, 1]
            if filtered is not None:  # of the negatives (each row has one positive)
                self.filtered_fraction = self._filtered_share(sums[:, 2].sum(),
                                                              (sums[:, 3] - 1).sum())
            loss = (mx.nd.log(exp_sum) + row_max - target_logit).sum() / loss_rows
            # d loss / d logit = prob * row_weight off the targets: the rows' weights
            # go into the GEMMs' N x D inputs and outputs, not over the N x n matrix
            share = with_spare * shift / exp_sum  # prob * share: the global probabilities
            row_weight = (share / loss_rows).reshape((-1, 1))
            target_grad = self._target_gradients(prob, share, targets, loss_rows)
            if self.subcenters > 1:  # each class's probability to its sub-center of the max
                # before the scatter: it reads the sub-centers' logits
                targets = targets.on_subcenters(logits, self.subcenters, target_col)
                self.rows.subcenter_scatter(logits, prob, self.subcenters)
                prob = logits
        with self.timer.phase("gemm"):  # prob @ v and prob^T @ x_hat
            grad_x_hat, grad_v = self._buffer("grad_x_hat", x_hat), self._buffer("grad_w", v)
            self.gemm.backward(prob, x_hat * row_weight, v, grad_x_hat, grad_v)
            grad_v = grad_v[:len(w)]  # the spare row's is not a center's
        with self.timer.phase("compute"):
            grad_x_hat = grad_x_hat * row_weight
            if targets.rows is not None:
                add_target_terms_to_embeddings(grad_x_hat, v, targets, target_grad)
            grad_x = grad_x_hat - x_hat * row_sums(x_hat * grad_x_hat).reshape((-1, 1))
            grad_x = grad_x * (grad_scale / x_norm)
        with self.timer.phase("communication"):
            summed = hvd.allreduce(grad_x, op=hvd.Sum, name="pfc.grad_x")
        # Python waits for grad_x before it pushes the centers' side, which then runs
        # while the allreduce does. Pushed earlier, the engine ran the projection and the
        # update as soon as their inputs were ready, between grad_x's small operators, and
        # the allreduce started 46 ms late (a CPU profile of two ranks). On a GPU the wait
        # costs the launch of the next operator (not measured there).
        grad_x.wait_to_read()
        with self.timer.phase("compute"):
            if targets.rows is not None:
                add_target_terms_to_centers(grad_v, x_hat, targets, target_grad)
            # v_j = w_j s / |w_j|: d loss / d w_j = s / |w_j| (dv_j less its part along
            # w_j), in place
            self.rows.project(grad_v, w, (w_scale / self.margin.scale) ** 2, w_scale)
            if accumulation is not None:  # the micro-batches' gradients add up
                grad_v = accumulation.add(grad_v)
        self._pending = (rows, w, grad_v)
        mine = summed[batch.mine_start:batch.mine_stop]
        return loss, mine.astype(embeddings.dtype, copy=False)

    def accumulate(self, labels, micro_batches: int) -> None:
        """Begin one optimizer step over `micro_batches` forward_backward calls whose
        labels, this rank's of all of them, are `labels` (module docstring). Every rank
        calls it with its own labels (a collective). A margin that keeps statistics of
        each batch (AdaFace) would see a part of it: refused."""
        if self.margin.state_dict():
            raise ValueError(f"{type(self.margin).__name__} follows statistics of each whole "
                             "global batch's embeddings, which accumulation never holds at "
                             "once: use it with gradient_accumulation = 1")
        if self._accumulation is not None or self._pending is not None:
            raise RuntimeError("PartialFC.accumulate() while a step is open: step() first")
        with mx.autograd.pause():
            meta = self._gathered_meta(labels, len(labels), self.embedding_size,
                                       np.ones(len(labels)))
            gathered = meta[:, 0].astype(np.int64)
            index, _ = self.sample(gathered)
            rows = subcenter_index(index, self.subcenters)
            self.centers.bring_current(rows)
            w = self.centers.sampled_weights(rows)
            v, w_scale = self._scaled_centers(w)
        self._accumulation = Accumulation(index, rows, np.unique(gathered), len(gathered),
                                          micro_batches, w, v, w_scale)

    def step(self, lr: float) -> None:
        """The centers' optimizer step on the rows sampled by the last forward_backward
        (or since accumulate(), with the micro-batches' summed gradient)."""
        if self._pending is None:
            raise RuntimeError("PartialFC.step() needs a forward_backward() first")
        if self._accumulation is not None:
            if self._accumulation.left or self._accumulation.seen != self._accumulation.samples:
                raise RuntimeError(f"PartialFC.step() with {self._accumulation.left} of "
                                   "the accumulated micro-batches still to come, "
                                   f"{self._accumulation.samples - self._accumulation.seen} "
                                   "of their rows")
            self._accumulation = None
        index, w, grad_w = self._pending
        self._pending = None
        with self.timer.phase("update"):
            self.centers.update(index, w, grad_w, lr)

    # ----- the pieces -----
    def _gather(self, embeddings: mx.nd.NDArray, labels) -> GatheredBatch:
        """Allgather, after every rank has seen every rank's labels and checks."""
        rows = embeddings.shape[0]
        width = embeddings.shape[1] if embeddings.ndim == 2 else -1
        as_float32 = embeddings.astype("float32", copy=False)
        finite = np.ones(rows)
        if width > 0:  # numpy's: 0.3 ms, MXNet's 8 (CPU, 1024 rows)
            finite = np.isfinite(as_float32.asnumpy().reshape(rows, -1)).all(axis=1)
        meta = self._gathered_meta(labels, rows, width, finite)
        gathered = hvd.allgather(as_float32, name="pfc.embeddings")
        mine = np.flatnonzero(meta[:, 1] == self.rank)
        start = int(mine[0]) if len(mine) else 0
        return GatheredBatch(gathered, meta[:, 0].astype(np.int64), start, start + len(mine))

    def _gathered_meta(self, labels, rows: int, width: int, finite) -> np.ndarray:
        """Each label with its rank, its batch's shape and whether its embedding is
        finite, from every rank; raises on every rank alike when any is bad."""
        labels = labels.asnumpy() if isinstance(labels, mx.nd.NDArray) else np.asarray(labels)
        labels = labels.reshape(len(labels), -1)[:, 0] if labels.ndim > 1 else labels
        finite = finite if len(finite) == len(labels) else np.ones(len(labels))
        meta = np.stack([labels.astype(np.float64), np.full(len(labels), self.rank),
                         np.full(len(labels), rows), np.full(len(labels), width), finite], 1)
        meta = hvd.allgather(mx.nd.array(meta, dtype="float64"), name="pfc.meta").asnumpy()
        self._validate(meta)
        return meta

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
            raise dist.agreed(PartialFCInputError("Partial FC input rejected: "
                                                  + "; ".join(problems)))

    def sample(self, labels: np.ndarray) -> tuple:
        """Choose this step's centers for the global batch's `labels`.

        Every positive class in the shard is kept, even when there are more than
        num_sample of them (dropping one would corrupt that sample's loss); the rest
        are uniform negatives drawn without replacement from this rank's own stream.
        Returns the sorted shard rows (None: every row), and each label's column
        among them (-1 when the class lives on another rank).
        """
        local = labels - self.shard.start
        in_shard = (local >= 0) & (local < self.shard.count)
        positives = np.unique(local[in_shard])
        index = None
        if self.num_sample < self.shard.count:
            wanted = max(self.num_sample - len(positives), 0)
            negatives = sample_excluding(self.centers.rng, self.shard.count, positives, wanted)
            index = np.sort(np.concatenate([positives, negatives]))
        self._last_rows = index
        return index, self._target_columns(index, labels)

    def _target_columns(self, index: np.ndarray | None, labels: np.ndarray) -> np.ndarray:
        """Each label's column among the sampled shard rows `index` (None: all), -1 where
        its class lives on another rank."""
        local = labels - self.shard.start
        in_shard = (local >= 0) & (local < self.shard.count)
        columns = local if index is None else np.searchsorted(index, local)
        return np.where(in_shard, columns, -1)

    def _filtered_share(self, filtered: mx.nd.NDArray, negatives: mx.nd.NDArray):
        """The share of negatives filtered in this step (so far, when accumulating)."""
        if self._accumulation is None:
            return filtered / negatives
        return self._accumulation.count_filtered(filtered, negatives)

    def _buffer(self, name: str, rows: mx.nd.NDArray, cols: mx.nd.NDArray | None = None):
        """This step's rows x cols (a matrix of rows' shape when cols is None) in a
        buffer kept across steps (buffers.py)."""
        shape = rows.shape if cols is None else (rows.shape[0], cols.shape[0])
        return self.buffers.get(name, shape)

    def _scaled_centers(self, w: mx.nd.NDArray) -> tuple[mx.nd.NDArray, mx.nd.NDArray]:
        """v = w s / |w| (x_hat @ v^T is then the logits) with the spare zero row after
        them, whose logits' column carries each row's max through the softmax; and s / |w|.
        With sub-centers the spare column is the class logits' (_class_logits): no row."""
        spare = SPARE_CENTERS if self.subcenters == 1 else 0
        v = self.buffers.get("v", (len(w) + spare, w.shape[1]))
        w_scale = self.rows.scale(w, self.margin.scale, out=v[:len(w)])
        if spare:
            v[len(w):] = 0
        return v, w_scale

    def _class_logits(self, logits: mx.nd.NDArray) -> mx.nd.NDArray:
        """Each class's logit, the max over its sub-centers', with the spare column
        after them (N x (n + 1)); `logits` itself when each class has one row."""
        if self.subcenters == 1:
            return logits
        classes = self.buffers.get("class logits", (logits.shape[0], logits.shape[1]
                                                    // self.subcenters + SPARE_CENTERS))
        self.rows.subcenter_max(logits, self.subcenters, out=classes)
        return classes

    def _softmax(self, logits: mx.nd.NDArray, targets: Targets,
                 target_col: np.ndarray) -> tuple:
        """This rank's softmax in place (rows.py): (the rows' maxima, the entries the
        inter-class filter took out of each row, None when it is off)."""
        if not self.filter_threshold:
            return self.rows.softmax_with_spare(logits), None
        interclass = InterclassFilter(
            self.filter_threshold * self.margin.scale,
            mx.nd.array(target_col, ctx=self.ctx, dtype="int64"), targets.where)
        return self.rows.filtered_softmax_with_spare(logits, interclass)

    def _apply_margin(self, logits, norms, target_col: np.ndarray) -> Targets:
        """The margin on the target logits in this shard, in place; the targets with
        their logits and slopes."""
        targets = Targets.of(target_col, self.ctx)
        if targets.rows is not None:
            cos = mx.nd.gather_nd(logits, targets.where) / self.margin.scale
            targets.logits, targets.slopes = self.margin(cos, mx.nd.take(norms, targets.rows))
            set_entries(logits, targets.where, targets.logits)
        return targets

    def _target_gradients(self, prob, share, targets, loss_rows: int) -> mx.nd.NDArray | None:
        """d loss / d logit at the targets, (p - 1) * slope / s / N (p the global
        probability, prob * share; N the samples the loss averages over), and zero in
        their place in `prob`: the GEMMs then see prob * row_weight everywhere, and
        add_target_terms_* add these."""
        if targets.rows is None:
            return None
        p_target = mx.nd.gather_nd(prob, targets.where) * mx.nd.take(share, targets.rows)
        set_entries(prob, targets.where, mx.nd.zeros_like(p_target))
        return (p_target - 1) * targets.slopes / (self.margin.scale * loss_rows)


@dataclass
class Accumulation:
    """One optimizer step of `left` more micro-batches: its sample (shard rows `index`,
    center rows `rows`), the samples of the whole accumulated global batch, the
    sampled centers and their scaled copy, and the sums so far."""

    index: np.ndarray | None
    rows: np.ndarray | None
    labels: np.ndarray
    """The accumulated global batch's classes (sorted, once each)."""
    samples: int
    left: int
    w: mx.nd.NDArray
    v: mx.nd.NDArray
    w_scale: mx.nd.NDArray
    grad: mx.nd.NDArray | None = None
    filtered: tuple = (0, 0)
    seen: int = 0

    def check(self, labels: np.ndarray) -> None:
        """A micro-batch (its global labels, the same on every rank: so is the answer)
        must be part of the batch accumulate() sampled for."""
        self.seen += len(labels)
        if self.seen > self.samples or not np.isin(labels, self.labels).all():
            raise dist.agreed(PartialFCInputError(
                "a micro-batch that is not part of the batch given to accumulate(): its "
                f"labels or its {self.seen} of {self.samples} rows so far"))

    def add(self, grad_v: mx.nd.NDArray) -> mx.nd.NDArray:
        """The centers' gradient summed over the micro-batches so far (grad_v is a
        buffer the next micro-batch overwrites: the sum is kept apart)."""
        if self.left <= 0:
            raise RuntimeError("PartialFC.forward_backward() past the micro-batches "
                               "accumulate() was given")
        self.left -= 1
        if self.grad is None:
            self.grad = grad_v.copy()
        else:
            self.grad += grad_v
        return self.grad

    def count_filtered(self, filtered: mx.nd.NDArray, negatives: mx.nd.NDArray):
        self.filtered = (self.filtered[0] + filtered, self.filtered[1] + negatives)
        return self.filtered[0] / self.filtered[1]


@dataclass
class GatheredBatch:
    embeddings: mx.nd.NDArray
    labels: np.ndarray
    mine_start: int
    mine_stop: int


@dataclass
class Targets:
    """The (row, column) of every target logit that lives in this rank's sample.
    `rounds` splits the targets into groups with distinct columns (the first target
    of each column, then the second, ...): (their positions among the targets, their
    columns), so that adding per column needs no scatter-add, whose atomic order
    would vary from run to run."""

    rows: mx.nd.NDArray | None
    cols: mx.nd.NDArray | None
    where: mx.nd.NDArray | None
    rounds: list = field(default_factory=list)
    logits: mx.nd.NDArray | None = None
    slopes: mx.nd.NDArray | None = None

    def on_subcenters(self, sub_logits: mx.nd.NDArray, k: int,
                      target_col: np.ndarray) -> Targets:
        """The same targets (`target_col`, as Targets.of took them), each at its class's
        sub-center of the max (the first of the largest logit, as the scatter chose)
        among the N x nK `sub_logits`. Rounds keep their grouping: distinct classes have
        distinct sub-centers."""
        if self.rows is None:
            return self
        rows = np.flatnonzero(target_col >= 0)
        cols = target_col[rows]
        candidates = [np.stack([rows, cols * k + j]) for j in range(k)]
        ctx = sub_logits.context
        entries = mx.nd.stack(*[mx.nd.gather_nd(sub_logits, mx.nd.array(c, ctx=ctx,
                                                                         dtype="int64"))
                                for c in candidates], axis=1)
        sub_cols = (self.cols * k + mx.nd.argmax(entries, axis=1).astype("int64"))
        rounds = [(positions, mx.nd.take(sub_cols, positions)) for positions, _ in self.rounds]
        return Targets(self.rows, sub_cols, mx.nd.stack(self.rows, sub_cols), rounds,
                       self.logits, self.slopes)

    @classmethod
    def of(cls, target_col: np.ndarray, ctx: mx.Context) -> Targets:
        rows = np.flatnonzero(target_col >= 0)
        if len(rows) == 0:
            return cls(None, None, None)
        cols = target_col[rows]
        as_nd = lambda a: mx.nd.array(a, ctx=ctx, dtype="int64")  # noqa: E731
        order = np.argsort(cols, kind="stable")
        first = np.searchsorted(cols[order], cols[order])  # each column's first place
        occurrence = np.empty_like(order)
        occurrence[order] = np.arange(len(order)) - first
        rounds = [(as_nd(np.flatnonzero(occurrence == k)), as_nd(cols[occurrence == k]))
                  for k in range(occurrence.max() + 1)]
        return cls(as_nd(rows), as_nd(cols), as_nd(np.stack([rows, cols])), rounds)


def add_target_terms_to_embeddings(grad_x_hat: mx.nd.NDArray, v: mx.nd.NDArray,
                                   targets: Targets, target_grad: mx.nd.NDArray) -> None:
    """The target entries' part of grad_x_hat = prob @ v, left out of that GEMM
    (target_grad_i at row i, column t_i): grad_x_hat_i += target_grad_i v_(t_i). In
    place; T x D work."""
    add_rows(grad_x_hat, targets.rows, mx.nd.take(v, targets.cols) * target_grad.reshape((-1, 1)))


def add_target_terms_to_centers(grad_v: mx.nd.NDArray, x_hat: mx.nd.NDArray,
                                targets: Targets, target_grad: mx.nd.NDArray) -> None:
    """Their part of grad_v = prob^T @ x_hat: grad_v_t += target_grad_i x_hat_i for each
    target i of column t, in the targets' order. In place; T x D work."""
    for_centers = mx.nd.take(x_hat, targets.rows) * target_grad.reshape((-1, 1))
    for positions, cols in targets.rounds:
        add_rows(grad_v, cols, mx.nd.take(for_centers, positions))


def add_rows(matrix: mx.nd.NDArray, rows: mx.nd.NDArray, values: mx.nd.NDArray) -> None:
    """matrix[rows] += values, in place, for distinct rows."""
    set_entries(matrix, rows.reshape((1, -1)), mx.nd.take(matrix, rows) + values)


class NoTimer:
    """The default: no synchronisation, no timing."""

    def phase(self, name: str):
        return contextlib.nullcontext()
