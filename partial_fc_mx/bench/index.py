"""Opening a dataset's record index at the size of the largest face datasets: seconds
and private memory per rank, with 1 and with several ranks opening at once.

    python -m partial_fc_mx.bench index --records 42474559 --ranks 1 2

Generates (once, in --dir) a train.idx of that many records with offsets as large as
a real dataset's (about 10 KB per image), a sparse train.rec holding only the records
an open reads, and property. Each measurement runs fresh processes that import the
reader, then open the dataset at the same moment; "private" is the memory no other
process shares (anonymous pages: the mapped cache's pages are the page cache's, one
copy per host). The first open of a new index parses it and writes the cache; that
one-time cost is printed apart.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from pathlib import Path

from .timing import MiB

RECORD_BYTES = 10_000
"""About the size of one 112 x 112 JPEG record (WebFace42M: 859 MiB of index for
42.5M records)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--records", type=int, default=42_474_559,
                       help="image records (WebFace42M: 42474559; MS1MV3: 5179510)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2],
                       help="processes opening the dataset at once")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/pfc_bench_index",
                       help="where the generated dataset is kept between runs")


def run(args: argparse.Namespace) -> None:
    directory = Path(args.dir) / f"records-{args.records}"
    if not (directory / "property").is_file():
        started = time.perf_counter()
        generate_dataset(directory, args.records)
        print(f"generated {directory}/train.idx in {time.perf_counter() - started:.1f} s")
    idx = directory / "train.idx"
    print(f"{args.records:,} image records, train.idx {idx.stat().st_size / MiB:,.0f} MiB")
    for cache in directory.glob("train.idx.cache"):
        cache.unlink()
    first = open_at_once(directory, 1)[0]
    print(f"first open (parses train.idx, writes the cache): {first['seconds']:.1f} s, "
          f"private +{first['private_mib']:,.0f} MiB at its peak")
    for ranks in args.ranks:
        runs = [open_at_once(directory, ranks) for _ in range(args.repeats)]
        seconds = [r["seconds"] for run in runs for r in run]
        private = [r["private_mib"] for run in runs for r in run]
        print(f"{ranks} rank(s) opening at once, {args.repeats} runs: open "
              f"{statistics.mean(seconds):.2f} s (max {max(seconds):.2f}), private memory "
              f"+{statistics.mean(private):,.0f} MiB per rank (max {max(private):,.0f})")


def open_at_once(directory: Path, ranks: int) -> list[dict]:
    """Each of `ranks` fresh processes opens the dataset after a common barrier."""
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(ranks), context.Queue()
    workers = [context.Process(target=open_once, args=(directory, barrier, results))
               for _ in range(ranks)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if any(worker.exitcode for worker in workers):
        raise RuntimeError(f"a process opening {directory} failed: exit codes "
                           f"{[worker.exitcode for worker in workers]}")
    return [results.get() for _ in workers]


def open_once(directory: Path, barrier, results) -> None:
    from ..data.recordio import RecordDataset

    before = private_bytes()
    Path("/proc/self/clear_refs").write_text("5")  # the resident peak restarts from now
    barrier.wait()
    started = time.perf_counter()
    dataset = RecordDataset(directory)
    seconds = time.perf_counter() - started
    results.put({"seconds": seconds, "images": len(dataset),
                 "private_mib": (peak_private_bytes() - before) / MiB})


def private_bytes() -> int:
    """Anonymous resident memory (RssAnon): pages this process alone pays for."""
    return status_kib("RssAnon") * 1024


def peak_private_bytes() -> int:
    """An upper bound on the private memory's peak since clear_refs: the resident peak
    (VmHWM) less the file-backed and shared pages resident now."""
    return max(private_bytes(), (status_kib("VmHWM") - status_kib("RssFile")
                                 - status_kib("RssShmem")) * 1024)


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def generate_dataset(directory: Path, images: int) -> None:
    """train.idx for `images` images after a header record, plus one identity record;
    a sparse train.rec with the records an open may read (the header, the last images,
    whose count float32 rounds, and the identity record after them); property."""
    import mxnet as mx
    import numpy as np

    directory.mkdir(parents=True, exist_ok=True)
    offsets = np.arange(images + 2, dtype=np.int64) * RECORD_BYTES
    header = mx.recordio.pack(mx.recordio.IRHeader(2, [images + 1.0, images + 2.0], 0, 0), b"")
    image = mx.recordio.pack(mx.recordio.IRHeader(0, 0.0, images, 0), b"\xff\xd8jpeg")
    identity = mx.recordio.pack(mx.recordio.IRHeader(2, [1.0, images + 1.0], 0, 0), b"")
    with open(directory / "train.rec", "wb") as rec:
        last_images = [(i, image) for i in range(max(1, images - 16), images + 1)]
        for record_id, payload in ((0, header), *last_images, (images + 1, identity)):
            rec.seek(int(offsets[record_id]))
            rec.write(record_bytes(payload))
    with open(directory / "train.idx", "wb") as idx:
        block = 1_000_000
        for start in range(0, len(offsets), block):
            stop = min(start + block, len(offsets))
            idx.write("".join(f"{i}\t{o}\n" for i, o in
                              zip(range(start, stop), offsets[start:stop].tolist())).encode())
    (directory / "property").write_text("1,112,112")


def record_bytes(payload: bytes) -> bytes:
    """One RecordIO record: magic, length, payload padded to 4 bytes."""
    import struct

    from ..data.recordio import MAGIC

    padded = payload + b"\0" * (-len(payload) % 4)
    return struct.pack("<II", MAGIC, len(payload)) + padded
