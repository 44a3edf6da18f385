"""One rank of tests/test_plan.py's recording of a real step's collectives.

Usage: collectives_worker.py OUT COMMAND ARGS... COMMAND and ARGS go to partial_fc_mx's
command line (train). Every Horovod collective the process calls is recorded (the
function, its tensor's shape and dtype, the bytes it carries: an allgather's gathered
output, an allreduce's tensor); those of the backbone's gradient allreduce are summed
into one entry, as `plan` counts them. The collectives of step STEP (from its
train_step to the next one's, so its after_step's too) go to OUT.rank<R>.json.
"""

from __future__ import annotations

import json
import sys

import horovod.mxnet as hvd
import horovod.mxnet.functions as hvd_functions
import numpy as np

from partial_fc_mx import train
from partial_fc_mx.cli.main import main

STEP = 2
"""A step in the middle of the run: neither the first's set-up nor the last's save."""

recording = {"step": 0, "calls": [], "gradients": None}


def entry(op: str, tensors: list) -> dict:
    dtypes = [np.dtype(t.dtype) for t in tensors]
    return {"op": op, "bytes": sum(t.size * d.itemsize for t, d in zip(tensors, dtypes)),
            "shapes": [list(t.shape) for t in tensors], "dtypes": sorted({d.name for d in dtypes})}


def record(op: str, tensors: list) -> None:
    if recording["step"] != STEP:
        return
    if recording["gradients"] is not None:  # inside the trainer's gradient allreduce
        recording["gradients"].append(entry(op, tensors))
    else:
        recording["calls"].append(entry(op, tensors))


def recorded(name: str, op: str, gathers: bool = False):
    """horovod.mxnet.<name>, recording each call's tensors (an allgather's output); also
    where horovod.mxnet.functions calls it (allgather_object, broadcast_object)."""
    for module in (hvd, hvd_functions):
        if not hasattr(module, name):
            continue
        original = getattr(module, name)

        def call(*args, original=original, **kwargs):
            result = original(*args, **kwargs)
            given = kwargs.get("tensors", kwargs.get("tensor", args[0] if args else None))
            tensors = given if isinstance(given, (list, tuple)) else [given]
            record(op, [result] if gathers else list(tensors))
            return result

        setattr(module, name, call)


for function in ("allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_"):
    recorded(function, "allreduce")
recorded("allgather", "allgather", gathers=True)
for function in ("broadcast", "broadcast_", "alltoall", "reducescatter",
                 "grouped_allgather", "grouped_reducescatter"):
    if hasattr(hvd, function):
        recorded(function, function)

train_step = train.train_step


def counted_step(*args, **kwargs):
    recording["step"] += 1
    return train_step(*args, **kwargs)


train.train_step = counted_step
allreduce_grads = hvd.DistributedTrainer._allreduce_grads


def gradients_as_one(self):
    """The trainer's allreduce of every gradient, one entry of their bytes."""
    recording["gradients"] = []
    try:
        allreduce_grads(self)
    finally:
        parts, recording["gradients"] = recording["gradients"], None
        if parts:
            recording["calls"].append({"op": "allreduce", "gradients": True,
                                       "bytes": sum(p["bytes"] for p in parts),
                                       "shapes": [], "dtypes": sorted(
                                           {d for p in parts for d in p["dtypes"]})})


hvd.DistributedTrainer._allreduce_grads = gradients_as_one
code = main(sys.argv[2:])
with open(f"{sys.argv[1]}.rank{hvd.rank()}.json", "w") as out:
    json.dump({"steps": recording["step"], "calls": recording["calls"]}, out)
sys.exit(code)
