"""The backbone's optimizer: AdamW (config optimizer = "adamw"), and its state file.

MXNet 1.9.1 ships the fused update operator (contrib.adamw_update) but registers no
optimizer that uses it. The weight decay is decoupled from the gradient, as in
Loshchilov & Hutter and PyTorch's AdamW: w -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * w).
The class centers have optimizers of their own (pfc/center_optimizers/: sparse SGD
with momentum or AdamW, config center_optimizer), updating only the sampled rows.

The optimizer state (momentum, Adam's moments, float32 master weights, update
counts) is saved as a plain .npz of numbers, never a pickle: Gluon's
Trainer.save_states pickles the optimizer object, and loading a pickle can run any
code placed in the file.
"""

from __future__ import annotations

import math
import os

import mxnet as mx
import numpy as np

from ..backbones.layout import is_per_layer_slope
from ..errors import UserError


class BackboneAdamW(mx.optimizer.Optimizer):
    """Used as an instance (train.make_trainer), not registered by name: registering
    on import would change MXNet's global registry for anyone importing this module."""

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


class OptimizerStateError(UserError, ValueError):
    """An optimizer state file that cannot be loaded into this trainer."""


def state_arrays(state) -> list:
    """The NDArrays of one parameter's optimizer state, in a fixed order (a state is
    None, an NDArray, or nested tuples of them, e.g. (float32 master weight, momentum))."""
    if state is None:
        return []
    if isinstance(state, mx.nd.NDArray):
        return [state]
    return [array for part in state for array in state_arrays(part)]


def save_trainer_state(trainer: mx.gluon.Trainer, path: str | os.PathLike) -> None:
    """Write the state of a Gluon trainer's optimizer as an .npz of numbers."""
    updater = trainer._updaters[0]
    arrays = {f"state.{index}.{k}": array.asnumpy()
              for index, state in updater.states.items()
              for k, array in enumerate(state_arrays(state))}
    counts = updater.optimizer._index_update_count
    arrays["update_counts"] = np.array(sorted(counts.items()), np.int64).reshape(-1, 2)
    arrays["num_update"] = np.array(updater.optimizer.num_update, np.int64)
    with open(path, "wb") as file:
        np.savez(file, **arrays)


def load_trainer_state(trainer: mx.gluon.Trainer, path: str | os.PathLike,
                       ctx: mx.Context) -> None:
    """Fill the trainer's optimizer state from a file written by save_trainer_state.
    The file is read with allow_pickle=False: it can hold numbers only."""
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except Exception as error:  # not a zip, an object array, a truncated member ...
        raise OptimizerStateError(f"{path} is not an optimizer state file of this "
                                  f"version (a .npz of numbers): {error}") from error
    optimizer = trainer._updaters[0].optimizer
    states = {}
    for index, param in enumerate(trainer._params):
        names = sorted(n for n in arrays if n.startswith(f"state.{index}."))
        if not names:
            continue
        state = optimizer.create_state_multi_precision(index, param.data(ctx))
        targets = state_arrays(state)
        if len(targets) != len(names):
            raise OptimizerStateError(f"{path}: parameter {param.name} has {len(names)} state "
                                      f"arrays, this optimizer keeps {len(targets)}; was it "
                                      "saved with another optimizer?")
        for k, target in enumerate(targets):
            value = arrays[f"state.{index}.{k}"]
            if is_per_layer_slope(param.name, value.shape, target.shape):
                value = np.broadcast_to(value, target.shape)
            if value.shape != target.shape:
                raise OptimizerStateError(f"{path}: state {k} of {param.name} has shape "
                                          f"{value.shape}, expected {target.shape}")
            target[:] = value
        states[index] = state
    for updater in trainer._updaters:
        updater.states = dict(states)
        updater.states_synced = dict.fromkeys(states, True)
    optimizer._index_update_count.update(
        {int(i): int(n) for i, n in arrays.get("update_counts", np.empty((0, 2)))})
    optimizer.num_update = int(arrays.get("num_update", 0))
