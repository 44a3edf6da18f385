"""The row-wise passes of one Partial FC step, outside its three GEMMs: the centers'
scaling to v = w s / |w|, the softmax with the spare column (with inter-class
filtering or without), sub-center ArcFace's max over each class's sub-centers and its
way back, the projection of the centers' gradient. Two implementations with one
interface:

- FusedRows, on the CPU: the C++ kernels of kernels/rows.cc, one pass over each row
  where the composed form makes 2-5 (at N = 1024, 50,000 sampled centers: 75 -> 19 ms
  for the projection; docs/benchmarks_history.md);
- ComposedRows, on any device (a GPU's): MXNet operators. tests/test_rows.py holds the
  two to the same results, and the exactness tests run Partial FC with each.
"""

from __future__ import annotations

from dataclasses import dataclass

import mxnet as mx
import numpy as np

from . import kernels
from .buffers import Buffers
from .threads import rank_threads


def row_passes(ctx: mx.Context, buffers: Buffers) -> FusedRows | ComposedRows:
    """The fused kernels on the CPU, MXNet's operators elsewhere."""
    return FusedRows(rank_threads()) if ctx.device_type == "cpu" else ComposedRows(buffers)


class FusedRows:
    """The CPU's: each pass one C++ operator (kernels/rows.cc) on `threads` OpenMP
    threads, the count MXNet's own operators use in this process."""

    def __init__(self, threads: int) -> None:
        kernels.load()
        self.threads = threads

    def scale(self, w: mx.nd.NDArray, scale: float, out: mx.nd.NDArray) -> mx.nd.NDArray:
        """out = w * scale / |w| (row-wise); returns scale / |w|."""
        row_scale = mx.nd.empty((len(w),), ctx=w.context)
        mx.nd.pfc_scale_rows(w, scale=scale, threads=self.threads, out=[out, row_scale])
        return row_scale

    def softmax_with_spare(self, logits: mx.nd.NDArray) -> mx.nd.NDArray:
        """In place: each row's softmax with its last (spare) entry set to the max of the
        others; returns those maxima (NaN skipped)."""
        row_max = mx.nd.empty((len(logits),), ctx=logits.context)
        mx.nd.pfc_softmax_with_spare(logits, threads=self.threads, out=[logits, row_max])
        return row_max

    def filtered_softmax_with_spare(self, logits: mx.nd.NDArray,
                                    interclass: InterclassFilter) -> tuple:
        """softmax_with_spare where every entry above the filter's threshold but the
        row's target counts as 0 and takes probability 0 (no gradient); returns the
        maxima and the entries filtered in each row."""
        row_max = mx.nd.empty((len(logits),), ctx=logits.context)
        filtered = mx.nd.empty((len(logits),), ctx=logits.context)
        mx.nd.pfc_filtered_softmax_with_spare(logits, interclass.target_col,
                                              threshold=interclass.threshold,
                                              threads=self.threads,
                                              out=[logits, row_max, filtered])
        return row_max, filtered

    def subcenter_max(self, sub_logits: mx.nd.NDArray, k: int, out: mx.nd.NDArray) -> None:
        """out[:, :n] = the max of each class's k consecutive entries of sub_logits
        (N x nK; NaN kept); out's last column is left for the softmax."""
        mx.nd.pfc_subcenter_max(sub_logits, out, k=k, threads=self.threads, out=out)

    def subcenter_scatter(self, sub_logits: mx.nd.NDArray, prob: mx.nd.NDArray, k: int) -> None:
        """In place over sub_logits: each class's prob to its sub-center of the max
        (the first of the largest logit), 0 to its others."""
        mx.nd.pfc_subcenter_scatter(sub_logits, prob, k=k, threads=self.threads,
                                    out=sub_logits)

    def project(self, grad: mx.nd.NDArray, rows: mx.nd.NDArray,
                inverse_square_norms: mx.nd.NDArray, row_scale: mx.nd.NDArray) -> None:
        """In place: grad_j = row_scale_j (grad_j - (grad_j . rows_j) inverse_square_norms_j
        rows_j), each row's part along rows_j removed."""
        mx.nd.pfc_project_rows(grad, rows, inverse_square_norms, row_scale,
                               threads=self.threads, out=grad)


