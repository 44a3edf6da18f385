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
import zlib
from dataclasses import dataclass
from pathlib import Path

import mxnet as mx
import numpy as np

from . import DataError

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
                raise DataError(f"{path} is missing: the {what} file of the dataset. Pack the "
                                "data with `python -m partial_fc_mx pack` or fix the path")
        self.offsets, self.index_record = read_index(self.idx_path)
        self.size = self.rec_path.stat().st_size
        self._fd = os.open(self.rec_path, os.O_RDONLY)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)

    def read_bytes(self, record_id: int) -> bytes:
        """The payload of one record, rejoining the parts MXNet splits at magic words."""
        if record_id not in self.offsets:
            raise DataError(f"{self.idx_path} has no record {record_id}")
        offset, parts = self.offsets[record_id], []
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
        return {"records": len(self.offsets), **self.index_record, "rec_bytes": self.size}

    def _truncated(self, record_id: int, offset: int) -> DataError:
        return DataError(f"{self.rec_path} is truncated: record {record_id} at byte {offset} "
                         f"runs past the end of the file ({self.size} bytes). Copy the file "
                         "again or re-pack it")


def read_index(path: Path) -> tuple[dict[int, int], dict]:
    """{record id: byte offset}, and the file's {"bytes", "crc32"} from the same read
    (the fingerprint ranks compare to find hosts whose copies differ)."""
    offsets, crc, size = {}, 0, 0
    with open(path, "rb") as lines:  # bytes: a damaged (binary) index is a DataError too
        for number, line in enumerate(lines, 1):
            crc, size = zlib.crc32(line, crc), size + len(line)
            fields = line.split()
            if len(fields) != 2 or not all(f.isdigit() for f in fields):
                raise DataError(f"{path} line {number} is not 'record_id<TAB>offset': "
                                f"{line.strip()[:60]!r}. Rebuild the index with the packer")
            offsets[int(fields[0])] = int(fields[1])
    return offsets, {"bytes": size, "crc32": crc}


class RecordDataset:
    """The image records of a dataset directory, with their class count."""

    def __init__(self, directory: str | os.PathLike, num_classes: int | None = None) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise DataError(f"dataset directory {self.directory} does not exist; set `rec` to "
                            "the directory holding train.rec, train.idx and property")
        self.records = RecordFile(self.directory / "train.rec", self.directory / "train.idx")
        self.has_header = False
        self.image_ids = self._image_ids()
        if len(self.image_ids) == 0:
            raise DataError(f"{self.records.rec_path} holds no images; pack some first")
        self.num_classes = self._num_classes(num_classes)

    def __len__(self) -> int:
        return len(self.image_ids)

    def _image_ids(self) -> np.ndarray:
        keys = sorted(self.records.offsets)
        if not keys:
            return np.empty(0, np.int64)
        header, payload = self.records.unpack(keys[0])
        if keys[0] != 0 or header.flag == 0 or payload:
            return np.array(keys, np.int64)  # no header record (im2rec)
        self.has_header = True
        end = int(header.label[0])
        missing = [i for i in (1, end - 1) if end > 1 and i not in self.records.offsets]
        if missing:
            raise DataError(f"{self.records.rec_path}: header record 0 says images are records "
                            f"1..{end - 1}, but {self.records.idx_path} lacks record "
                            f"{missing[0]}. Rebuild the index or re-pack")
        return np.arange(1, end, dtype=np.int64)

    def _num_classes(self, expected: int | None) -> int:
        """From `property`; it must agree with the config's num_classes when both exist."""
        path = self.directory / "property"
        if not path.is_file():
            if expected is None:
                raise DataError(f"{path} is missing and no num_classes was given; write "
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
