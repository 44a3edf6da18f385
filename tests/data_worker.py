"""One rank of the multi-process loader tests. Usage: data_worker.py DATASET_DIR CASE

shard:   every image has its own label; the ranks' batches over two epochs are
         gathered and checked: disjoint, covering B x W x steps, reshuffled.
corrupt: a record in some rank's shard is corrupt; every rank must raise the same
         DataError (through loader.in_step) instead of one rank waiting forever; each
         writes the message to DATASET_DIR/error.rank<R>.
uneven:  rank R reads DATASET_DIR/r<R>, copies of different sizes (hosts whose copies
         differ): every rank must raise the same DataError at the epoch's end.
"""

from __future__ import annotations

import sys
from pathlib import Path

import horovod.mxnet as hvd
import numpy as np

from partial_fc_mx.data.loader import FaceLoader, in_step
from partial_fc_mx.data.recordio import DataError, RecordDataset


def main() -> None:
    directory, case = sys.argv[1], sys.argv[2]
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    data = Path(directory) / f"r{rank}" if case == "uneven" else directory
    loader = FaceLoader(RecordDataset(data), 4, rank=rank, world_size=world, seed=9)
    if case in ("corrupt", "uneven"):
        try:
            for _ in in_step(loader.epoch(0)):
                pass
        except DataError as error:  # a file per rank: launchers may interleave stdout lines
            (Path(directory) / f"error.rank{rank}").write_text(str(error))
            return
        raise AssertionError(f"rank {rank}: the bad data went unnoticed ({case})")
    seen = [[int(label) for batch in in_step(loader.epoch(e)) for label in batch.labels]
            for e in (0, 1)]
    everyone = hvd.allgather_object(seen)
    if rank == 0:
        for epoch in (0, 1):
            labels = np.concatenate([np.array(r[epoch]) for r in everyone])
            assert len({len(r[epoch]) for r in everyone}) == 1, "unequal batch counts"
            assert len(labels) == len(loader) * 4 * world, len(labels)
            assert len(np.unique(labels)) == len(labels), "shards overlap"
        assert everyone[0][0] != everyone[0][1], "epoch 1 repeated epoch 0's order"
        print(f"SHARDS OK world={world} per-rank={len(everyone[0][0])} "
              f"of {len(RecordDataset(directory))}", flush=True)


if __name__ == "__main__":
    main()
