"""SGD with momentum and weight decay, the insightface references' center optimizer:
v = mu * v - lr * (g + wd * w); w += v, on the sampled rows only (a row's momentum
and weight decay act when it is sampled)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import mxnet as mx

if TYPE_CHECKING:
    from ..centers import ClassCenters


@dataclass(frozen=True)
class SGD:
    momentum: float = 0.9
    weight_decay: float = 5e-4
    name: ClassVar[str] = "sgd"

    def states(self, embedding_size: int, center_dtype: str) -> dict[str, tuple[int, str]]:
        """The momentum, stored like the centers ("mom": rank_{r}_softmax_weight_mom.npy,
        insightface's file name)."""
        return {"mom": (embedding_size, center_dtype)}

    def update(self, centers: ClassCenters, index: mx.nd.NDArray | None, w: mx.nd.NDArray,
               grad: mx.nd.NDArray, lr: float) -> None:
        """float32 shards use MXNet's row-sparse update: lazy, it touches exactly the
        sampled rows of the weights and momentum in place (no gather or scatter);
        otherwise (centers.lazy False) every row, with no dense gradient built.
        float16 shards are updated in float32 and stored back rounded."""
        options = dict(lr=lr, momentum=self.momentum, wd=self.weight_decay)
        if index is not None and centers.dtype == "float32":
            rows = mx.nd.sparse.row_sparse_array((grad, index), shape=centers.weight.shape,
                                                 ctx=centers.ctx)
            mx.nd.sgd_mom_update(centers.weight, rows, centers.states["mom"],
                                 lazy_update=centers.lazy, out=centers.weight, **options)
            return
        centers.apply(index, w, lambda w, states: mx.nd.sgd_mom_update(
            w, grad, states["mom"], out=w, **options))


def build(momentum: float, weight_decay: float) -> SGD:
    return SGD(momentum=momentum, weight_decay=weight_decay)
