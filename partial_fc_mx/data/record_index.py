"""train.idx as two sorted arrays (record ids, byte offsets), parsed once and kept in a
cache file that every rank maps read-only.

WebFace42M's train.idx has 42.5M lines (859 MiB). Parsed into a Python dict by every
rank it took 47 s and 4.2 GiB per rank; mapped from the cache, the ranks of a host
share one copy in the page cache, and opening it reads only the header and a checksum
pass (docs/benchmarks.md, `bench index`). The cache holds the index file's
fingerprint too (its size and CRC-32, which ranks compare to find hosts whose copies
differ), computed in the same pass as the parse.

The cache lives beside the index (train.idx.cache) or, when the dataset's folder is
read-only, in ~/.cache/partial_fc_mx/index/. It is used only when its header names
this index by size, modification and change times and inode (the file, not its path:
hosts that mount one dataset at different paths share the cache beside it), and its arrays
match their checksum; otherwise (stale, truncated, damaged) it is rebuilt from
train.idx, under a lock so that the ranks of a host parse the file once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import sys
import zlib
from pathlib import Path

import numpy as np

from ..caches import default_cache_dir
from . import DataError

CACHE_FORMAT = b"PFCIDX01"
HEADER_BYTES = 4096
CHUNK = 64 * 2**20
CHECKSUM_CHUNK = 4 * 2**20
LONGEST_NUMBER = 18  # decimal digits that always fit an int64


class RecordIndex:
    """{record id: byte offset} over sorted arrays: `id in index`, `index[id]`, len, and
    iteration in id order, without a Python object per record."""

    def __init__(self, keys: np.ndarray, offsets: np.ndarray, fingerprint: dict) -> None:
        self.keys, self.offsets, self.fingerprint = keys, offsets, fingerprint

    def __len__(self) -> int:
        return len(self.keys)

    def __iter__(self):
        return (int(key) for key in self.keys)

    def _position(self, record_id: int) -> int:
        position = int(np.searchsorted(self.keys, record_id))
        if position < len(self.keys) and self.keys[position] == record_id:
            return position
        return -1

    def __contains__(self, record_id) -> bool:
        return self._position(record_id) >= 0

    def __getitem__(self, record_id: int) -> int:
        position = self._position(record_id)
        if position < 0:
            raise KeyError(record_id)
        return int(self.offsets[position])

    def count_between(self, low: int, high: int) -> int:
        """How many record ids lie in [low, high): high - low when none is missing."""
        return int(np.searchsorted(self.keys, high) - np.searchsorted(self.keys, low))


def open_index(path: Path, cache_dir: Path | None = None) -> RecordIndex:
    """The index at `path`, from a valid cache or parsed (and cached) now."""
    path = Path(path)
    stat = path.stat()
    # the file's identity, not its path: hosts that mount one dataset at different
    # paths share the cache beside it, and none replaces it under another's mapping
    key = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns,
           "ctime_ns": stat.st_ctime_ns, "inode": stat.st_ino}  # ctime: no tool sets it back
    places = cache_places(path, cache_dir)
    for place in places:
        if (index := read_cache(place, key)) is not None:
            return index
    parsed = None
    for place in places if os.access(path.parent, os.W_OK) else places[1:]:
        with contextlib.suppress(OSError), locked(place):
            if (index := read_cache(place, key)) is not None:  # a peer built it meanwhile
                return index
            sys.stderr.write(f"parsing {path} into {place} (once per index file)\n")
            parsed = parsed or parse_index(path)
            write_cache(place, key, *parsed)
            if (index := read_cache(place, key)) is not None:
                return index
    return RecordIndex(*(parsed or parse_index(path)))  # nowhere writable: in memory


def cache_places(path: Path, cache_dir: Path | None) -> list[Path]:
    """Beside the index, and in the user's cache for read-only dataset folders (named
    by the index's path and this host: hosts with their own copies of a dataset at
    one path may share a home directory); without a home folder (no HOME, a uid
    without a passwd entry) and no cache_dir, beside it only."""
    beside = path.with_name(f"{path.name}.cache")
    try:
        folder = cache_dir or default_cache_dir()
    except RuntimeError:
        return [beside]
    name = f"{path.resolve()}:{socket.gethostname()}"
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    return [beside, folder / "index" / f"{path.name}-{digest}.cache"]


@contextlib.contextmanager
def locked(place: Path):
    """An exclusive lock (POSIX, which NFS honours) on a lock file beside the cache
    `place` while it is built, with the partial files of killed builders removed."""
    place.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(place.with_name(f".{place.name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        with contextlib.suppress(OSError):  # no locks here: ranks build alike, last wins
            fcntl.lockf(fd, fcntl.LOCK_EX)
        for stale in place.parent.glob(f".{place.name}.*.partial"):
            with contextlib.suppress(OSError):
                stale.unlink()
        yield
    finally:
        os.close(fd)  # releases the lock


def read_cache(place: Path, key: dict) -> RecordIndex | None:
    """The cached index when it is this index's and intact; None otherwise. The file
    checked is the file mapped, even if another process replaces the name meanwhile."""
    try:
        with open(place, "rb") as file:
            header = file.read(HEADER_BYTES)
            if len(header) != HEADER_BYTES or not header.startswith(CACHE_FORMAT):
                return None
            meta = json.loads(header[len(CACHE_FORMAT):].rstrip(b"\0"))
            count = meta["records"]
            if meta["key"] != key or os.fstat(file.fileno()).st_size != HEADER_BYTES + 16 * count:
                return None
            if checksum_of(file, 16 * count) != meta["crc32"]:
                return None
            arrays = (np.memmap(file, np.int64, "r", offset=HEADER_BYTES, shape=(2, count))
                      if count else np.zeros((2, 0), np.int64))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return RecordIndex(arrays[0], arrays[1], meta["fingerprint"])


def checksum_of(file, size: int) -> int:
    """CRC-32 of the next `size` bytes, read through one small buffer: reading leaves
    the pages in the shared page cache without mapping them into this process."""
    buffer, crc = bytearray(min(CHECKSUM_CHUNK, max(size, 1))), 0
    view = memoryview(buffer)
    while size > 0:
        got = file.readinto(view[:min(size, len(buffer))])
        if not got:
            raise ValueError("cache file shorter than its header says")
        crc, size = zlib.crc32(view[:got], crc), size - got
    return crc


def write_cache(place: Path, key: dict, keys: np.ndarray, offsets: np.ndarray,
                fingerprint: dict) -> None:
    """Header, then the ids and the offsets, under a temporary name renamed into place."""
    arrays = [memoryview(np.ascontiguousarray(a, "<i8")).cast("B") for a in (keys, offsets)]
    meta = {"key": key, "records": len(keys), "fingerprint": fingerprint,
            "crc32": zlib.crc32(arrays[1], zlib.crc32(arrays[0]))}
    header = CACHE_FORMAT + json.dumps(meta).encode()
    if len(header) > HEADER_BYTES:
        raise OSError(f"the cache header of {place} is too long")
    partial = place.with_name(f".{place.name}.{os.getpid()}.partial")
    try:
        with open(partial, "wb") as file:
            file.write(header.ljust(HEADER_BYTES, b"\0"))
            for array in arrays:
                file.write(array)
        os.replace(partial, place)
    finally:
        with contextlib.suppress(OSError):
            partial.unlink()


def parse_index(path: Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """(sorted record ids, their offsets, fingerprint {"bytes", "crc32"}) of train.idx.

    Lines as MXNet writes them ("id<TAB>offset\\n") are parsed in numpy, 64 MiB at a
    time; a file with any other line is parsed line by line, which names the first bad
    line. A record id listed twice keeps its last offset, as a dict would."""
    keys, offsets, crc, size, carry = [], [], 0, 0, b""
    with open(path, "rb") as file:
        while chunk := file.read(CHUNK):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
            data = carry + chunk
            end = data.rfind(b"\n") + 1
            parsed = parse_canonical_lines(data[:end])
            if parsed is None:
                return parse_lines(path)
            keys.append(parsed[0])
            offsets.append(parsed[1])
            carry = data[end:]
    if carry:
        parsed = parse_canonical_lines(carry + b"\n")
        if parsed is None:
            return parse_lines(path)
        keys.append(parsed[0])
        offsets.append(parsed[1])
    all_keys = np.concatenate(keys) if keys else np.empty(0, np.int64)
    all_offsets = np.concatenate(offsets) if offsets else np.empty(0, np.int64)
    return (*sorted_unique(all_keys, all_offsets), {"bytes": size, "crc32": crc})


def parse_canonical_lines(text: bytes) -> tuple[np.ndarray, np.ndarray] | None:
    """The two numbers of every "digits<TAB>digits\\n" line, or None when any line
    differs (other whitespace, a sign, a missing field, a number too long)."""
    data = np.frombuffer(text, np.uint8)
    tabs, ends = np.flatnonzero(data == 9), np.flatnonzero(data == 10)
    if len(tabs) != len(ends):
        return None
    if len(ends) == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    starts = np.concatenate([[0], ends[:-1] + 1])
    key_digits, offset_digits = tabs - starts, ends - tabs - 1
    digits = data - np.uint8(48)  # a byte that is no digit wraps past 9
    if (min(key_digits.min(), offset_digits.min()) < 1
            or max(key_digits.max(), offset_digits.max()) > LONGEST_NUMBER
            or np.count_nonzero(digits > 9) != 2 * len(ends)):
        return None
    return decimal(digits, tabs, key_digits), decimal(digits, ends, offset_digits)


def decimal(digits: np.ndarray, stops: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The numbers whose `lengths` digits end just before `stops`, one digit place at
    a time (at most 18 vector passes, not one Python step per character)."""
    value, place = np.zeros(len(stops), np.int64), 1
    for k in range(int(lengths.max())):
        digit = digits[np.maximum(stops - 1 - k, 0)].astype(np.int64)
        value += np.where(lengths > k, digit, 0) * place
        place *= 10
    return value


