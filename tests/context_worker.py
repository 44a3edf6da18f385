"""One rank of the second-context test. Usage: context_worker.py COMMAND ARGS...

The model, the centers and every step's arrays live on cpu(1) (dist.device is
replaced); the data arrives in host memory as it does for a GPU. COMMAND and ARGS go
to partial_fc_mx's command line (train), run under context_guard's dispatch check.
Partial FC's row passes and SGD's update of the centers are MXNet's operators, as on
a GPU (ComposedRows, SGD without its fused CPU kernel), not the C++ kernels a CPU
context gets. Prints GUARDED <operators> <cached graphs> once the command returns,
and COMPOSED <row passes built> <SGD updates> <SGD replays> (the exact update's, of
the rows a step did not sample). With CENTERS_ON_CPU0=1 the class centers are put on
cpu(0) instead: a deliberate mix.
"""

from __future__ import annotations

import os
import sys

import mxnet as mx
from context_guard import guard

from partial_fc_mx import dist, train
from partial_fc_mx.cli.main import main
from partial_fc_mx.pfc import partial_fc
from partial_fc_mx.pfc.center_optimizers import sgd
from partial_fc_mx.pfc.rows import ComposedRows

dist.device = lambda local_rank: mx.cpu(1)
composed = {"rows": 0, "update": 0, "replay": 0}
fused_update, fused_replay = sgd.SGD.update, sgd.SGD.replay


def composed_rows(ctx, buffers):
    composed["rows"] += 1
    return ComposedRows(buffers)


def update(self, *args, **kwargs):
    composed["update"] += 1
    return fused_update(self, *args, **kwargs)


def replay(self, *args, **kwargs):
    composed["replay"] += 1
    return fused_replay(self, *args, **kwargs)


partial_fc.row_passes = composed_rows
sgd.fused_kernel_applies = lambda centers: False  # MXNet's operators, as on a GPU
sgd.SGD.update, sgd.SGD.replay = update, replay
if os.environ.get("CENTERS_ON_CPU0"):
    built = train.PartialFC
    train.PartialFC = lambda *args, **kwargs: built(*args, **{**kwargs, "ctx": mx.cpu(0)})
with guard() as checked:
    code = main(sys.argv[1:])
print(f"GUARDED {checked.operators} {checked.cached_ops}", flush=True)
print(f"COMPOSED {composed['rows']} {composed['update']} {composed['replay']}", flush=True)
sys.exit(code)
