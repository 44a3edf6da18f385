"""partial_fc_mx: Partial FC face recognition training with MXNet and Horovod.

The classifier for your own training loop (docs/partial_fc_api.md):

    from partial_fc_mx import PartialFC, AdamW   # AdamW, SGD: the class centers' optimizers

They are loaded when first asked for: importing the package imports neither MXNet nor
Horovod, so the command line starts fast and says what is wrong when MXNet cannot load.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

PUBLIC = {
    "PartialFC": "partial_fc_mx.pfc.partial_fc",
    "SGD": "partial_fc_mx.pfc.center_optimizers.sgd",
    "AdamW": "partial_fc_mx.pfc.center_optimizers.adamw",
}
"""Name -> the module that defines it."""

__all__ = [*PUBLIC, "__version__"]


def __getattr__(name: str):
    if name in PUBLIC:
        return getattr(importlib.import_module(PUBLIC[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