class ComposedRows:
    """The same passes from MXNet operators; `buffers` lends them scratch space."""

    def __init__(self, buffers: Buffers) -> None:
        self.buffers = buffers

    def scale(self, w: mx.nd.NDArray, scale: float, out: mx.nd.NDArray) -> mx.nd.NDArray:
        row_scale = scale / mx.nd.sqrt(row_sums(mx.nd.square(w, out=out)))  # out: scratch
        mx.nd.broadcast_mul(w, row_scale.reshape((-1, 1)), out=out)
        return row_scale

    def softmax_with_spare(self, logits: mx.nd.NDArray) -> mx.nd.NDArray:
        spare = spare_column(logits)
        set_entries(logits, spare, mx.nd.full(len(logits), -np.inf, ctx=logits.context))
        row_max = row_maxes(logits)
        set_entries(logits, spare, row_max)
        mx.nd.softmax(logits, axis=1, out=logits)
        return row_max

    def filtered_softmax_with_spare(self, logits: mx.nd.NDArray,
                                    interclass: InterclassFilter) -> tuple:
        kept = self.buffers.get("kept", logits.shape)  # 1, or 0 where filtered
        mx.nd.broadcast_greater(logits, mx.nd.full((1, 1), interclass.threshold,
                                                   ctx=logits.context), out=kept)
        mx.nd._internal._rminus_scalar(kept, scalar=1.0, out=kept)  # NaN > t: kept
        set_entries(kept, spare_column(logits), mx.nd.ones(len(logits), ctx=logits.context))
        if interclass.where is not None:
            set_entries(kept, interclass.where, mx.nd.ones(interclass.where.shape[1],
                                                           ctx=logits.context))
        mx.nd.elemwise_mul(logits, kept, out=logits)
        row_max = self.softmax_with_spare(logits)
        mx.nd.elemwise_mul(logits, kept, out=logits)
        return row_max, logits.shape[1] - row_sums(kept)

    def subcenter_max(self, sub_logits: mx.nd.NDArray, k: int, out: mx.nd.NDArray) -> None:
        rows, width = sub_logits.shape
        out[:, :width // k] = sub_logits.reshape((rows, width // k, k)).max(axis=2)

    def subcenter_scatter(self, sub_logits: mx.nd.NDArray, prob: mx.nd.NDArray, k: int) -> None:
        rows, width = sub_logits.shape
        by_class = sub_logits.reshape((rows, width // k, k))
        best = mx.nd.argmax(by_class, axis=2)
        mx.nd.one_hot(best, k, out=by_class)
        class_prob = mx.nd.slice_axis(prob, axis=1, begin=0, end=width // k)
        mx.nd.broadcast_mul(by_class, class_prob.reshape((rows, width // k, 1)), out=by_class)

    def project(self, grad: mx.nd.NDArray, rows: mx.nd.NDArray,
                inverse_square_norms: mx.nd.NDArray, row_scale: mx.nd.NDArray) -> None:
        scratch = self.buffers.get("row_chunk", (min(len(grad), chunk_rows(grad)), grad.shape[1]))
        project_out_rows(grad, rows, inverse_square_norms, row_scale, scratch)


# Row sums and row maxima through a GEMV and a max pooling: on CPU these run 2-10x
# faster than MXNet's sum(axis=...) and max(axis=1) reductions
# (docs/benchmarks.md).
def row_sums(matrix: mx.nd.NDArray, ones: mx.nd.NDArray | None = None) -> mx.nd.NDArray:
    """`ones`: ones_row of the matrix's width, for a caller that sums many matrices."""
    ones = ones_row(matrix.shape[1], matrix) if ones is None else ones
    return mx.nd.FullyConnected(matrix, ones, num_hidden=1, no_bias=True).reshape(-1)


def ones_row(width: int, like: mx.nd.NDArray) -> mx.nd.NDArray:
    return mx.nd.ones((1, width), ctx=like.context, dtype=like.dtype)


def row_maxes(matrix: mx.nd.NDArray) -> mx.nd.NDArray:
    """A global max pooling on CPU (NaN is skipped there, unlike max(axis=1)); on GPU,
    where pooling runs one thread per row, MXNet's reduction."""
    if matrix.context.device_type != "cpu":
        return matrix.max(axis=1)
    rows, cols = matrix.shape
    return mx.nd.Pooling(matrix.reshape((1, rows, 1, cols)), kernel=(1, 1), global_pool=True,
                         pool_type="max").reshape(-1)


MAX_CHUNKS = 32
"""At most this many chunks per projection: on a GPU, or at a million sampled rows, a
chunk is a few operator calls, and calls must not outnumber the work."""


def chunk_rows(matrix: mx.nd.NDArray) -> int:
    """Rows of `matrix` in about 4 MiB, where a chunk and its scratch stay in the CPU's
    cache, or a 1/MAX_CHUNKS of them when that is more."""
    return max(1, 2**20 // matrix.shape[1], -(-matrix.shape[0] // MAX_CHUNKS))


def project_out_rows(grad: mx.nd.NDArray, rows: mx.nd.NDArray,
                     inverse_square_norms: mx.nd.NDArray, row_scale: mx.nd.NDArray,
                     scratch: mx.nd.NDArray) -> None:
    """ComposedRows.project a chunk of rows at a time through `scratch` (no n x D
    temporary)."""
    step = max(1, scratch.shape[0])
    ones = ones_row(grad.shape[1], grad)
    for start in range(0, grad.shape[0], step):
        stop = min(start + step, grad.shape[0])
        grad_part, rows_part = grad[start:stop], rows[start:stop]
        scale = row_scale[start:stop].reshape((-1, 1))
        work = scratch[:stop - start]
        mx.nd.elemwise_mul(grad_part, rows_part, out=work)
        coefficient = row_sums(work, ones) * inverse_square_norms[start:stop]
        mx.nd.broadcast_mul(rows_part, coefficient.reshape((-1, 1)), out=work)
        mx.nd.elemwise_sub(grad_part, work, out=grad_part)
        mx.nd.broadcast_mul(grad_part, scale, out=grad_part)


@dataclass
class InterclassFilter:
    """arcface_torch's inter-class filtering on one step's logits: `threshold` in
    logits (s times the cosine's), each row's target column in this rank's sample
    (`target_col`, -1: none here), and the targets' (row, column) pairs (`where`, None:
    none), which it never filters."""

    threshold: float
    target_col: mx.nd.NDArray
    where: mx.nd.NDArray | None


def filter_problem(threshold: float) -> str | None:
    """Why an inter-class filtering threshold cannot be used, or None (0 is off)."""
    if not 0 <= threshold < 1:
        return (f"interclass_filtering_threshold={threshold} must be in [0, 1): a cosine "
                "above it is filtered (0: off; arcface_torch's configs use 0.4)")
    return None


def spare_column(logits: mx.nd.NDArray) -> mx.nd.NDArray:
    """The (row, column) indices of the logits' last column, the spare center's."""
    rows = np.arange(len(logits))
    where = np.stack([rows, np.full_like(rows, logits.shape[1] - 1)])
    return mx.nd.array(where, ctx=logits.context, dtype="int64")


def set_entries(matrix: mx.nd.NDArray, where: mx.nd.NDArray, values: mx.nd.NDArray) -> None:
    """matrix[where[0], where[1], ...] = values, in place: `where` holds an index into
    each of the matrix's first len(where) axes (entries, or whole rows)."""
    mx.nd._internal._scatter_set_nd(lhs=matrix, rhs=values, indices=where,
                                    shape=matrix.shape, out=matrix)
