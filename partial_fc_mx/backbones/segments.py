"""A backbone's forward as a chain of segments (its stem, each residual unit or
transformer block, its head): what activation recomputation (run/recompute.py) keeps
only the inputs of, and recomputes one at a time in the backward.

A segment reads named values and writes named values: "data" (the images) is the
first input, "embeddings" the last output. A name written again (each block's
"tokens") is the newer value from there on. Values that no gradient flows back into
(a ViT's patch mask, drawn from noise) are a segment's `constants`: the backward
neither computes nor passes their gradients. A network offers its chain as a
`segments()` method; one without it cannot recompute (`recompute_problem`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mxnet as mx

DATA = "data"
EMBEDDINGS = "embeddings"


@dataclass(frozen=True)
class Segment:
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    function: Callable
    """The inputs' symbols -> a symbol, or a tuple of symbols in the order of `outputs`."""
    constants: tuple[str, ...] = ()
    """The outputs no gradient flows back into."""

    def graph(self) -> mx.sym.Symbol:
        """The segment's graph over float32 variables named as its inputs."""
        result = self.function(*(mx.sym.var(name, dtype="float32") for name in self.inputs))
        return mx.sym.Group(list(result)) if isinstance(result, tuple) else result


def chain(layers: Sequence[Callable]) -> list[Segment]:
    """The segments of a network that is a sequence of one-input, one-output layers."""
    names = [DATA, *(f"x{i}" for i in range(1, len(layers))), EMBEDDINGS]
    return [Segment((names[i],), (names[i + 1],), layer) for i, layer in enumerate(layers)]


def sequence(*layers: Callable) -> Callable:
    """The layers applied one after the other: one segment of several small layers (a
    stem's convolution, BatchNorm and PReLU), whose boundaries would each be kept."""
    def apply(x):
        for layer in layers:
            x = layer(x)
        return x
    return apply


def recompute_problem(net) -> str | None:
    """Why `net` cannot recompute its activations, or None."""
    if callable(getattr(net, "segments", None)):
        return None
    return (f"recompute_activations: {type(net).__name__} does not split into segments "
            "(a `segments()` method, backbones/segments.py); set recompute_activations = False")
