"""One rank of the second-context test. Usage: context_worker.py COMMAND ARGS...

The model, the centers and every step's arrays live on cpu(1) (dist.device is
replaced); the data arrives in host memory as it does for a GPU. COMMAND and ARGS go
to partial_fc_mx's command line (train), run under context_guard's dispatch check.
Prints GUARDED <operators> <cached graphs> once the command returns. With
CENTERS_ON_CPU0=1 the class centers are put on cpu(0) instead: a deliberate mix.
"""

from __future__ import annotations

import os
import sys

import mxnet as mx
from context_guard import guard

from partial_fc_mx import dist, train
from partial_fc_mx.cli.main import main

dist.device = lambda local_rank: mx.cpu(1)
if os.environ.get("CENTERS_ON_CPU0"):
    partial_fc = train.PartialFC
    train.PartialFC = lambda *args, **kwargs: partial_fc(*args, **{**kwargs, "ctx": mx.cpu(0)})
with guard() as checked:
    code = main(sys.argv[1:])
print(f"GUARDED {checked.operators} {checked.cached_ops}", flush=True)
sys.exit(code)
