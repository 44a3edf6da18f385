"""Loading a library of C++ operators into MXNet 1.9 and offering its operators as
mx.nd.NAME and mx.sym.NAME, what `mx.library.load` does, at a fraction of its cost.

`mx.library.load` makes the Python function of every operator MXNet has again, for
ndarray and symbol alike (about 2,300 of each, 1.1 s of CPU a process on a 2-core
Xeon, 2026-12-02), though only the library's own operators are new: every rank of
every launch paid it before its first step. Here only the new operators' functions
are made, by MXNet's own makers, and put where `mx.library.load` puts them.
"""

from __future__ import annotations

import ctypes
from pathlib import Path


def operator_names() -> set[str]:
    """Every operator MXNet's registry holds now."""
    from mxnet.base import _LIB, check_call, py_str

    names = ctypes.POINTER(ctypes.c_char_p)()
    size = ctypes.c_uint()
    check_call(_LIB.MXListAllOpNames(ctypes.byref(size), ctypes.byref(names)))
    return {py_str(names[i]) for i in range(size.value)}


def load_library(library: Path) -> list[str]:
    """Load `library` (an absolute path) into MXNet; return the operators it added, now
    mx.nd.NAME and mx.sym.NAME (and in mx.nd.op and mx.sym.op, as MXNet's own), or, for
    a name with a leading underscore (a backward operator), in their `_internal`."""
    import mxnet as mx
    from mxnet.base import (
        _LIB,
        OpHandle,
        _get_op_name_prefix,
        _is_np_op,
        c_str,
        check_call,
        mx_uint,
    )
    from mxnet.ndarray.register import _make_ndarray_function
    from mxnet.symbol.register import _make_symbol_function

    before = operator_names()
    check_call(_LIB.MXLoadLib(c_str(str(library)), mx_uint(0)))  # 0: not verbose
    added = sorted(operator_names() - before)
    if routed := [name for name in added if _get_op_name_prefix(name) or _is_np_op(name)]:
        raise ValueError(f"{library} adds operators that MXNet offers in its contrib, linalg, "
                         f"sparse, image, random or numpy modules, which this loader does "
                         f"not place: {routed}")
    for name in added:
        for module, make in ((mx.ndarray, _make_ndarray_function),
                             (mx.symbol, _make_symbol_function)):
            handle = OpHandle()
            check_call(_LIB.NNGetOpHandle(c_str(name), ctypes.byref(handle)))
            function = make(handle, name, name)
            function.__module__ = module.__name__.split(".")[-1]
            places = (module._internal,) if name.startswith("_") else (module.op, module)
            for place in places:
                setattr(place, name, function)
            places[0].__all__.append(name)
    return added
