"""SGD with momentum and weight decay, the insightface references' center optimizer:
v = mu * v - lr * (g + wd * w); w += v, on the sampled rows only (a row's momentum
and weight decay act when it is sampled)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import mxnet as mx
import numpy as np

from .. import kernels
from ..threads import rank_threads

if TYPE_CHECKING:
    from . import CenterRows


@dataclass(frozen=True)
class SGD:
    """`fused`: float32 rows on the CPU are updated in place in the shard by one C++
    kernel (kernels/rows.cc) instead of MXNet's gather, update and two scatters (100 ->
    20 ms at 50,000 sampled rows of 512); False takes MXNet's path, as a GPU does
    (the tests run both)."""

    momentum: float = 0.9
    weight_decay: float = 5e-4
    fused: bool = True
    name: ClassVar[str] = "sgd"

    def states(self, embedding_size: int, center_dtype: str) -> dict[str, tuple[int, str]]:
        """The momentum, stored like the centers ("mom": rank_{r}_softmax_weight_mom.npy,
        insightface's file name)."""
        return {"mom": (embedding_size, center_dtype)}

    def update(self, centers: CenterRows, index: mx.nd.NDArray | None, w: mx.nd.NDArray,
               grad: mx.nd.NDArray, lr: float) -> None:
        """float32 rows on the CPU: the fused kernel, in place. Otherwise the sampled rows
        are gathered (the weights already are, for the GEMMs), updated by MXNet's dense
        sgd_mom_update and scattered back, through buffers kept across steps: 18% faster
        at 100k of 1M rows than MXNet's row-sparse update, whose gradient array is a
        fresh copy every step. float16 rows are updated in float32 and stored rounded.
        Not lazy (float32 only): the row-sparse update of every row, with no dense
        gradient built."""
        options = dict(lr=lr, momentum=self.momentum, wd=self.weight_decay)
        if index is not None and not centers.lazy:
            rows = mx.nd.sparse.row_sparse_array((grad, index), shape=centers.weight.shape,
                                                 ctx=centers.ctx)
            mx.nd.sgd_mom_update(centers.weight, rows, centers.states["mom"],
                                 lazy_update=False, out=centers.weight, **options)
            return
        if self.fused and index is not None and fused_kernel_applies(centers):
            kernels.load()
            mx.nd.pfc_sgd_momentum_rows(centers.weight, centers.states["mom"], index, grad,
                                        threads=rank_threads(), out=centers.weight, **options)
            return
        centers.apply(index, w, lambda w, states: mx.nd.sgd_mom_update(
            w, grad, states["mom"], out=w, **options))


    def replay(self, centers: CenterRows, index: mx.nd.NDArray | None,
               coefficients: np.ndarray) -> None:
        """The steps rows `index` (None: all) missed while not sampled (the exact lazy
        update, idle_rows.py): [w; m] <- P [w; m], each row's P as (a, b, c, d) in
        float64, applied in float32. float32 rows on the CPU: one C++ pass in place;
        otherwise gathered, moved by MXNet operators and stored rounded."""
        p = mx.nd.array(coefficients, ctx=centers.ctx, dtype="float32")
        if self.fused and index is not None and fused_kernel_applies(centers):
            kernels.load()
            mx.nd.pfc_replay_rows(centers.weight, centers.states["mom"], index, p,
                                  threads=rank_threads(), out=centers.weight)
            return

        def rule(w: mx.nd.NDArray, states: dict) -> None:
            m = states["mom"]
            moved = mx.nd.broadcast_mul(w, p[:, 0:1]) + mx.nd.broadcast_mul(m, p[:, 1:2])
            mx.nd.broadcast_add(mx.nd.broadcast_mul(w, p[:, 2:3]),
                                mx.nd.broadcast_mul(m, p[:, 3:4]), out=m)
            w[:] = moved

        centers.apply(index, centers.sampled_weights(index), rule)


def fused_kernel_applies(centers: CenterRows) -> bool:
    """The kernel's case: float32 rows and momentum, on the CPU."""
    return centers.ctx.device_type == "cpu" and all(
        array.dtype == np.float32 for array in (centers.weight, centers.states["mom"]))


def build(momentum: float, weight_decay: float) -> SGD:
    return SGD(momentum=momentum, weight_decay=weight_decay)
