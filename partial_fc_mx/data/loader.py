"""Per-rank batches: disjoint shards of a global order reshuffled every epoch.

Every rank computes the same permutation of the image ids from (seed, epoch) and
takes every W-th id starting at its rank; the remainder that does not fill a
global batch (B x W images) is dropped, so every rank yields exactly the same
number of batches per epoch: unequal counts would leave a rank waiting forever in
the next collective. Decoding runs in worker threads; a producer thread keeps
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
from .recordio import DataError, RecordDataset, valid_class_ids
from .transforms import FACE_SIZE, decode_face, to_network_input

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
        dataset: RecordDataset,
        batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        num_workers: int = 2,
        prefetch: int = 2,
        mirror: bool = True,
        skip_corrupt: bool = False,
    ) -> None:
        self.dataset, self.batch_size = dataset, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.num_workers, self.prefetch = max(1, num_workers), max(1, prefetch)
        self.mirror, self.skip_corrupt = mirror, skip_corrupt
        self.steps_per_epoch = len(dataset) // (batch_size * world_size)
        if self.steps_per_epoch == 0:
            raise DataError(f"{dataset.records.rec_path} has {len(dataset)} images, fewer than "
                            f"one global batch ({batch_size} x {world_size} processes); lower "
                            "batch_size or add data")
        self.stats = LoaderStats()

    def __len__(self) -> int:
        return self.steps_per_epoch

    def record_ids(self, epoch: int) -> np.ndarray:
        """This rank's record ids for `epoch`, one row per batch (steps x B)."""
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))
        mine = order[self.rank::self.world_size][: self.steps_per_epoch * self.batch_size]
        return self.dataset.image_ids[mine].reshape(self.steps_per_epoch, self.batch_size)

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[Batch]:
        """The batches of one epoch from `start_step` on (to resume mid-epoch)."""
        ids = self.record_ids(epoch)
        mirrors = np.random.default_rng([self.seed, epoch, self.rank, 1]).random(ids.shape) < 0.5
        mirrors &= self.mirror
        ready: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def produce() -> None:
            with ThreadPoolExecutor(self.num_workers, thread_name_prefix="decode") as pool:
                for step in range(start_step, self.steps_per_epoch):
                    try:
                        item = self._load_batch(pool, ids[step], mirrors[step])
                    except Exception as error:  # handed to the consumer, raised there
                        item = error
                    while not stop.is_set():
                        try:
                            ready.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set() or isinstance(item, Exception):
                        return
            ready.put(None)

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

    def _load_batch(self, pool: ThreadPoolExecutor, ids: np.ndarray, mirrors: np.ndarray) -> Batch:
        """Each worker decodes a contiguous slice of the batch straight into place (one
        task per worker, not per image: per-image futures cost ~15% at 5k img/s)."""
        images = np.empty((len(ids), FACE_SIZE, FACE_SIZE, 3), np.uint8)
        labels = np.empty(len(ids), np.int64)
        slices = np.array_split(np.arange(len(ids)), self.num_workers)
        done = list(pool.map(lambda rows: self._load_rows(rows, ids, mirrors, images, labels),
                             slices))
        self.stats.resized += sum(resized for _, resized in done)
        bad_rows = [row for rows, _ in done for row in rows]
        corrupt = [int(ids[row]) for row in bad_rows]
        if corrupt and (not self.skip_corrupt or len(corrupt) == len(ids)):
            raise DataError(f"{self.dataset.records.rec_path}: records {corrupt} hold images that "
                            "cannot be decoded (not a valid JPEG/PNG). Re-pack the data, or set "
                            "skip_corrupt=True to train on the rest")
        if corrupt:  # repeat good samples of this batch in their place
            self.stats.skipped += corrupt
            log.warning("skipped corrupt records %s of %s (replaced within the batch)",
                        corrupt, self.dataset.records.rec_path)
            good_rows = np.setdiff1d(np.arange(len(ids)), bad_rows)
            for k, row in enumerate(bad_rows):
                source = good_rows[k % len(good_rows)]
                images[row], labels[row] = images[source], labels[source]
        return Batch(to_network_input(images), labels)

    def _load_rows(self, rows: np.ndarray, ids: np.ndarray, mirrors: np.ndarray,
                   images: np.ndarray, labels: np.ndarray) -> tuple[list, int]:
        """Decode ids[rows] into images[rows]; returns (rows that were corrupt, resized)."""
        corrupt, resized = [], 0
        for row in rows:
            record_id = int(ids[row])
            record = self.dataset.records.read(record_id)
            label = record.label
            if not valid_class_ids(label, self.dataset.num_classes):
                raise DataError(f"{self.dataset.records.rec_path}: record {record_id} has label "
                                f"{label}, outside the classes 0..{self.dataset.num_classes - 1}"
                                ". Fix num_classes (and the property file) or re-pack")
            image, was_resized = decode_face(record.image, bool(mirrors[row]))
            if image is None:
                corrupt.append(row)
                continue
            if was_resized and self.stats.resized + resized == 0:
                log.warning("%s: record %d is not %dx%d; resizing (counted in loader.stats)",
                            self.dataset.records.rec_path, record_id, FACE_SIZE, FACE_SIZE)
            images[row], labels[row] = image, int(label)
            resized += was_resized
        return corrupt, resized


def in_step(batches: Iterator[Batch]) -> Iterator[Batch]:
    """The batches, with every rank agreeing after each one that all ranks have theirs.

    A DataError on one rank (a corrupt record in its shard) is raised on every rank,
    with every failing rank's message, instead of leaving the others waiting in the
    next collective. Costs one tiny allreduce per step.
    """
    while True:
        batch, error = None, None
        try:
            batch = next(batches)
        except StopIteration:
            pass
        except DataError as failure:
            error = failure
        messages = dist.errors_on_any_rank(error, name="data")
        if messages:
            raise DataError("; ".join(messages))
        if batch is None:
            return
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

    def __init__(self, batch_size: int, num_classes: int, steps_per_epoch: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.steps_per_epoch, self.num_classes = steps_per_epoch, num_classes
        self.images = rng.standard_normal((batch_size, 3, FACE_SIZE, FACE_SIZE), np.float32)
        self.rng = rng

    def __len__(self) -> int:
        return self.steps_per_epoch

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[Batch]:
        for _ in range(start_step, self.steps_per_epoch):
            labels = self.rng.integers(0, self.num_classes, len(self.images))
            yield Batch(self.images, labels)
