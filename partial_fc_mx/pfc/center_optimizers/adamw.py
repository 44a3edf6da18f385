"""AdamW for the class centers (arcface_torch's ViT recipes train PFC with AdamW),
lazy: only the sampled rows move; a row not sampled keeps its weight, its moments
and its step count.

    t += 1; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2
    w -= lr * (m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + wd * w)

Bias correction counts per row: t is the number of times this row was updated
(state "steps"), not the global step. A row sampled for the k-th time has averaged
k gradients, so its moments need 1 - beta^k; corrected with the global step t >> k
they would be too small, and the update of a row's first sampling would be
(1 - b1) / sqrt(1 - b2) = 3.2 lr instead of lr (b1 = 0.9, b2 = 0.999). With per-row
counts each row follows exactly Adam on its own gradient sequence, whatever the
sample rate. (PyTorch's SparseAdam and TensorFlow's LazyAdam count globally.)

The moments are float32 even for float16 centers: v = g^2 of a center's gradient
underflows float16 (below 6e-8), and m / (sqrt(0) + eps) then jumps by ~lr * 1e3.
The count is float32 too: exact up to 2^24 updates of a row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import mxnet as mx

if TYPE_CHECKING:
    from . import CenterRows


@dataclass(frozen=True)
class AdamW:
    weight_decay: float = 5e-4
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8
    name: ClassVar[str] = "adamw"

    def states(self, embedding_size: int, center_dtype: str) -> dict[str, tuple[int, str]]:
        return {"mean": (embedding_size, "float32"), "var": (embedding_size, "float32"),
                "steps": (1, "float32")}

    def update(self, centers: CenterRows, index: mx.nd.NDArray | None, w: mx.nd.NDArray,
               grad: mx.nd.NDArray, lr: float) -> None:
        index, w, grad = centers.every_row(index, w, grad)
        centers.apply(index, w, lambda w, states: self.rule(w, grad, states, lr))

    def rule(self, w: mx.nd.NDArray, grad: mx.nd.NDArray, states: dict, lr: float) -> None:
        """The update above on float32 rows w and their states, in place."""
        b1, b2 = self.beta1, self.beta2
        steps, mean, var = states["steps"], states["mean"], states["var"]
        steps += 1
        mean[:] = b1 * mean + (1 - b1) * grad
        var[:] = b2 * var + (1 - b2) * mx.nd.square(grad)
        mean_hat = mx.nd.broadcast_div(mean, 1 - b1**steps)
        var_hat = mx.nd.broadcast_div(var, 1 - b2**steps)
        w[:] = w * (1 - lr * self.weight_decay) - lr * mean_hat / (mx.nd.sqrt(var_hat)
                                                                    + self.epsilon)


def build(momentum: float, weight_decay: float) -> AdamW:
    """`momentum` is SGD's; AdamW's betas are its own (as for the backbone's AdamW)."""
    return AdamW(weight_decay=weight_decay)
