"""How the class centers learn: one module per optimizer, chosen by config.

`center_optimizer = "adamw"` in a config loads center_optimizers/adamw.py and calls
its build(). An optimizer declares the states it keeps, each an array with
one row per center (`states`), and updates the rows one step sampled (`update`);
ClassCenters (centers.py) owns the arrays, in blocks (CenterBlock: what `update` is
given), checkpoints save every state under its own name and re-sharding cuts them
all alike. Adding an optimizer is one module
here with its class and build(), its test, and the config line.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Protocol

from ... import plugins

if TYPE_CHECKING:  # no MXNet for config validation
    from collections.abc import Callable

    import mxnet as mx


class CenterRows(Protocol):
    """What an optimizer is given to update: a block of class centers
    (centers.CenterBlock), described here so that this package depends on nothing of
    centers.py, which depends on it."""

    weight: mx.nd.NDArray
    states: dict[str, mx.nd.NDArray]
    ctx: mx.Context
    lazy: bool

    def every_row(self, index: mx.nd.NDArray | None, w: mx.nd.NDArray,
                  grad: mx.nd.NDArray) -> tuple: ...

    def sampled_weights(self, index: mx.nd.NDArray | None) -> mx.nd.NDArray: ...

    def apply(self, index: mx.nd.NDArray | None, w: mx.nd.NDArray,
              rule: Callable[[mx.nd.NDArray, dict], None]) -> None: ...


class CenterOptimizer(Protocol):
    name: str

    def states(self, embedding_size: int, center_dtype: str) -> dict[str, tuple[int, str]]:
        """{state name: (columns, dtype)}, each state one row per center, zero at start."""

    def update(self, centers: CenterRows, index: mx.nd.NDArray | None, w: mx.nd.NDArray,
               grad: mx.nd.NDArray, lr: float) -> None:
        """Update the rows `index` of centers.weight and centers.states (None: all rows);
        `w` holds their float32 values, `grad` their gradient. centers.apply runs a
        float32 rule on the rows and stores them back in their dtypes."""


def available() -> list[str]:
    """The optimizers a config may name: this package's modules."""
    return plugins.names(sys.modules[__name__])


def build(name: str, *, momentum: float = 0.9, weight_decay: float = 5e-4) -> CenterOptimizer:
    """The optimizer `name`, from the config's momentum and weight_decay (shared with
    the backbone's optimizer; each module's build takes those it uses)."""
    module = plugins.load(sys.modules[__name__], "center_optimizer", name)
    return module.build(momentum=momentum, weight_decay=weight_decay)
