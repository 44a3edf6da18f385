"""Time and peak memory of the IJB protocol's bookkeeping at IJB-C's size, on
synthetic metadata: reading 469,375 pictures' metadata, scoring 15,658,489 template
pairs in blocks, and the ROC. The embedding itself holds one batch and the template
sums (templates x D), so it is left out: its cost is the network's.

    python -m partial_fc_mx.bench ijb
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

from ..data.align import ARCFACE_TEMPLATE
from ..evaluation import ijb
from .timing import MiB, PeakRSS

IJBC = {"pictures": 469_375, "templates": 23_124, "pairs": 15_658_489}
"""The sizes of IJB-C's 1:1 protocol."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pictures", type=int, default=IJBC["pictures"])
    parser.add_argument("--templates", type=int, default=IJBC["templates"])
    parser.add_argument("--pairs", type=int, default=IJBC["pairs"])
    parser.add_argument("--embedding-size", type=int, default=512)


def write_metadata(root: Path, pictures: int, templates: int, pairs: int) -> ijb.Layout:
    """IJBC/meta files of the given sizes."""
    rng = np.random.default_rng(0)
    meta = root / "IJBC" / "meta"
    meta.mkdir(parents=True)
    (root / "IJBC" / "loose_crop").mkdir()
    template = np.sort(rng.integers(0, templates, pictures))
    media = template * 10 + rng.integers(0, 3, pictures)
    scale = rng.uniform(1.0, 1.5, (pictures, 1, 1))  # the template, moved: face-like points
    points = (ARCFACE_TEMPLATE * scale + rng.uniform(0, 30, (pictures, 1, 2))).reshape(-1, 10)
    with open(meta / "ijbc_face_tid_mid.txt", "w") as faces, \
            open(meta / "ijbc_name_5pts_score.txt", "w") as landmarks:
        for i in range(pictures):
            faces.write(f"{i}.jpg {template[i]} {media[i]}\n")
            landmarks.write(f"{i}.jpg " + " ".join(f"{v:.3f}" for v in points[i]) + " 0.9\n")
    used = np.unique(template)
    with open(meta / "ijbc_template_pair_label.txt", "w") as out:
        for start in range(0, pairs, 1_000_000):
            count = min(1_000_000, pairs - start)
            rows = np.stack([rng.choice(used, count), rng.choice(used, count),
                             rng.integers(0, 2, count)], axis=1)
            out.write("\n".join(f"{a} {b} {c}" for a, b, c in rows.tolist()) + "\n")
    return ijb.Layout.of(root, "IJBC")


def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        layout = write_metadata(Path(tmp), args.pictures, args.templates, args.pairs)
        print(f"synthetic IJB-C metadata: {args.pictures:,} pictures, {args.templates:,} "
              f"templates, {args.pairs:,} pairs (written in {time.perf_counter() - start:.0f} s; "
              f"pairs file {layout.pairs.stat().st_size / MiB:,.0f} MiB)")
        baseline = psutil.Process().memory_info().rss
        phases = {}
        with measured("read the metadata", phases):
            pictures = ijb.read_pictures(layout)
        with measured("read the pairs", phases):
            pairs = ijb.read_pairs(pictures.template_ids, layout.pairs)
        rng = np.random.default_rng(1)
        features = rng.standard_normal((len(pictures.template_ids), args.embedding_size),
                                       dtype=np.float32)
        features /= np.linalg.norm(features, axis=1, keepdims=True)
        with measured("score the pairs", phases):
            scores = ijb.score_pairs(features, pairs)
        with measured("ROC and TAR@FAR", phases):
            ijb.tar_at_fars(ijb.roc_curve(scores, pairs.labels))
    for phase, (seconds, peak) in phases.items():
        print(f"  {phase:26s} {seconds:6.1f} s   peak RSS {peak / MiB:7,.0f} MiB")
    peak = max(peak for _, peak in phases.values())
    pairs_bytes = pairs.templates.nbytes + pairs.labels.nbytes
    print(f"peak RSS {peak / MiB:,.0f} MiB: {(peak - baseline) / MiB:,.0f} MiB above the "
          f"{baseline / MiB:,.0f} MiB of the process before (template features "
          f"{features.nbytes / MiB:,.0f} MiB, pairs {pairs_bytes / MiB:,.0f} MiB, "
          f"scores {scores.nbytes / MiB:,.0f} MiB)")


@contextlib.contextmanager
def measured(phase: str, phases: dict):
    """phases[phase] = (seconds, peak RSS) of the block."""
    with PeakRSS() as rss:
        start = time.perf_counter()
        yield
    phases[phase] = (time.perf_counter() - start, rss.peak)
