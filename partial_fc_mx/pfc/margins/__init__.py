"""The margin on the target logit: one module per margin, chosen by config `margin`.

Partial FC scores s * cos for every sampled class; only the target entry of each
row gets the margin, so a margin works on a vector: it receives the target
cosines and the embeddings' norms of those rows, and returns the target logits and
their slopes d logit / d cos (the norms enter as constants, as AdaFace's authors
stop their gradient; a margin that needs the norm's gradient, such as MagFace, would
need this interface to return it too). `observe` sees the whole global batch's norms once per step
before that, on every rank alike, for margins that keep batch statistics
(AdaFace); `state_dict` is what a checkpoint keeps of them.

Adding a margin: a module here with its class and `build(scale, margin_list,
**options)`, its tests (tests/test_margin.py, and tests/pfc_worker.py against a
float64 reference), and the config line `margin = "<module>"` (its settings in
`margin_options`).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Protocol

from ... import plugins

if TYPE_CHECKING:  # no MXNet for config validation
    import mxnet as mx


class Margin(Protocol):
    name: str
    scale: float

    def observe(self, norms: mx.nd.NDArray) -> None:
        """The norms of the global batch's embeddings, once per training step."""

    def __call__(self, cos: mx.nd.NDArray, norms: mx.nd.NDArray) -> tuple:
        """(target logits, d logit / d cos) for target cosines and their rows' norms."""

    def state_dict(self) -> dict:
        """JSON-able state that must survive a resume ({} for a stateless margin)."""

    def load_state_dict(self, state: dict) -> None: ...


def available() -> list[str]:
    """The margins a config may name: this package's modules."""
    return plugins.names(sys.modules[__name__])


def build(name: str, *, scale: float, margin_list: tuple = (1.0, 0.5, 0.0),
          options: dict | None = None) -> Margin:
    """The margin `name` with `scale`; "combined" takes margin_list (m1, m2, m3),
    others their settings from `options` (config margin_options)."""
    module = plugins.load(sys.modules[__name__], "margin", name)
    return module.build(scale, tuple(margin_list), **(options or {}))
