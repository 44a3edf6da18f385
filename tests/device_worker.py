"""One rank of the device-choice tests. Usage: device_worker.py GPUS COMMAND ARGS...

GPUS lists how many GPUs each rank pretends to see ("2,2,2": three ranks, two GPUs
each; "1,0": rank 1 sees none). COMMAND and ARGS go to partial_fc_mx's command line
(check or train) after dist.visible_gpus is replaced: what this CPU-only MXNet would
do on such a host, up to the first use of a GPU, which it cannot make.
"""

from __future__ import annotations

import os
import sys

from partial_fc_mx import dist
from partial_fc_mx.__main__ import main

gpus = [int(count) for count in sys.argv[1].split(",")]
rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("HOROVOD_RANK", "0")))
dist.visible_gpus = lambda: gpus[rank]
sys.exit(main(sys.argv[2:]))