def parse_lines(path: Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """Any whitespace between the two numbers; the first line that is not two whole
    numbers is a DataError that names it."""
    keys, offsets, crc, size = [], [], 0, 0
    with open(path, "rb") as lines:  # bytes: a damaged (binary) index is a DataError too
        for number, line in enumerate(lines, 1):
            crc, size = zlib.crc32(line, crc), size + len(line)
            fields = line.split()
            if len(fields) != 2 or not all(f.isdigit() and len(f) <= LONGEST_NUMBER
                                           for f in fields):
                raise DataError(f"{path} line {number} is not 'record_id<TAB>offset': "
                                f"{line.strip()[:60]!r}. Rebuild the index with the packer")
            keys.append(int(fields[0]))
            offsets.append(int(fields[1]))
    return (*sorted_unique(np.array(keys, np.int64), np.array(offsets, np.int64)),
            {"bytes": size, "crc32": crc})


def sorted_unique(keys: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted by id; of an id listed more than once, the last line's offset."""
    if len(keys) < 2 or (np.diff(keys) > 0).all():
        return keys, offsets
    order = np.argsort(keys, kind="stable")
    keys, offsets = keys[order], offsets[order]
    last = np.append(keys[1:] != keys[:-1], True)
    return keys[last], offsets[last]
