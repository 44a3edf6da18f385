"""Write datasets in the insightface RecordIO layout.

`write_records` is the one writer: the folder and .lst packers, the ORL faces and
the synthetic identities all hand it (label, encoded image) pairs grouped by label.
It writes train.rec/train.idx/property under temporary names and renames them at
the end, so an interrupted pack never leaves a half-written dataset in place.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import mxnet as mx
import numpy as np

from ..data import DataError
from ..data.align import align_face
from ..data.transforms import FACE_SIZE, center_square, encode_jpeg

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".pgm", ".ppm", ".webp", ".tif", ".tiff"}


UNREADABLE, UNDECODABLE, NOT_FACE_SIZE = ("unreadable", "not a decodable image",
                                         f"not {FACE_SIZE}x{FACE_SIZE}")
FIXES = {
    UNREADABLE: "check the file's permissions, or remove it",
    UNDECODABLE: "re-encode it as JPEG or PNG, or remove it",
    NOT_FACE_SIZE: "align it from 5 landmarks (--landmarks FILE for a folder; a .lst with "
                   "the points), or --resize (plain resize) or --crop (center crop and resize)",
}
"""What fixes each reason for skipping a picture."""

RESIZE, CROP = "resize", "crop"
"""What to do with a picture without landmarks that is not FACE_SIZE x FACE_SIZE
(None: skip it)."""


def unaligned_rule(crop: bool, resize: bool) -> str | None:
    if crop and resize:
        raise DataError("choose one of --crop and --resize")
    return CROP if crop else RESIZE if resize else None


@dataclass
class PackReport:
    images: int = 0
    classes: int = 0
    skipped: list = field(default_factory=list)
    """(path, why) of every input that was not packed."""
    reasons: dict = field(default_factory=dict)
    """For each reason (a key of FIXES), the paths skipped for it."""
    aligned: int = 0
    """Pictures aligned from their landmarks."""
    sizes: Counter = field(default_factory=Counter)
    """How many pictures of each size ("92x112") were skipped as not FACE_SIZE."""
    names: list = field(default_factory=list)
    """The source's name of each label (a folder packer's person folders), if known."""
    left_out: int = 0
    """How many of the source's labels got no image: not in the dataset, the others
    renumbered in order."""
    left_out_examples: list = field(default_factory=list)
    """The first few of them."""

    def skip(self, path: str, reason: str, why: str) -> None:
        self.skipped.append((path, why))
        self.reasons.setdefault(reason, []).append(path)

    def summary(self) -> list[str]:
        """One line per reason: how many, two examples, and the option that fixes it;
        then the classes left out for want of an image."""
        lines = []
        for reason, paths in self.reasons.items():
            found = ", ".join(f"{size}: {n}" for size, n in self.sizes.most_common())
            sizes = f"; sizes found: {found}" if reason == NOT_FACE_SIZE else ""
            lines.append(f"{len(paths)} skipped as {reason} (e.g. {', '.join(paths[:2])}"
                         f"{sizes}); fix: {FIXES[reason]}")
        if self.left_out:
            named = [self.names[label] if self.names else f"label {label}"
                     for label in self.left_out_examples]
            more = ", ..." if self.left_out > len(named) else ""
            lines.append(f"{self.left_out} class(es) have no image and are not in the "
                         f"dataset ({', '.join(named)}{more}); the other {self.classes} "
                         f"are numbered 0..{self.classes - 1} in order")
        return lines


def write_records(out_dir: str | os.PathLike, samples: Iterable[tuple[int, bytes]],
                  num_classes: int, report: PackReport | None = None) -> PackReport:
    """Pack (label, encoded image) pairs, grouped by ascending label, into out_dir.

    Record 0 is the header (flag 2, label = (first identity record, end)); images
    are records 1..N; then one record per class holding its image id range. A label
    without images would be a class nothing trains (and a `property` that overstates
    the data): such labels are left out and the others renumbered in order. The
    counts go into `report` (where the sample source may note what it skipped).
    """
    out = Path(out_dir)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    tmp = {name: out / f".{name}.partial" for name in ("train.rec", "train.idx", "property")}
    report = report or PackReport()
    try:
        classes = write_images(tmp, samples, num_classes, report, out)
    except BaseException:
        for path in tmp.values():
            path.unlink(missing_ok=True)
        if created:  # nothing was written: no empty folder left to look like output
            with contextlib.suppress(OSError):
                out.rmdir()
        raise
    for name, path in tmp.items():
        os.replace(path, out / name)
    report.classes = classes
    return report


def write_images(tmp: dict, samples: Iterable[tuple[int, bytes]], num_classes: int,
                 report: PackReport, out: Path) -> int:
    """The records and property of write_records, under the temporary names `tmp`;
    returns the number of classes with images."""
    writer = mx.recordio.MXIndexedRecordIO(str(tmp["train.idx"]), str(tmp["train.rec"]), "w")
    ranges, previous, packed = {}, -1, {}
    with contextlib.closing(writer):
        writer.write_idx(0, header_record(0, 0))  # rewritten in place once counts are known
        for label, image in samples:
            if label < previous or not 0 <= label < num_classes:
                raise DataError(f"packing {out}: label {label} after {previous}; labels must "
                                f"come grouped in ascending order within 0..{num_classes - 1}")
            report.images += 1
            new_label = packed.setdefault(label, len(packed))
            ranges.setdefault(new_label, [report.images, 0])[1] = report.images + 1
            writer.write_idx(report.images, mx.recordio.pack(
                mx.recordio.IRHeader(0, new_label, 0, 0), image))
            previous = label
        if report.images == 0:
            why = "".join(f"\n  {line}" for line in report.summary())
            raise DataError(f"packing {out}: no readable images; nothing was written"
                            + (f". Every picture was skipped:{why}" if why else
                               " (the source lists no pictures)"))
        first_identity = report.images + 1
        for i, (start, stop) in enumerate(sorted(ranges.values())):
            writer.write_idx(first_identity + i, header_record(start, stop))
    overwrite_header(tmp["train.rec"], header_record(first_identity, first_identity + len(ranges)))
    tmp["property"].write_text(f"{len(ranges)},{FACE_SIZE},{FACE_SIZE}\n")
    report.left_out = num_classes - len(packed)
    report.left_out_examples = missing_labels(packed, num_classes, 5)
    return len(ranges)


def missing_labels(present: Iterable[int], num_classes: int, count: int) -> list[int]:
    """The first `count` labels of 0..num_classes-1 not in `present`, without listing
    them all (a .lst's one stray label may be in the billions)."""
    missing, expected = [], 0
    for label in [*sorted(present), num_classes]:
        missing += range(expected, min(label, expected + count - len(missing)))
        if len(missing) >= count:
            break
        expected = label + 1
    return missing


def header_record(first: int, end: int) -> bytes:
    return mx.recordio.pack(mx.recordio.IRHeader(2, [float(first), float(end)], 0, 0), b"")


def overwrite_header(rec_path: Path, record: bytes) -> None:
    """Record 0 is the first record in the file and has a fixed size: replace its payload."""
    with open(rec_path, "r+b") as f:
        f.seek(8)  # magic + length
        f.write(record)


def encoded_face(path: Path, report: PackReport, landmarks=None, unaligned: str | None = None,
                 where: str = "") -> bytes | None:
    """The bytes to store for one picture: aligned from its 5 `landmarks` when given,
    else as it is if FACE_SIZE x FACE_SIZE, else as `unaligned` says. None (and the
    reason noted in `report`) when it is unusable; bad landmarks are a DataError
    naming `where` (the list line), or the file."""
    try:
        data = path.read_bytes()
    except OSError as error:
        report.skip(str(path), UNREADABLE, f"{UNREADABLE} ({error.strerror})")
        return None
    image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    if image is None:
        report.skip(str(path), UNDECODABLE, UNDECODABLE)
        return None
    if landmarks is not None:
        image = align_face(image, landmarks, where or str(path))
        report.aligned += 1
    elif image.shape[:2] == (FACE_SIZE, FACE_SIZE):
        if path.suffix.lower() in (".jpg", ".jpeg", ".png"):
            return data  # as it is: no second JPEG loss
    elif unaligned == CROP:
        image = center_square(image)
    elif unaligned == RESIZE:
        image = cv2.resize(image, (FACE_SIZE, FACE_SIZE), interpolation=cv2.INTER_AREA)
    else:
        size = f"{image.shape[1]}x{image.shape[0]}"
        report.sizes[size] += 1
        report.skip(str(path), NOT_FACE_SIZE, f"{size}, {NOT_FACE_SIZE} (use --landmarks, "
                    "--resize or --crop)")
        return None
    return encode_jpeg(cv2.cvtColor(image, cv2.COLOR_BGR2RGB))


def check_identity_folders(root: Path) -> None:
    """A DataError unless `root` is a folder with a subfolder per person, saying which
    of the usual mistakes it is."""
    root = root.absolute()
    layout = f"pack needs one subfolder per person (e.g. {root}/alice/1.jpg)"
    if not root.exists():
        raise DataError(f"{root} does not exist; {layout}")
    if not root.is_dir():
        raise DataError(f"{root} is a file, not a folder; {layout}")
    entries = list(root.iterdir())
    if not entries:
        raise DataError(f"{root} is empty; {layout}")
    if not any(entry.is_dir() for entry in entries):
        loose = sum(entry.suffix.lower() in IMAGE_SUFFIXES for entry in entries)
        raise DataError(f"{root} holds {loose} picture(s) but no subfolders; {layout}")


def person_folders(root: Path) -> list[str]:
    """The names of `root`'s subfolders, one per person, sorted; hidden ones (`.git`,
    `.ipynb_checkpoints`) are not people."""
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def folder_pictures(root: Path, people: Sequence[str]) -> list[tuple[int, str]]:
    """(label, path relative to `root`) of every picture of `people` (label: the
    position in `people`): the folder is listed once, and a picture costs one short
    string until it is packed."""
    return [(label, f"{person}/{path.name}") for label, person in enumerate(people)
            for path in sorted((root / person).iterdir())
            if path.suffix.lower() in IMAGE_SUFFIXES]


def picture_samples(pictures: list[tuple[int, str]], root: Path, report: PackReport,
                    landmarks: dict, unaligned: str | None) -> Iterator[tuple[int, bytes]]:
    """The encoded pictures, by label; unusable files reported; `landmarks` maps a
    path relative to `root` to its 5 points."""
    for label, relative in pictures:
        image = encoded_face(root / relative, report, landmarks.get(plain_path(relative)),
                             unaligned)
        if image is not None:
            yield label, image


def read_landmarks(path: Path) -> dict[str, np.ndarray]:
    """A landmarks file: `relative/path x1 y1 x2 y2 x3 y3 x4 y4 x5 y5` per line, the
    layout of IJB's *_name_5pts_score.txt (a 12th column, the detector's score, is
    allowed and ignored)."""
    if not path.is_file():
        raise DataError(f"landmarks file {path.absolute()} does not exist")
    points = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) not in (11, 12) or not all(map(is_number, fields[1:])):
            raise DataError(f"{path} line {number} is not 'path x1 y1 ... x5 y5 [score]' "
                            f"(a path and 10 or 11 numbers): {line!r}")
        points[plain_path(fields[0])] = np.array(fields[1:11], np.float64).reshape(5, 2)
    return points


