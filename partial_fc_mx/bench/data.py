"""Decode and augmentation throughput of our loader against mx.io.ImageRecordIter on
the same file, and the data wait while a GPU-like step runs."""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import mxnet as mx

from ..config import load_config
from ..data.loader import FaceLoader, WaitTimer
from ..data.recordio import RecordDataset
from ..data.transforms import FACE_SIZE
from ..prep.synthetic import prepare_synthetic

REPO = Path(__file__).resolve().parents[2]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--classes", type=int, default=200)
    parser.add_argument("--per-class", type=int, default=20)
    parser.add_argument("--step-ms", type=float, default=100.0,
                        help="simulated step time for the data-wait figure")


def images_per_second(batches, count: int, batch_size: int) -> float:
    """Throughput of pulling `count` batches from an iterator (after one warm-up batch)."""
    next(batches)
    start = time.perf_counter()
    for _ in range(count):
        next(batches)
    return count * batch_size / (time.perf_counter() - start)


def without_header(source: Path, target: Path) -> Path:
    """The same JPEG records as an im2rec-style file (keys 0.., no header record),
    which is what mx.io.ImageRecordIter expects."""
    dataset = RecordDataset(source)
    target.mkdir(parents=True, exist_ok=True)
    writer = mx.recordio.MXIndexedRecordIO(str(target / "train.idx"),
                                           str(target / "train.rec"), "w")
    for key, record_id in enumerate(dataset.image_ids):
        writer.write_idx(key, dataset.records.read_bytes(int(record_id)))
    writer.close()
    return target


def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ours_dir = Path(tmp) / "ours"
        prepare_synthetic(str(ours_dir), args.classes, args.per_class, heldout=2, pairs=1)
        theirs = without_header(ours_dir, Path(tmp) / "im2rec")
        dataset = RecordDataset(ours_dir)
        batches = len(dataset) // args.batch_size - 1
        print(f"decode + mirror + normalize of {len(dataset)} 112x112 JPEGs, batch "
              f"{args.batch_size}, {batches} batches per measurement, {os.cpu_count()} cores")
        for workers in sorted({1, args.workers}):
            loader = FaceLoader(dataset, args.batch_size, num_workers=workers, seed=0)
            ours = images_per_second(iter(loader.epoch(0)), batches, args.batch_size)
            record_iter = mx.io.ImageRecordIter(
                path_imgrec=str(theirs / "train.rec"), path_imgidx=str(theirs / "train.idx"),
                data_shape=(3, FACE_SIZE, FACE_SIZE), batch_size=args.batch_size, shuffle=True,
                rand_mirror=True, mean_r=127.5, mean_g=127.5, mean_b=127.5, scale=1 / 128,
                preprocess_threads=workers, prefetch_buffer=2)
            theirs_rate = images_per_second(iter(record_iter), batches, args.batch_size)
            print(f"  {workers} worker(s): ours {ours:7.0f} img/s ({ours / workers:6.0f} per "
                  f"worker)   mx.io.ImageRecordIter {theirs_rate:7.0f} img/s   ratio "
                  f"{ours / theirs_rate:.2f}")
        plain = FaceLoader(dataset, args.batch_size, num_workers=args.workers, seed=0)
        recipe = load_config(REPO / "configs" / "orl.py").augmentation()
        augmented = FaceLoader(dataset, args.batch_size, num_workers=args.workers, seed=0,
                               augment=recipe)
        rates = [images_per_second(iter(loader.epoch(0)), batches, args.batch_size)
                 for loader in (plain, augmented, plain)]  # plain twice: the noise between
        print(f"  {args.workers} worker(s), with crop, rotation, colour and blur (configs/"
              f"orl.py): {rates[1]:7.0f} img/s; without: {rates[0]:7.0f} and {rates[2]:7.0f} "
              f"img/s; ratio {2 * rates[1] / (rates[0] + rates[2]):.2f}")
        loader = FaceLoader(dataset, args.batch_size, num_workers=args.workers, seed=0)
        wait, start = WaitTimer(), time.perf_counter()
        for _ in zip(range(batches), wait.timed(loader.epoch(0))):
            time.sleep(args.step_ms / 1000)  # an accelerator busy with the step: CPU idle
        total = time.perf_counter() - start
        print(f"data wait with {args.workers} workers while a {args.step_ms:.0f} ms step runs "
              f"elsewhere (GPU-like: CPU free): {100 * wait.seconds / total:.1f}% of the time")
