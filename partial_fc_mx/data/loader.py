"""Per-rank batches: disjoint shards of a global order reshuffled every epoch.

Every rank computes the same permutation of the image ids from (seed, epoch). A
global batch of G = B x W images takes the next G positions of that order, and
rank r takes every W-th of them starting at r; the remainder that does not fill a
global batch is dropped, so every rank yields exactly the same number of batches
per epoch: unequal counts would leave a rank waiting forever in the next
collective. Because a global batch is a run of positions, whatever W is, an epoch
can be resumed at any image position on another number of processes: the rest of
the order is trained on, nothing skipped or repeated. Mirror flags belong to
positions too. Decoding runs in worker threads; a producer thread keeps
`prefetch` batches ready.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from .. import dist
from . import DataError
from .augment import Augmentation
from .joined import JoinedDataset
from .network_input import to_network_input
from .recordio import RecordDataset, valid_class_ids
from .transforms import FACE_SIZE, decode_face, decode_in_workers

log = logging.getLogger(__name__)


@dataclass
class Batch:
    images: np.ndarray
    """B x 3 x 112 x 112 float32, normalized."""
    labels: np.ndarray
    """B int64 class ids."""


@dataclass
class LoaderStats:
    resized: int = 0
    skipped: list = field(default_factory=list)
    """Record ids of corrupt images replaced (only with skip_corrupt)."""


class FaceLoader:
    def __init__(
        self,
        dataset: RecordDataset | JoinedDataset,
        batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        num_workers: int = 2,
        prefetch: int = 2,
        mirror: bool = True,
        skip_corrupt: bool = False,
        augment: Augmentation | None = None,
    ) -> None:
        self.dataset, self.batch_size = dataset, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.num_workers, self.prefetch = max(1, num_workers), max(1, prefetch)
        self.mirror, self.skip_corrupt = mirror, skip_corrupt
        self.augment = augment if augment is not None and augment.active else None
        self.num_images = len(dataset)
        """Images in one epoch's order (all ranks together)."""
        self.global_batch = batch_size * world_size
        self.steps_per_epoch = self.num_images // self.global_batch
        if self.steps_per_epoch == 0:
            raise DataError(f"{describe(dataset)} has {len(dataset)} images, fewer than "
                            f"one global batch ({batch_size} x {world_size} processes); lower "
                            "batch_size or add data")
        self.stats = LoaderStats()

    def __len__(self) -> int:
        return self.steps_per_epoch

    def positions(self, start: int = 0) -> np.ndarray:
        """This rank's positions in the epoch's order from image `start` on, one row per
        batch: global batch k holds positions start + kG .. start + (k+1)G - 1."""
        steps = (self.num_images - start) // self.global_batch
        offsets = self.rank + self.world_size * np.arange(steps * self.batch_size)
        return (start + offsets).reshape(steps, self.batch_size)

    def record_ids(self, epoch: int, start: int = 0) -> np.ndarray:
        """This rank's record ids for `epoch` from image `start` on (steps x B)."""
        return self._record_ids(epoch, self.positions(start))

    def _record_ids(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        order = np.random.default_rng([self.seed, epoch]).permutation(self.num_images)
        return self.dataset.record_ids(order[positions])

    def _mirror_flags(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """Which images at `positions` are mirrored: one random bit per position of the
        epoch (packed, so N images cost N / 8 bytes), independent of the world size."""
        if not self.mirror:
            return np.zeros(positions.shape, bool)
        bits = np.frombuffer(np.random.default_rng([self.seed, epoch, 1]).bytes(
            (self.num_images + 7) // 8), np.uint8)
        return (bits[positions >> 3] >> (positions & 7)) & 1 == 1

    def epoch(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        """The batches of one epoch from image `start` of its order on (to resume)."""
        positions = self.positions(start)  # they also seed each image's augmentation
        ids, mirrors = self._record_ids(epoch, positions), self._mirror_flags(epoch, positions)
        ready: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def offer(item) -> bool:
            """Put `item` unless the consumer has gone; a stopped consumer no longer
            takes batches, so a blocking put could wait forever."""
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                decode_in_workers()
                with ThreadPoolExecutor(self.num_workers, thread_name_prefix="decode") as pool:
                    for row in range(len(ids)):
                        batch = self._load_batch(pool, ids[row], mirrors[row],
                                                 (epoch, positions[row]))
                        if not offer(batch):
                            return
            except Exception as error:  # handed to the consumer, raised there
                offer(error)
                return
            offer(None)

        producer = threading.Thread(target=produce, daemon=True, name="batches")
        producer.start()
        try:
            while (item := ready.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            stop.set()
            producer.join()

    def _load_batch(self, pool: ThreadPoolExecutor, ids: np.ndarray, mirrors: np.ndarray,
                    where: tuple[int, np.ndarray]) -> Batch:
        """Each worker decodes a contiguous slice of the batch straight into place (one
        task per worker, not per image: per-image futures cost ~15% at 5k img/s).
        `where`: the epoch and the batch's positions in its order, which seed the
        augmentation of each image."""
        images = np.empty((len(ids), FACE_SIZE, FACE_SIZE, 3), np.uint8)
        labels = np.empty(len(ids), np.int64)
        slices = np.array_split(np.arange(len(ids)), self.num_workers)
        done = list(pool.map(
            lambda rows: self._load_rows(rows, ids, mirrors, where, images, labels), slices))
        self.stats.resized += sum(resized for _, resized in done)
        bad_rows = [row for rows, _ in done for row in rows]
        corrupt = [int(ids[row]) for row in bad_rows]
        named = "; ".join(self.dataset.records.where(record_id) for record_id in corrupt)
        if corrupt and (not self.skip_corrupt or len(corrupt) == len(ids)):
            raise DataError(f"images that cannot be decoded (not a valid JPEG/PNG): {named}. "
                            "Re-pack the data, or set skip_corrupt=True to train on the rest")
        if corrupt:  # repeat good samples of this batch in their place
            self.stats.skipped += corrupt
            log.warning("skipped corrupt images (replaced within the batch): %s", named)
            good_rows = np.setdiff1d(np.arange(len(ids)), bad_rows)
            for k, row in enumerate(bad_rows):
                source = good_rows[k % len(good_rows)]
                images[row], labels[row] = images[source], labels[source]
        return Batch(to_network_input(images), labels)

    def _load_rows(self, rows: np.ndarray, ids: np.ndarray, mirrors: np.ndarray,
                   where: tuple[int, np.ndarray], images: np.ndarray,
                   labels: np.ndarray) -> tuple[list, int]:
        """Decode ids[rows] into images[rows]; returns (rows that were corrupt, resized)."""
        corrupt, resized = [], 0
        for row in rows:
            record_id = int(ids[row])
            record = self.dataset.records.read(record_id)
            label = record.label
            if not valid_class_ids(label, self.dataset.num_classes):
                raise DataError(f"{self.dataset.records.where(record_id)} has label {label}, "
                                f"outside the classes 0..{self.dataset.num_classes - 1}. Fix "
                                "num_classes (and the property file) or re-pack")
            image, was_resized = decode_face(record.image, bool(mirrors[row]))
            if image is None:
                corrupt.append(row)
                continue
            if was_resized and self.stats.resized + resized == 0:
                log.warning("%s is not %dx%d; resizing (counted in loader.stats)",
                            self.dataset.records.where(record_id), FACE_SIZE, FACE_SIZE)
            if self.augment:
                epoch, positions = where
                image = self.augment(image, np.random.default_rng(
                    [self.seed, epoch, 2, int(positions[row])]))
            images[row], labels[row] = image, int(label)
            resized += was_resized
        return corrupt, resized


def describe(dataset: RecordDataset | JoinedDataset) -> str:
    """The dataset's files as messages name them."""
    parts = getattr(dataset, "parts", [dataset])
    return " + ".join(str(part.records.rec_path) for part in parts)


def in_step(batches: Iterator[Batch]) -> Iterator[Batch]:
    """The batches, with every rank agreeing after each one that all ranks have theirs.

    A DataError on one rank (a corrupt record in its shard) is raised on every rank,
    with every failing rank's message, instead of leaving the others waiting in the
    next collective; so is a rank running out of batches before the others (hosts
    whose copies of the dataset differ). Costs one tiny allreduce per step.
    """
    count = 0
    while True:
        batch, error = None, None
        try:
            batch = next(batches)
        except StopIteration:
            pass
        except DataError as failure:
            error = failure
        failed, ready = dist.sum_over_ranks([error is not None, batch is not None], name="data")
        dist.raise_on_every_rank(error, name="data", failed=failed > 0)
        if 0 < ready < dist.world_size():
            counts = dist.allgather_object(count + (batch is not None), name="data.counts")
            raise DataError(
                "the ranks disagree about the end of the epoch: "
                + ", ".join(f"rank {r} has {n}{'+' if n > count else ''} batches"
                            for r, n in enumerate(counts))
                + ". Their copies of the dataset differ (compare train.idx on every host, "
                "or run the preflight: python -m partial_fc_mx check)")
        if not ready:
            return
        count += 1
        yield batch


class WaitTimer:
    """Seconds a consumer spent waiting for the next batch. Their share of the wall
    time tells whether the data pipeline, rather than the network, limits the speed."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def timed(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        iterator = iter(batches)
        while True:
            asked = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self.seconds += time.perf_counter() - asked
            yield batch


class RandomLoader:
    """Throughput mode: random tensors of the right shape, no decoding at all."""

    def __init__(self, batch_size: int, num_classes: int, num_images: int,
                 world_size: int = 1, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.num_images, self.num_classes = num_images, num_classes
        self.global_batch = batch_size * world_size
        self.steps_per_epoch = num_images // self.global_batch
        self.images = rng.standard_normal((batch_size, 3, FACE_SIZE, FACE_SIZE), np.float32)
        self.rng = rng

    def __len__(self) -> int:
        return self.steps_per_epoch

    def epoch(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        for _ in range((self.num_images - start) // self.global_batch):
            labels = self.rng.integers(0, self.num_classes, len(self.images))
            yield Batch(self.images, labels)
