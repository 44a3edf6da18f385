"""AdamW for the backbone (config optimizer = "adamw").

MXNet 1.9.1 ships the fused update operator (contrib.adamw_update) but registers no
optimizer that uses it. The weight decay is decoupled from the gradient, as in
Loshchilov & Hutter and PyTorch's AdamW: w -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * w).
The class centers keep their sparse SGD with momentum either way.
"""

from __future__ import annotations

import math

import mxnet as mx


@mx.optimizer.register
class AdamW(mx.optimizer.Optimizer):
    def __init__(self, learning_rate: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8, **kwargs) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta1, self.beta2, self.epsilon = beta1, beta2, epsilon

    def create_state(self, index, weight):
        return (mx.nd.zeros(weight.shape, weight.context, dtype=weight.dtype),
                mx.nd.zeros(weight.shape, weight.context, dtype=weight.dtype))

    def update(self, index, weight, grad, state) -> None:
        self._update_count(index)
        step = self._index_update_count[index]
        # Adam's bias corrections of m and v, folded into the operator's learning rate;
        # the schedule's learning rate is its multiplier eta, which also scales wd
        correction = math.sqrt(1 - self.beta2**step) / (1 - self.beta1**step)
        mean, var = state
        mx.nd.contrib.adamw_update(
            weight, grad, mean, var, rescale_grad=self.rescale_grad, lr=correction,
            eta=self._get_lr(index), beta1=self.beta1, beta2=self.beta2, epsilon=self.epsilon,
            wd=self._get_wd(index), clip_gradient=self.clip_gradient or -1, out=weight)
