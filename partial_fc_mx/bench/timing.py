"""Timers and memory probes shared by the benchmarks."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import statistics
import threading
import time
from collections import defaultdict

import mxnet as mx
import psutil

from .. import dist

MiB = 1024**2


class PhaseTimer:
    """Wall time per phase of a step; synchronizes MXNet at every boundary."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def phase(self, name: str):
        mx.nd.waitall()
        start = time.perf_counter()
        yield
        mx.nd.waitall()
        self.seconds[name] += time.perf_counter() - start


class PeakRSS:
    """The largest resident set size seen while it runs (sampled every 2 ms), and the
    size when it started."""

    def __enter__(self) -> PeakRSS:
        self.start = self.peak = psutil.Process().memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        process = psutil.Process()
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, process.memory_info().rss)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def give_back_freed_memory() -> None:
    """Between configurations of one bench process: free the reference cycles a run
    leaves (the data-parallel head's parameter, trainer and autograd graph), let
    MXNet's engine run the frees it queued, then return the C heap's free pages to the
    system. MXNet's freed buffers stayed in glibc's heaps and the next configuration
    did not reuse them: three r18 runs in a row grew RSS 0.8 -> 1.2 -> 1.5 GiB, and r18
    over three class counts was killed for memory at the third."""
    gc.collect()
    with contextlib.suppress(mx.base.MXNetError):  # after a failure: keep its error
        mx.nd.waitall()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def synchronized_seconds(step) -> float:
    """Wall seconds of `step()` with all the MXNet work it queued, every rank starting
    together."""
    dist.barrier("bench")
    start = time.perf_counter()
    step()
    mx.nd.waitall()
    return time.perf_counter() - start


def median_ms(run, repeats: int = 5) -> float:
    """Median wall time of `run()` including all the MXNet work it queued."""
    run()
    mx.nd.waitall()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        mx.nd.waitall()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)
