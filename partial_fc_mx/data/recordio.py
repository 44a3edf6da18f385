"""Indexed RecordIO in the insightface layout: train.rec + train.idx (+ property).

Records are read with os.pread at the offsets in train.idx, so any number of
decode threads can read one file at once (MXNet's MXIndexedRecordIO keeps a single
file position). Layout, as written by insightface and by `pack`:
  record 0      optional header: flag > 0, no image, label = (first id after the
                images, end of the identity records); images are records 1 .. label[0]-1
  records 1..   images: IRHeader (label = class id, a float or the first of an
                array) followed by the encoded JPEG/PNG
Files without the header (MXNet's im2rec from a .lst) use every key in train.idx.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import mxnet as mx
import numpy as np

from . import DataError
from .record_index import open_index

MAGIC = 0xCED7230A
_MAGIC_BYTES = struct.pack("<I", MAGIC)
_LENGTH_MASK = (1 << 29) - 1


def valid_class_ids(labels, num_classes: int):
    """True where a label (float, as RecordIO stores it) is an integer in [0, num_classes)."""
    labels = np.asarray(labels, np.float64)
    return (labels == np.floor(labels)) & (labels >= 0) & (labels < num_classes)


@dataclass(frozen=True)
class Record:
    record_id: int
    label: float
    image: bytes


class RecordFile:
    """Random access to the records of one .rec/.idx pair, safe from many threads."""

    def __init__(self, rec_path: str | os.PathLike, idx_path: str | os.PathLike) -> None:
        self.rec_path, self.idx_path = Path(rec_path), Path(idx_path)
        for path, what in ((self.rec_path, "records"), (self.idx_path, "index")):
            if not path.is_file():
                raise DataError(f"{path.absolute()} is missing: the {what} file of the "
                                "dataset. Pack the data with `python -m partial_fc_mx pack` "
                                "or fix the path")
        self.offsets = open_index(self.idx_path)
        self.size = self.rec_path.stat().st_size
        self._fd = os.open(self.rec_path, os.O_RDONLY)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)

    def read_bytes(self, record_id: int) -> bytes:
        """The payload of one record, rejoining the parts MXNet splits at magic words."""
        try:
            offset, parts = self.offsets[record_id], []
        except KeyError:
            raise DataError(f"{self.idx_path} has no record {record_id}") from None
        while True:
            head = self._pread(8, offset, record_id)
            if len(head) < 8:
                raise self._truncated(record_id, offset)
            magic, lrecord = struct.unpack("<II", head)
            if magic != MAGIC:
                raise DataError(f"{self.rec_path}: record {record_id} at byte {offset} does not "
                                f"start with the RecordIO magic; {self.idx_path} does not match "
                                "this file. Rebuild both with the packer")
            cflag, length = lrecord >> 29, lrecord & _LENGTH_MASK
            payload = self._pread(length, offset + 8, record_id)
            if len(payload) < length:
                raise self._truncated(record_id, offset)
            parts.append(payload)
            offset += 8 + ((length + 3) & ~3)
            if cflag in (0, 3):
                return _MAGIC_BYTES.join(parts)

    def _pread(self, size: int, offset: int, record_id: int) -> bytes:
        try:
            return os.pread(self._fd, size, offset)
        except OSError as error:  # EIO on a failing disk or network file system
            raise DataError(f"{self.rec_path}: cannot read record {record_id} at byte "
                            f"{offset}: {error}. Check the disk or copy the file again"
                            ) from error

    def where(self, record_id: int) -> str:
        """A record as messages name it."""
        return f"{self.rec_path}: record {record_id}"

    def read(self, record_id: int) -> Record:
        header, image = self.unpack(record_id)
        label = header.label if np.isscalar(header.label) else header.label[0]
        return Record(record_id, float(label), image)

    def unpack(self, record_id: int) -> tuple:
        """(IRHeader, payload) of a record; a damaged header is a DataError."""
        raw = self.read_bytes(record_id)
        try:
            return mx.recordio.unpack(raw)
        except (struct.error, ValueError) as error:
            raise DataError(f"{self.rec_path}: record {record_id} has a damaged header "
                            f"({len(raw)} bytes: {error}). Re-pack the data, or restore the "
                            "file from a good copy") from error

    def fingerprint(self) -> dict:
        """Record count and the index file's size and CRC-32: ranks whose copies of the
        dataset differ would yield different batch counts and hang in a collective."""
        return {"records": len(self.offsets), **self.offsets.fingerprint,
                "rec_bytes": self.size}

    def _truncated(self, record_id: int, offset: int) -> DataError:
        return DataError(f"{self.rec_path} is truncated: record {record_id} at byte {offset} "
                         f"runs past the end of the file ({self.size} bytes). Copy the file "
                         "again or re-pack it")


class RecordDataset:
    """The image records of a dataset directory, with their class count."""

    def __init__(self, directory: str | os.PathLike, num_classes: int | None = None) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise DataError(f"dataset directory {self.directory.absolute()} does not exist; "
                            "set `rec` to the directory holding train.rec, train.idx and "
                            "property")
        self.records = RecordFile(self.directory / "train.rec", self.directory / "train.idx")
        self.has_header = False
        self.header_images: float | None = None
        """The image count header record 0 states (a float32), when there is one."""
        self.num_images = self._count_images()
        if self.num_images == 0:
            raise DataError(f"{self.records.rec_path} holds no images; pack some first")
        self.num_classes = self._num_classes(num_classes)

    def __len__(self) -> int:
        return self.num_images

    @property
    def image_ids(self) -> np.ndarray:
        """Every image's record id, in record order (len(self) of them)."""
        if self.has_header:
            return np.arange(1, self.num_images + 1)
        return self.records.offsets.keys

    def record_ids(self, positions: np.ndarray) -> np.ndarray:
        """The record ids of the images at `positions` (0 .. len(self) - 1): computed,
        not looked up in a list of 42M ids kept by every rank."""
        if self.has_header:
            return np.asarray(positions, np.int64) + 1
        return np.asarray(self.records.offsets.keys[positions])

    def _count_images(self) -> int:
        index = self.records.offsets
        if len(index) == 0:
            return 0
        header, payload = self.records.unpack(int(index.keys[0]))
        if index.keys[0] != 0 or header.flag == 0 or payload:
            return len(index)  # no header record (im2rec): every record is an image
        self.has_header = True
        self.header_images = float(header.label[0]) - 1
        return self._images_end(float(header.label[0])) - 1

    def _images_end(self, stated: float) -> int:
        """The first record id after the images, which the header states as a float32:
        exact up to 2^24, rounded above (42,474,559 reads back as 42,474,560). Then
        the index decides among the ids the rounding allows: the end is where the
        records 1.. with no gap stop being images (absent, or an identity record)."""
        records, index = self.records, self.records.offsets
        candidates = float32_candidates(stated)
        for end in candidates:
            complete = end > 1 and index.count_between(1, end) == end - 1
            if complete and (len(candidates) == 1 or self._is_image(end - 1)
                             and not self._is_image(end)):
                return end
        missing = first_missing(index.keys, 1, candidates[-1])
        if missing < candidates[-1] or len(candidates) == 1:
            found = f"{records.idx_path} lacks record {missing}"
        else:
            found = (f"none of records {candidates[0]}..{candidates[-1]} (the ids float32 "
                     "stores alike) ends them: an image followed by an identity record or "
                     "by no record")
        raise DataError(f"{records.rec_path}: header record 0 says images are records "
                        f"1..{int(stated) - 1}, but {found}. Rebuild the index or re-pack")

    def _is_image(self, record_id: int) -> bool:
        """A record with an image payload (identity records have none)."""
        return record_id in self.records.offsets and bool(self.records.unpack(record_id)[1])

    def _num_classes(self, expected: int | None) -> int:
        """From `property`; it must agree with the config's num_classes when both exist."""
        path = self.directory / "property"
        if not path.is_file():
            if expected is None:
                raise DataError(f"{path.absolute()} is missing and no num_classes was given; write "
                                "'num_classes,112,112' into it or set num_classes")
            return expected
        text = path.read_text().strip()
        match = re.fullmatch(r"(\d+)\s*,\s*(\d+)\s*,\s*(\d+)", text)
        if not match:
            raise DataError(f"{path} should read 'num_classes,112,112' but reads {text!r}")
        found = int(match.group(1))
        if expected is not None and found != expected:
            raise DataError(f"{path} says {found} classes but num_classes is {expected}; make "
                            "them agree (the property file comes from the packer)")
        return found


def float32_candidates(stated: float) -> list[int]:
    """The whole numbers that float32 stores as `stated`, in order: one below 2^24."""
    value = np.float32(stated)
    spread = int(np.spacing(value)) // 2 if value >= 2**24 else 0
    return [n for n in range(int(value) - spread, int(value) + spread + 1)
            if np.float32(n) == value]


def first_missing(keys: np.ndarray, low: int, high: int) -> int:
    """The smallest id in [low, high) not in the sorted, distinct `keys` (high if none)."""
    start = int(np.searchsorted(keys, low))
    found = keys[start:start + max(high - low, 0)]
    gaps = np.flatnonzero(found != np.arange(low, low + len(found)))
    return low + int(gaps[0]) if len(gaps) else low + len(found)