def plain_path(relative: str) -> str:
    """One spelling of a relative path: `./a/b.jpg`, `a//b.jpg` and `a/b.jpg` alike."""
    return posixpath.normpath(relative)


def matched_landmarks(points: dict, pictures: list[str], landmarks: str | os.PathLike,
                      root: Path) -> None:
    """A landmarks file none of whose paths names a picture is a mistake (paths relative
    to another folder), not a request to pack every picture unaligned."""
    if not points or points.keys() & set(map(plain_path, pictures)):
        return
    if not pictures:
        raise DataError(f"{root} holds no pictures")
    raise DataError(f"none of the {len(points)} paths in {landmarks} names a picture under "
                    f"{root} (e.g. {next(iter(points))!r}); its paths must be relative to "
                    f"{root}, like {pictures[0]!r}")


@dataclass(frozen=True)
class ListEntry:
    label: int
    path: str
    landmarks: np.ndarray | None
    where: str


def read_list(lst: Path) -> list[ListEntry]:
    """A .lst in either layout, line by line:
    - im2rec: `index<TAB>label<TAB>path`;
    - insightface (face2rec2): `aligned<TAB>path<TAB>label[<TAB>4 bbox numbers
      <TAB>10 landmarks x1..x5 y1..y5]`, one number per column (the bbox is not used:
      the landmarks place the face; a picture marked aligned is stored as it is)."""
    entries = []
    for number, line in enumerate(lst.read_text().splitlines(), 1):
        fields, where = line.rstrip().split("\t"), f"{lst} line {number}"
        if len(fields) < 3:
            raise DataError(f"{where} is not 'index<TAB>label<TAB>path' (im2rec) nor "
                            f"'aligned<TAB>path<TAB>label...' (insightface): {line!r}")
        if is_number(fields[1]) or not is_number(fields[2]):  # im2rec
            entries.append(ListEntry(class_id(fields[1], where), fields[-1], None, where))
            continue
        if len(fields) not in (3, 7, 17) or not all(map(is_number, fields[3:])):
            raise DataError(f"{where}: an insightface list line has 3, 7 or 17 tab-separated "
                            f"columns (aligned, path, label, 4 bbox numbers, 10 landmarks), "
                            f"got {len(fields)}: {line!r}")
        aligned = fields[0].strip() not in ("0", "")  # aligned already: stored as it is
        points = (np.array(fields[7:17], np.float64).reshape(2, 5).T
                  if len(fields) == 17 and not aligned else None)
        entries.append(ListEntry(class_id(fields[2], where), fields[1], points,
                                 f"{where} ({fields[1]})"))
    return entries


