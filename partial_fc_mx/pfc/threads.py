"""The thread count of one rank's operators: what MXNet's own use, for the fused
kernels (kernels/) and for benchmarks that compare libraries at the same count
(MXNet's, numpy's OpenBLAS, torch's); no MXNet import."""

from __future__ import annotations

import os
import platform


def rank_threads() -> int:
    """The threads one rank's MXNet operators compute with, as MXNet 1.9 chooses them
    (src/engine/openmp.cc): MXNET_OMP_MAX_THREADS, else OMP_NUM_THREADS, else the cores
    the process may run on, halved on x86 (MXNet assumes two hyper-threads a core). On
    a 2-core host that is 1 thread: FullyConnected took 160 ms as with
    OMP_NUM_THREADS=1, 100 ms with OMP_NUM_THREADS=2."""
    for name in ("MXNET_OMP_MAX_THREADS", "OMP_NUM_THREADS"):
        first = os.environ.get(name, "").split(",")[0].strip()
        if first.isdigit() and int(first) > 0:
            return int(first)
    cores = len(os.sched_getaffinity(0))
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
    return max(1, cores // 2 if x86 else cores)
