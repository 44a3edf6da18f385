"""numpy views of MXNet CPU arrays, for filling large arrays from several threads.

MXNet copies a numpy array into an NDArray on the calling thread, and its CPU
`zeros` faults in every page from one thread: 1.5 s and 1 s per GiB here
(docs/benchmarks.md). A view of the array's own memory lets numpy threads (which
release the GIL) write it in place. Only for arrays on the CPU, with nothing pending
on them in MXNet's engine (the view is read or written outside it).
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor

import mxnet as mx
import numpy as np


def host_view(array: mx.nd.NDArray) -> np.ndarray:
    """The memory of CPU `array` as a numpy array of its shape and dtype. For arrays
    just allocated (mx.nd.empty queues no operation): MXNet must not read or write
    the array while the view is used, and the caller keeps `array` alive."""
    if array.context.device_type != "cpu":
        raise ValueError(f"a host view needs an array on the CPU, not {array.context}")
    array.wait_to_read()
    address = ctypes.c_void_p()
    mx.base.check_call(mx.base._LIB.MXNDArrayGetData(array.handle, ctypes.byref(address)))
    size = array.size * np.dtype(array.dtype).itemsize
    memory = (ctypes.c_char * size).from_address(address.value)
    return np.frombuffer(memory, array.dtype).reshape(array.shape)


def zeros(shape: tuple, ctx: mx.Context, dtype: str, threads: int = 1) -> mx.nd.NDArray:
    """mx.nd.zeros; on the CPU its pages are zeroed (and so faulted in) by `threads`
    numpy threads at once."""
    if ctx.device_type != "cpu" or threads <= 1:
        return mx.nd.zeros(shape, ctx=ctx, dtype=dtype)
    array = mx.nd.empty(shape, ctx=ctx, dtype=dtype)
    flat = host_view(array).reshape(-1)
    step = max(1, -(-len(flat) // threads))
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda low: flat[low:low + step].fill(0), range(0, len(flat), step)))
    return array


def fill_threads() -> int:
    """Threads for filling large arrays: the cores this process may run on, at most 8.
    Not divided among the ranks of a host: much of a fill is waiting for fresh pages,
    and two ranks of two threads each on two cores started 1.5x faster than two of one
    (docs/benchmarks.md); a launcher that binds ranks to cores narrows the set."""
    return max(1, min(len(os.sched_getaffinity(0)), 8))
