"""`python -m partial_fc_mx inspect DIR [--scan]`: what a dataset holds, and what is wrong.

Reads every image record's header (label), so it touches the whole .rec once;
`--scan` also decodes every image to find corrupt ones.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ..data.recordio import RecordDataset, float32_candidates, valid_class_ids
from ..data.transforms import decode_face, decode_in_workers


@dataclass
class InspectReport:
    images: int = 0
    classes: int = 0
    per_class: tuple = (0, 0, 0)
    """Images per class: min, median, max."""
    property_classes: int = 0
    """The class count its property file states (the ids its labels may take)."""
    has_header: bool = False
    header: str = "no (im2rec)"
    resized: int = 0
    corrupt: list = field(default_factory=list)
    problems: list = field(default_factory=list)


def inspect_dataset(directory: str, scan: bool = False, workers: int = 4) -> InspectReport:
    dataset = RecordDataset(directory)
    report = InspectReport(images=len(dataset), property_classes=dataset.num_classes,
                           has_header=dataset.has_header, header=header_summary(dataset))

    def examine(record_id) -> tuple:
        """(label, decoded, resized) of one record: the file is read once per record."""
        record = dataset.records.read(int(record_id))
        if not scan:
            return record.label, True, False
        image, resized = decode_face(record.image)
        return record.label, image is not None, resized

    decode_in_workers()
    with ThreadPoolExecutor(workers) as pool:
        examined = list(pool.map(examine, dataset.image_ids))
    labels = np.array([label for label, _, _ in examined])
    report.corrupt = [int(i) for i, (_, ok, _) in zip(dataset.image_ids, examined) if not ok]
    report.resized = sum(resized for _, _, resized in examined)
    bad = ~valid_class_ids(labels, dataset.num_classes)
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
    if report.corrupt:
        report.problems.append(f"{len(report.corrupt)} corrupt image(s), records "
                               f"{report.corrupt[:10]}")
    return report


def identity_record_problems(dataset: RecordDataset, labels: np.ndarray) -> list[str]:
    """The per-class records after the images must cover the images of one label each."""
    records = dataset.records
    first = len(dataset) + 1
    end = identity_records_end(dataset)
    problems = []
    for record_id in range(first, end):
        if record_id not in records.offsets:
            return [f"header record 0 promises identity records {first}..{end - 1}, but "
                    f"record {record_id} is not in {records.idx_path}"]
        start, stop = records.unpack(record_id)[0].label
        # past 2^24 the bounds are rounded (float32): any span they may stand for will do
        spans = [(a, b) for a in float32_candidates(start) for b in float32_candidates(stop)]
        label_sets = [set(labels[a - 1:b - 1].tolist()) for a, b in spans]
        start, stop = spans[0]
        classes = label_sets[0]
        if all(len(found) != 1 for found in label_sets):
            problems.append(f"identity record {record_id} covers images {start}..{stop - 1} "
                            f"with labels {sorted(classes)[:5]}, expected one label")
    return problems


def identity_records_end(dataset: RecordDataset) -> int:
    """One past the last identity record, as header record 0 states it (a float32:
    past 2^24 the index's last record, when the rounding allows it)."""
    candidates = float32_candidates(float(dataset.records.unpack(0)[0].label[1]))
    last = int(dataset.records.offsets.keys[-1]) + 1
    return last if last in candidates else candidates[0]


def header_summary(dataset: RecordDataset) -> str:
    """Whether there is a header, and where the image count came from."""
    if not dataset.has_header:
        return "no (im2rec)"
    if dataset.header_images == len(dataset):
        return "yes (insightface layout)"
    return (f"yes (insightface layout); {len(dataset):,} images counted in the index: the "
            f"header's float32 stores {dataset.header_images:,.0f}, which is that count "
            "rounded to float32 (exact only below 2^24 = 16,777,216)")


def format_joined(directories: list[str], reports: list[InspectReport]) -> str:
    """What training them as one (`rec` a list, data/joined.py) gives: the sum, and the
    class ids each one's classes take. A person in two of them is two classes."""
    start, lines = 0, []
    for directory, report in zip(directories, reports):
        lines.append(f"  {directory}: classes {start}..{start + report.property_classes - 1}")
        start += report.property_classes
    return "\n".join([f"together (rec = {directories!r}): "
                      f"{sum(r.images for r in reports)} images, num_classes = {start}", *lines])


def format_report(directory: str, report: InspectReport) -> str:
    lo, median, hi = report.per_class
    lines = [
        f"{directory}: {report.images} images, {report.classes} classes, images per class "
        f"min {lo} / median {median} / max {hi}",
        f"header record: {report.header}",
    ]
    lines += [f"PROBLEM: {p}" for p in report.problems]
    lines.append("OK" if not report.problems else f"{len(report.problems)} problem(s)")
    return "\n".join(lines)

