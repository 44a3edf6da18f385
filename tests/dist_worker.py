"""One rank of the parameter-broadcast test. Usage: dist_worker.py

Every rank fills the same parameters with its own values (rank 0's include -0.0,
NaN, infinities and float16); after dist.broadcast_parameters every rank must hold
rank 0's bytes exactly (NaN stays NaN; its payload may change).
Each rank prints BROADCAST OK <rank> <world size>, and the Horovod cycle time it
started with (CYCLE TIME <ms>).
"""

from __future__ import annotations

import os

import mxnet as mx
import numpy as np

from partial_fc_mx import dist


def rank_values(rank: int, shape: tuple, dtype: str) -> np.ndarray:
    values = np.random.default_rng(rank).standard_normal(shape).astype(dtype)
    if rank == 0:
        values.flat[:4] = [-0.0, np.nan, np.inf, -np.inf]
    return values


def same_floats(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit for bit, except that any NaN matches any NaN."""
    nan = np.isnan(a)
    return (a.dtype == b.dtype and np.array_equal(nan, np.isnan(b))
            and a[~nan].tobytes() == b[~nan].tobytes())


def main() -> None:
    world = dist.init()
    print(f"CYCLE TIME {os.environ['HOROVOD_CYCLE_TIME']} rank {world.rank}", flush=True)
    shapes = {"conv0_weight": ((4, 3, 3, 3), "float32"), "fc1_bias": ((7,), "float32"),
              "bn_gamma": ((5,), "float16")}
    params = {}
    for name, (shape, dtype) in shapes.items():
        param = mx.gluon.Parameter(name, shape=shape, dtype=dtype)
        param.initialize(ctx=mx.cpu())
        param.set_data(mx.nd.array(rank_values(world.rank, shape, dtype), dtype=dtype))
        params[name] = param
    dist.broadcast_parameters(params, root_rank=0)
    for name, (shape, dtype) in shapes.items():
        got = params[name].data().asnumpy()
        expected = rank_values(0, shape, dtype)
        assert same_floats(got, expected), \
            f"rank {world.rank}: {name} is {got.ravel()[:6]}, rank 0 has {expected.ravel()[:6]}"
    print(f"BROADCAST OK {world.rank} {world.size}", flush=True)


if __name__ == "__main__":
    main()
