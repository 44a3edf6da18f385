"""Write datasets in the insightface RecordIO layout.

`write_records` is the one writer: the folder and .lst packers, the ORL faces and
the synthetic identities all hand it (label, encoded image) pairs grouped by label.
It writes train.rec/train.idx/property under temporary names and renames them at
the end, so an interrupted pack never leaves a half-written dataset in place.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import mxnet as mx
import numpy as np

from . import DataError
from .transforms import FACE_SIZE, center_square, encode_jpeg

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".pgm", ".ppm", ".webp", ".tif", ".tiff"}


@dataclass
class PackReport:
    images: int = 0
    classes: int = 0
    skipped: list = field(default_factory=list)
    """(path, reason) of every input that was not packed."""


def write_records(out_dir: str | os.PathLike, samples: Iterable[tuple[int, bytes]],
                  num_classes: int, report: PackReport | None = None) -> PackReport:
    """Pack (label, encoded image) pairs, grouped by ascending label, into out_dir.

    Record 0 is the header (flag 2, label = (first identity record, end)); images
    are records 1..N; then one record per class holding its image id range. The
    counts go into `report` (where the sample source may note what it skipped).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = {name: out / f".{name}.partial" for name in ("train.rec", "train.idx", "property")}
    writer = mx.recordio.MXIndexedRecordIO(str(tmp["train.idx"]), str(tmp["train.rec"]), "w")
    report, ranges, previous = report or PackReport(), {}, -1
    writer.write_idx(0, header_record(0, 0))  # rewritten in place once the counts are known
    for label, image in samples:
        if label < previous or not 0 <= label < num_classes:
            writer.close()
            raise DataError(f"packing {out}: label {label} after {previous}; labels must come "
                            f"grouped in ascending order within 0..{num_classes - 1}")
        report.images += 1
        ranges.setdefault(label, [report.images, report.images + 1])[1] = report.images + 1
        writer.write_idx(report.images, mx.recordio.pack(mx.recordio.IRHeader(0, label, 0, 0),
                                                         image))
        previous = label
    if report.images == 0:
        writer.close()
        raise DataError(f"packing {out}: no readable images; nothing was written")
    first_identity = report.images + 1
    for i, (start, stop) in enumerate(sorted(ranges.values())):
        writer.write_idx(first_identity + i, header_record(start, stop))
    writer.close()
    overwrite_header(tmp["train.rec"], header_record(first_identity, first_identity + len(ranges)))
    tmp["property"].write_text(f"{num_classes},{FACE_SIZE},{FACE_SIZE}\n")
    for name, path in tmp.items():
        os.replace(path, out / name)
    report.classes = len(ranges)
    return report


def header_record(first: int, end: int) -> bytes:
    return mx.recordio.pack(mx.recordio.IRHeader(2, [float(first), float(end)], 0, 0), b"")


def overwrite_header(rec_path: Path, record: bytes) -> None:
    """Record 0 is the first record in the file and has a fixed size: replace its payload."""
    with open(rec_path, "r+b") as f:
        f.seek(8)  # magic + length
        f.write(record)


def encoded_face(path: Path, crop: bool) -> tuple[bytes | None, str]:
    """The bytes to store for one picture, or (None, why) when it is unusable."""
    try:
        data = path.read_bytes()
    except OSError as error:
        return None, f"unreadable ({error.strerror})"
    image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    if image is None:
        return None, "not a decodable image"
    if crop:
        image = center_square(image)
    elif image.shape[:2] != (FACE_SIZE, FACE_SIZE):
        return None, (f"{image.shape[1]}x{image.shape[0]}, not {FACE_SIZE}x{FACE_SIZE} "
                      "(use --crop to center-crop and resize)")
    keep_as_is = not crop and path.suffix.lower() in (".jpg", ".jpeg", ".png")
    return (data if keep_as_is else encode_jpeg(cv2.cvtColor(image, cv2.COLOR_BGR2RGB))), ""


def folder_samples(root: Path, crop: bool, report: PackReport) -> Iterator[tuple[int, bytes]]:
    """One subfolder per identity (sorted names -> labels 0..); unusable files reported."""
    identities = sorted(p for p in root.iterdir() if p.is_dir())
    for label, folder in enumerate(identities):
        for path in sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES):
            image, why = encoded_face(path, crop)
            if image is None:
                report.skipped.append((str(path), why))
                continue
            yield label, image


def read_list(lst: Path) -> list[tuple[int, str]]:
    """An im2rec .lst, `index<TAB>label<TAB>relative path` per line: (label, path)."""
    entries = []
    for number, line in enumerate(lst.read_text().splitlines(), 1):
        fields = line.split("\t")
        if len(fields) < 3:
            raise DataError(f"{lst} line {number} is not 'index<TAB>label<TAB>path': {line!r}")
        entries.append((class_id(fields[1], f"{lst} line {number}"), fields[-1]))
    return entries


def class_id(text: str, where: str) -> int:
    """A .lst label: a whole number >= 0 (im2rec writes it as a float, e.g. '3.000000')."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value >= 0 and value.is_integer()):
        raise DataError(f"{where}: label {text!r} is not a class id (a whole number >= 0); "
                        "fix the list, whose second column is the identity's number")
    return int(value)


def list_samples(entries: list[tuple[int, str]], root: Path, crop: bool,
                 report: PackReport) -> Iterator[tuple[int, bytes]]:
    """The pictures of a .lst's entries, by label; unusable files reported."""
    for label, relative in sorted(entries, key=lambda e: e[0]):
        image, why = encoded_face(root / relative, crop)
        if image is None:
            report.skipped.append((str(root / relative), why))
            continue
        yield label, image


def pack_folder(src: str | os.PathLike, out_dir: str | os.PathLike,
                crop: bool = False) -> PackReport:
    root = Path(src)
    if not root.is_dir():
        raise DataError(f"{root} is not a folder of identity subfolders")
    report = PackReport()
    num_classes = sum(1 for p in root.iterdir() if p.is_dir())
    return write_records(out_dir, folder_samples(root, crop, report), num_classes, report)


def pack_list(lst: str | os.PathLike, root: str | os.PathLike, out_dir: str | os.PathLike,
              crop: bool = False) -> PackReport:
    lst, root = Path(lst), Path(root)
    if not lst.is_file():
        raise DataError(f"list file {lst} does not exist")
    entries = read_list(lst)
    if not entries:
        raise DataError(f"list file {lst} lists no images")
    num_classes = max(label for label, _ in entries) + 1
    report = PackReport()
    return write_records(out_dir, list_samples(entries, root, crop, report), num_classes, report)
