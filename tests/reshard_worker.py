"""One rank of the re-sharding test. Usage: reshard_worker.py CHECKPOINT_DIR [BLOCK_ROWS]

Each rank cuts its rows out of a checkpoint saved at another world size; rank 0
checks that the gathered shards equal the saved matrices (the weights and every
state of the centers' optimizer) bit for bit, and prints RESHARD OK <saved W> -> <this W>.
With BLOCK_ROWS, each rank stores its rows in blocks of that many (as a shard past
one MXNet array is stored).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import horovod.mxnet as hvd
import numpy as np

from partial_fc_mx.pfc import center_optimizers
from partial_fc_mx.pfc.partial_fc import PartialFC
from partial_fc_mx.run.checkpoint import center_file, load_centers


def main() -> None:
    checkpoint = Path(sys.argv[1])
    hvd.init()
    meta = json.loads((checkpoint / "meta.json").read_text())
    optimizer = center_optimizers.build(meta["center_optimizer"])
    block_rows = int(sys.argv[2]) if len(sys.argv) > 2 else None
    k = meta.get("num_subcenters", 1)
    pfc = PartialFC(meta["num_classes"], meta["embedding_size"], rank=hvd.rank(),
                    world_size=hvd.size(), optimizer=optimizer, center_block_rows=block_rows,
                    num_subcenters=k)
    assert len(pfc.centers.blocks) == (-(-pfc.shard.count * k // block_rows) if block_rows
                                       else 1)
    load_centers(checkpoint, meta, pfc, with_states=True)
    names = ["weight", *meta["center_states"]]
    assert names[1:] == pfc.centers.state_names(), names
    state = pfc.centers.state_dict()
    gathered = {name: hvd.allgather_object(state[name]) for name in names}
    if hvd.rank() == 0:
        for name in names:
            original = np.concatenate([np.load(checkpoint / center_file(r, name))
                                       for r in range(meta["world_size"])])
            assert len(original) == meta["num_classes"] * k, (name, original.shape)
            assert np.concatenate(gathered[name]).tobytes() == original.tobytes(), name
            assert np.abs(original).sum() > 0, f"{name} was not saved"
        print(f"RESHARD OK {meta['world_size']} -> {hvd.size()} {' '.join(names)}"
              f"{f' K={k}' if k > 1 else ''}", flush=True)


if __name__ == "__main__":
    main()
