"""One rank of the device-choice tests. Usage: device_worker.py GPUS COMMAND ARGS...

GPUS lists how many GPUs each rank pretends to see ("2,2,2": three ranks, two GPUs
each; "1,0": rank 1 sees none). COMMAND and ARGS go to partial_fc_mx's command line
(check or train) after dist.visible_gpus is replaced: what this CPU-only MXNet would
do on such a host, up to the first use of a GPU, which it cannot make. With the
stand-in libcuda.so.1 (tests/fake_libcuda.c) on LD_LIBRARY_PATH, FAKE_GPUS_BY_RANK
("specification of rank 0|of rank 1|...") sets each rank's FAKE_CUDA_GPUS: which GPUs,
on which PCI buses, the driver reports to it.
"""

from __future__ import annotations

import os
import sys

from partial_fc_mx import dist
from partial_fc_mx.cli.main import main

gpus = [int(count) for count in sys.argv[1].split(",")]
rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("HOROVOD_RANK", "0")))
dist.visible_gpus = lambda: gpus[rank]
if "FAKE_GPUS_BY_RANK" in os.environ:
    os.environ["FAKE_CUDA_GPUS"] = os.environ["FAKE_GPUS_BY_RANK"].split("|")[rank]
sys.exit(main(sys.argv[2:]))
