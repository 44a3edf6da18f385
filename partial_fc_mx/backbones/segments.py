"""A backbone's forward as a chain of segments (its stem, each residual unit or
transformer block, its head): what activation recomputation (run/recompute.py) keeps
only the inputs of, and recomputes one at a time in the backward.

A segment reads named values and writes named values: "data" (the images) is the
first input, "embeddings" the last output. A name written again (each block's
"tokens") is the newer value from there on. Values that no gradient flows back into
(a masking ViT's token places, a permutation drawn from noise) are a segment's
`constants`: the backward neither computes nor passes their gradients; any other
value is read by one segment only (its gradient comes from that one). A network
offers its chain as a `segments()` method, whose segments together use each of its
parameters, each in one segment; `recompute_problem` says where one does not.
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
        """The segment's graph over float32 variables named as its inputs (an output
        that is an input passes through a copy: a variable alone has no gradient)."""
        result = self.function(*(mx.sym.var(name, dtype="float32") for name in self.inputs))
        outputs = list(result) if isinstance(result, (list, tuple)) else [result]
        outputs = [mx.sym.identity(out) if out.get_children() is None else out
                   for out in outputs]
        return mx.sym.Group(outputs) if len(outputs) > 1 else outputs[0]


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


def recompute_problem(net: mx.gluon.HybridBlock) -> str | None:
    """Why `net` cannot recompute its activations, or None: no segments, a value
    read by two segments that is not a constant, or parameters that are not each
    used by exactly one segment (segments that would train another network)."""
    if not callable(getattr(net, "segments", None)):
        return (f"recompute_activations: {type(net).__name__} does not split into "
                "segments (a `segments()` method, backbones/segments.py); set "
                "recompute_activations = False")
    segments = net.segments()
    constants = {name for segment in segments for name in segment.constants}
    readers: dict = {}
    version = {DATA: -1}
    used: dict = {}
    for index, segment in enumerate(segments):
        for name in segment.inputs:
            readers.setdefault((name, version.get(name)), []).append(index)
        graph = segment.graph()
        for name in [*graph.list_arguments(), *graph.list_auxiliary_states()]:
            if name not in segment.inputs:
                used.setdefault(name, []).append(index)
        version.update(dict.fromkeys(segment.outputs, index))
    shared = sorted(name for (name, _), where in readers.items()
                    if len(where) > 1 and name not in constants)
    twice = sorted(name for name, where in used.items() if len(where) > 1)
    unused = sorted(set(net.collect_params()) - set(used))
    for problem, names in (("read by several segments, not a constant", shared),
                           ("used by several segments", twice),
                           ("used by no segment", unused)):
        if names:
            return (f"recompute_activations: {type(net).__name__}'s segments are wrong: "
                    f"{', '.join(names[:4])} {problem}")
    return None
