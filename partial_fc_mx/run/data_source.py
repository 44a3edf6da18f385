"""Where a run's images come from, chosen by config `rec`: an indexed RecordIO
directory, a list of them trained as one (data/joined.py), or "random" tensors (speed
runs, no files). The trainer and the
preflight open the data through these two functions, so the preflight checks
exactly what training will read."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..data.joined import JoinedDataset
from ..data.loader import FaceLoader, RandomLoader
from ..data.recordio import RecordDataset

if TYPE_CHECKING:
    from ..config import Config
    from ..dist import World

RANDOM = "random"


def open_dataset(config: Config) -> RecordDataset | JoinedDataset | None:
    """The dataset `rec` names, or the datasets it lists, joined (a DataError naming the
    file when one cannot be read); None for random tensors."""
    if config.rec == RANDOM:
        return None
    if isinstance(config.rec, list):
        return JoinedDataset(config.rec, config.num_classes)
    return RecordDataset(config.rec, config.num_classes)


def make_loader(config: Config, world: World,
                dataset: RecordDataset | JoinedDataset | None) -> FaceLoader | RandomLoader:
    """This rank's loader over `dataset` (from open_dataset)."""
    batch = config.images_per_step()  # the trainer cuts it into the micro-batches
    if dataset is None:
        global_batch = batch * world.size
        images = config.num_image if config.num_image >= global_batch else 1000 * global_batch
        return RandomLoader(batch, config.num_classes, images,
                            world_size=world.size, seed=config.seed + world.rank)
    return FaceLoader(dataset, batch, rank=world.rank, world_size=world.size,
                      seed=config.seed, num_workers=decode_threads(config.num_workers, world),
                      skip_corrupt=config.skip_corrupt, augment=config.augmentation())


def decode_threads(configured: int, world: World) -> int:
    """`configured`, or when 0 this process's share of the host's cores, at least 2: the
    host's cores divided among its processes, or fewer when a launcher bound the
    process to fewer (bound to a socket, it shares that socket with other ranks)."""
    if configured:
        return configured
    cores = os.cpu_count() or 2
    mine = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    return max(2, min(mine, cores // max(world.local_size, 1)))


def identity_of(dataset: RecordDataset | JoinedDataset | None) -> dict | None:
    """What a checkpoint keeps of the dataset it was trained on, for `clean` to recognise
    it: classes, images and each train.idx's size and CRC-32 (None: random tensors)."""
    if dataset is None:
        return None
    parts = dataset.parts if isinstance(dataset, JoinedDataset) else [dataset]
    return {"classes": dataset.num_classes, "images": len(dataset),
            "index": [dict(part.records.offsets.fingerprint) for part in parts]}
