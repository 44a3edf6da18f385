"""A check on MXNet's operator dispatch, for the second-context test: an operator whose
NDArray inputs and outputs are not all on one context raises ContextMix, unless it is
an explicit copy (`copyto`, `as_in_context`).

On the CPU, MXNet's imperative dispatch runs an operator whatever the contexts of its
inputs: cpu(0) and cpu(1) are the same memory. On a GPU the same mix is an error or a
silent copy across the bus. Training with the model on cpu(1) under this check finds,
without a GPU, every place that would mix devices on one. Every generated operator
function calls `_imperative_invoke` from mxnet.ndarray.register's globals; hybridized
blocks call CachedOp; a backward pass starts from NDArray.backward with its head
gradient. All three are wrapped while `guard()` is active.
"""

from __future__ import annotations

import contextlib
import ctypes

import mxnet as mx
from mxnet.base import _LIB, OpHandle, c_str, check_call, py_str
from mxnet.ndarray import register

COPIES = {"_copyto"}
"""Operators that move data between contexts on purpose."""


class ContextMix(AssertionError):
    pass


def operator_names() -> dict:
    """{operator handle: its names} of every operator MXNet has registered (aliases,
    e.g. _copyto and _npi_copyto, share a handle)."""
    size, names = ctypes.c_uint(), ctypes.POINTER(ctypes.c_char_p)()
    check_call(_LIB.MXListAllOpNames(ctypes.byref(size), ctypes.byref(names)))
    found = {}
    for i in range(size.value):
        name, handle = py_str(names[i]), OpHandle()
        check_call(_LIB.NNGetOpHandle(c_str(name), ctypes.byref(handle)))
        found.setdefault(handle.value, set()).add(name)
    return found


def contexts_of(arrays) -> set:
    if arrays is None:
        return set()
    if isinstance(arrays, mx.nd.NDArray):
        arrays = [arrays]
    return {array.context for array in arrays if isinstance(array, mx.nd.NDArray)}


class Counter:
    operators = 0
    cached_ops = 0


@contextlib.contextmanager
def guard():
    """While active, a mixed-context operator raises ContextMix; yields the counts of
    operators and cached graphs checked."""
    names = operator_names()
    invoke = register._imperative_invoke
    call = mx.nd.CachedOp.__call__
    backward = mx.nd.NDArray.backward
    counter = Counter()

    def checked_invoke(handle, ndargs, keys, vals, out, *rest):
        aliases = names.get(handle, {str(handle)})
        seen = contexts_of(ndargs) | contexts_of(out)
        if len(seen) > 1 and not aliases & COPIES:
            raise ContextMix(f"operator {'/'.join(sorted(aliases))} mixes contexts "
                             f"{sorted(map(str, seen))}")
        counter.operators += 1
        return invoke(handle, ndargs, keys, vals, out, *rest)

    def checked_call(self, *args, **kwargs):
        seen = contexts_of(list(args)) | contexts_of(kwargs.get("out"))
        if len(seen) > 1:
            raise ContextMix(f"a cached graph's inputs mix contexts {sorted(map(str, seen))}")
        counter.cached_ops += 1
        return call(self, *args, **kwargs)

    def checked_backward(self, out_grad=None, *args, **kwargs):
        seen = contexts_of(self) | contexts_of(out_grad)
        if len(seen) > 1:
            raise ContextMix(f"a backward pass and its head gradient mix contexts "
                             f"{sorted(map(str, seen))}")
        return backward(self, out_grad, *args, **kwargs)

    register._imperative_invoke = checked_invoke
    mx.nd.CachedOp.__call__ = checked_call
    mx.nd.NDArray.backward = checked_backward
    try:
        yield counter
    finally:
        register._imperative_invoke = invoke
        mx.nd.CachedOp.__call__ = call
        mx.nd.NDArray.backward = backward