def is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def class_id(text: str, where: str) -> int:
    """A .lst label: a whole number >= 0 (im2rec writes it as a float, e.g. '3.000000')."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value >= 0 and value.is_integer()):
        raise DataError(f"{where}: label {text!r} is not a class id (a whole number >= 0); "
                        "fix the list, whose label column is the identity's number")
    return int(value)


def list_samples(entries: list[ListEntry], root: Path, report: PackReport,
                 unaligned: str | None) -> Iterator[tuple[int, bytes]]:
    """The pictures of a .lst's entries, by label; unusable files reported."""
    for entry in sorted(entries, key=lambda e: e.label):
        image = encoded_face(root / entry.path, report, entry.landmarks, unaligned, entry.where)
        if image is not None:
            yield entry.label, image


def pack_folder(src: str | os.PathLike, out_dir: str | os.PathLike, crop: bool = False,
                resize: bool = False, landmarks: str | os.PathLike | None = None,
                people: Sequence[str] | None = None,
                report: PackReport | None = None) -> PackReport:
    """SRC/<person>/<picture> of `people` (default: every person folder), labels in
    their sorted order; `landmarks` names a file of 5 points per picture (paths
    relative to SRC); pictures without points that are not FACE_SIZE x FACE_SIZE are
    center-cropped (`crop`), resized or skipped. What is skipped adds to `report`."""
    unaligned = unaligned_rule(crop, resize)
    root = Path(src)
    check_identity_folders(root)
    people = sorted(person_folders(root) if people is None else people)
    pictures = folder_pictures(root, people)
    points = read_landmarks(Path(landmarks)) if landmarks else {}
    matched_landmarks(points, [relative for _, relative in pictures], landmarks, root)
    report = report or PackReport()
    report.names = people
    return write_records(out_dir, picture_samples(pictures, root, report, points, unaligned),
                         len(people), report)


def pack_list(lst: str | os.PathLike, root: str | os.PathLike, out_dir: str | os.PathLike,
              crop: bool = False, resize: bool = False) -> PackReport:
    """The pictures a .lst names (paths relative to `root`), aligned where it gives
    their landmarks; the others as pack_folder treats them."""
    unaligned = unaligned_rule(crop, resize)
    lst, root = Path(lst), Path(root)
    if not lst.is_file():
        raise DataError(f"list file {lst.absolute()} does not exist")
    entries = read_list(lst)
    if not entries:
        raise DataError(f"list file {lst} lists no images")
    num_classes = max(entry.label for entry in entries) + 1
    report = PackReport()
    return write_records(out_dir, list_samples(entries, root, report, unaligned),
                         num_classes, report)
