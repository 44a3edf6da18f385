"""One rank of the re-sharding test. Usage: reshard_worker.py CHECKPOINT_DIR

Each rank cuts its rows out of a checkpoint saved at another world size; rank 0
checks that the gathered shards equal the saved matrix (weights and momentum) bit
for bit, and prints RESHARD OK <saved W> -> <this W>.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import horovod.mxnet as hvd
import numpy as np

from partial_fc_mx.checkpoint import load_centers
from partial_fc_mx.partial_fc import PartialFC


def main() -> None:
    checkpoint = Path(sys.argv[1])
    hvd.init()
    meta = json.loads((checkpoint / "meta.json").read_text())
    pfc = PartialFC(meta["num_classes"], meta["embedding_size"], rank=hvd.rank(),
                    world_size=hvd.size())
    load_centers(checkpoint, meta, pfc, with_momentum=True)
    weights = hvd.allgather_object(pfc.weight.asnumpy())
    momenta = hvd.allgather_object(pfc.momentum.asnumpy())
    if hvd.rank() == 0:
        saved = range(meta["world_size"])
        for name, got in (("", weights), ("_mom", momenta)):
            original = np.concatenate([np.load(checkpoint / f"rank_{r}_softmax_weight{name}.npy")
                                       for r in saved])
            assert original.shape == (meta["num_classes"], meta["embedding_size"])
            assert np.concatenate(got).tobytes() == original.tobytes(), f"{name} differs"
        assert np.abs(np.concatenate(momenta)).sum() > 0, "momentum was not saved"
        print(f"RESHARD OK {meta['world_size']} -> {hvd.size()}", flush=True)


if __name__ == "__main__":
    main()
