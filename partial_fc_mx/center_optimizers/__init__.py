"""How the class centers learn: one module per optimizer, chosen by config.

`center_optimizer = "adamw"` in a config loads center_optimizers/adamw.py and uses
its OPTIMIZER class. An optimizer declares the states it keeps, each an array with
one row per center (`states`), and updates the rows one step sampled (`update`);
ClassCenters (centers.py) owns the arrays, checkpoints save every state under its
own name and re-sharding cuts them all alike. Adding an optimizer is one module
here with its OPTIMIZER, its test, and the config line.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # no MXNet for config validation
    import mxnet as mx

    from ..centers import ClassCenters


class CenterOptimizer(Protocol):
    name: str

    def states(self, embedding_size: int, center_dtype: str) -> dict[str, tuple[int, str]]:
        """{state name: (columns, dtype)}, each state one row per center, zero at start."""

    def update(self, centers: ClassCenters, index: mx.nd.NDArray | None, w: mx.nd.NDArray,
               grad: mx.nd.NDArray, lr: float) -> None:
        """Update the rows `index` of centers.weight and centers.states (None: all rows);
        `w` holds their float32 values, `grad` their gradient. centers.apply runs a
        float32 rule on the rows and stores them back in their dtypes."""


def available() -> list[str]:
    """The optimizers a config may name: the modules of this package."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def build(name: str, **settings) -> CenterOptimizer:
    """The optimizer `name`, given the settings it has fields for among `settings` (the
    config's momentum and weight_decay, shared with the backbone's optimizer)."""
    if name not in available():
        raise ValueError(f"center_optimizer={name!r} is not one of {available()}")
    cls = importlib.import_module(f"{__name__}.{name}").OPTIMIZER
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{key: value for key, value in settings.items() if key in fields})

