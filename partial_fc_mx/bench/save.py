"""The cost of durable, checksummed checkpoint files: a shard written as
checkpoint.save writes it (CRC-32 while writing, fsync), next to a plain np.save
that the page cache absorbs, in the same run."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from .. import durable
from .timing import median_ms


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=250_000)
    parser.add_argument("--embedding-size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: the temp dir)")


def run(args: argparse.Namespace) -> None:
    shard = np.random.default_rng(0).standard_normal((args.rows, args.embedding_size),
                                                     np.float32)
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        path = Path(directory) / "shard.npy"

        def plain() -> None:
            np.save(path, shard)

        def plain_fsync() -> None:
            np.save(path, shard)
            durable.fsync_path(path)

        def durable_write() -> None:
            durable.write_file(path, lambda f: np.save(f, shard))

        def verify() -> None:
            durable.file_record(path)

        megabytes = shard.nbytes / 2**20
        timings = {name: median_ms(run, args.repeats) for name, run in
                   (("np.save", plain), ("np.save + fsync", plain_fsync),
                    ("checksummed + fsync", durable_write),
                    ("verify (read back + CRC-32)", verify))}
    print(f"one shard of {args.rows} x {args.embedding_size} float32 ({megabytes:.0f} MiB) "
          f"in {args.dir or tempfile.gettempdir()}:")
    for name, ms in timings.items():
        print(f"  {name:28s} {ms:8.1f} ms  {megabytes / ms * 1e3:7.0f} MiB/s  "
              f"{ms / timings['np.save']:.2f}x np.save")
