"""`python -m partial_fc_mx inspect DIR [--scan]`: what a dataset holds, and what is wrong.

Reads every image record's header (label), so it touches the whole .rec once;
`--scan` also decodes every image to find corrupt ones.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import mxnet as mx
import numpy as np

from .recordio import RecordDataset
from .transforms import decode_face


@dataclass
class InspectReport:
    images: int = 0
    classes: int = 0
    per_class: tuple = (0, 0, 0)
    """Images per class: min, median, max."""
    has_header: bool = False
    resized: int = 0
    corrupt: list = field(default_factory=list)
    problems: list = field(default_factory=list)


def inspect_dataset(directory: str, scan: bool = False, workers: int = 4) -> InspectReport:
    dataset = RecordDataset(directory)
    records = dataset.records
    report = InspectReport(images=len(dataset), has_header=dataset.has_header)
    labels = np.array([records.read(int(i)).label for i in dataset.image_ids])
    bad = (labels != np.floor(labels)) | (labels < 0) | (labels >= dataset.num_classes)
    for record_id, label in zip(dataset.image_ids[bad][:10], labels[bad][:10]):
        report.problems.append(f"record {record_id}: label {label} outside 0.."
                               f"{dataset.num_classes - 1} (property says "
                               f"{dataset.num_classes} classes)")
    counts = Counter(labels[~bad].astype(int).tolist())
    report.classes = len(counts)
    if counts:
        sizes = sorted(counts.values())
        report.per_class = (sizes[0], int(np.median(sizes)), sizes[-1])
    if report.classes < dataset.num_classes:
        report.problems.append(f"only {report.classes} of the {dataset.num_classes} classes in "
                               "property have images")
    if report.has_header:
        report.problems += identity_record_problems(dataset, labels)
    if scan:
        with ThreadPoolExecutor(workers) as pool:
            decoded = pool.map(lambda i: (i, decode_face(records.read(int(i)).image)),
                               dataset.image_ids)
            for record_id, (image, resized) in decoded:
                if image is None:
                    report.corrupt.append(int(record_id))
                report.resized += resized
        if report.corrupt:
            report.problems.append(f"{len(report.corrupt)} corrupt image(s), records "
                                   f"{report.corrupt[:10]}")
    return report


def identity_record_problems(dataset: RecordDataset, labels: np.ndarray) -> list[str]:
    """The per-class records after the images must cover the images of one label each."""
    records = dataset.records
    header = mx.recordio.unpack(records.read_bytes(0))[0]
    first, end = int(header.label[0]), int(header.label[1])
    problems = []
    for record_id in range(first, end):
        if record_id not in records.offsets:
            return [f"header record 0 promises identity records {first}..{end - 1}, but "
                    f"record {record_id} is not in {records.idx_path}"]
        start, stop = (int(v) for v in mx.recordio.unpack(records.read_bytes(record_id))[0].label)
        classes = set(labels[start - 1:stop - 1].tolist())
        if len(classes) != 1:
            problems.append(f"identity record {record_id} covers images {start}..{stop - 1} "
                            f"with labels {sorted(classes)[:5]}, expected one label")
    return problems


def format_report(directory: str, report: InspectReport) -> str:
    lo, median, hi = report.per_class
    lines = [
        f"{directory}: {report.images} images, {report.classes} classes, images per class "
        f"min {lo} / median {median} / max {hi}",
        f"header record: {'yes (insightface layout)' if report.has_header else 'no (im2rec)'}",
    ]
    lines += [f"PROBLEM: {p}" for p in report.problems]
    lines.append("OK" if not report.problems else f"{len(report.problems)} problem(s)")
    return "\n".join(lines)

