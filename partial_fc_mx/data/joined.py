"""Several datasets trained as one: `rec = ["data/ms1mv3", "data/own"]`.

One label space: each dataset's classes come after the previous ones' (class c of the
second is the first's class count plus c), and `num_classes` is their sum. Their
images form one list, which the loader shuffles and shards every epoch as it does one
dataset's, so a run resumes on any number of processes alike.

Whether two datasets hold the same people is the user's to know: a person in both is
two classes here, pulled apart by the margin (merge them when packing, or leave one
out).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from . import DataError
from .recordio import Record, RecordDataset, valid_class_ids

ID_BITS = 40
"""A record id of the joined datasets: (the dataset's place in the list << 40) | its own
record id (a dataset of 10^12 records is far off)."""


class JoinedRecords:
    """The records of all the datasets, by joined record id, labels in the joined
    label space."""

    def __init__(self, parts: list[RecordDataset], class_offsets: list[int]) -> None:
        self.parts, self.class_offsets = parts, class_offsets

    def split(self, record_id: int) -> tuple[RecordDataset, int, int]:
        """(the dataset, its own record id, its class offset)."""
        place = record_id >> ID_BITS
        if not 0 <= place < len(self.parts):
            raise DataError(f"record id {record_id} names none of the {len(self.parts)} "
                            "datasets of `rec`")
        return self.parts[place], record_id & ((1 << ID_BITS) - 1), self.class_offsets[place]

    def read(self, record_id: int) -> Record:
        part, own, offset = self.split(record_id)
        record = part.records.read(own)
        if not valid_class_ids(record.label, part.num_classes):  # not into the next one's
            raise DataError(f"{part.records.where(own)} has label {record.label}, outside "
                            f"that dataset's classes 0..{part.num_classes - 1}. Fix its "
                            "property file or re-pack it")
        return Record(record_id, record.label + offset, record.image)

    def where(self, record_id: int) -> str:
        part, own, _ = self.split(record_id)
        return part.records.where(own)

    def fingerprint(self) -> dict:
        """Each dataset's (with its class count: hosts whose property files split the
        classes otherwise would give the same label different meanings)."""
        return {"datasets": [{**part.records.fingerprint(), "classes": part.num_classes}
                             for part in self.parts]}


class JoinedDataset:
    """Datasets as one, with RecordDataset's interface for the loader."""

    def __init__(self, directories: list[str | os.PathLike],
                 num_classes: int | None = None) -> None:
        self.parts = [open_part(directory) for directory in directories]
        counts = [part.num_classes for part in self.parts]
        self.num_classes = sum(counts)
        if num_classes is not None and num_classes != self.num_classes:
            listed = " + ".join(f"{count} ({part.directory})"
                                for count, part in zip(counts, self.parts))
            raise DataError(f"num_classes is {num_classes}, but the datasets of `rec` hold "
                            f"{listed} = {self.num_classes} classes; set num_classes to their "
                            "sum")
        self.class_offsets = np.cumsum([0, *counts[:-1]]).tolist()
        self.image_starts = np.cumsum([0, *(len(part) for part in self.parts)])
        self.num_images = int(self.image_starts[-1])
        self.records = JoinedRecords(self.parts, self.class_offsets)

    def __len__(self) -> int:
        return self.num_images

    def composition(self) -> list[dict]:
        """Each dataset's folder, classes, images and train.idx fingerprint (its size and
        CRC-32), in order: what checkpoints keep, so that a resume with the list
        reordered or changed is refused, also where two datasets have equal counts."""
        return [{"rec": str(part.directory), "classes": part.num_classes, "images": len(part),
                 "index": dict(part.records.offsets.fingerprint)} for part in self.parts]

    def record_ids(self, positions: np.ndarray) -> np.ndarray:
        """The joined record ids of the images at `positions` (0 .. len(self) - 1): the
        first dataset's images, then the second's, ..."""
        positions = np.asarray(positions, np.int64)
        place = np.searchsorted(self.image_starts, positions, side="right") - 1
        ids = np.full(positions.shape, -1, np.int64)
        for index, part in enumerate(self.parts):
            mine = place == index
            if mine.any():
                own = part.record_ids(positions[mine] - self.image_starts[index])
                ids[mine] = (np.int64(index) << ID_BITS) | np.asarray(own, np.int64)
        if (ids < 0).any():
            raise DataError(f"positions beyond the {self.num_images} images of `rec`")
        return ids


def open_part(directory: str | os.PathLike) -> RecordDataset:
    """One dataset of the list: it must state its class count in `property` (which
    places the next one's classes), and its record ids must fit a joined id."""
    if not (Path(directory) / "property").is_file():
        raise DataError(f"{Path(directory).absolute() / 'property'} is missing: each dataset "
                        "of a `rec` list states its class count there ('num_classes,112,112',"
                        " as pack writes it), which places the next dataset's classes")
    part = RecordDataset(directory)
    keys = part.records.offsets.keys
    if len(keys) and not 0 <= int(keys[0]) <= int(keys[-1]) < 1 << ID_BITS:
        raise DataError(f"{part.records.idx_path} has record ids {int(keys[0])}..{int(keys[-1])}"
                        f", beyond 0..2^{ID_BITS} - 1, which a dataset of a `rec` list must keep "
                        "to; re-pack it")
    return part
