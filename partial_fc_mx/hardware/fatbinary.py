"""The GPU code in a CUDA library, read from its fatbinaries without a CUDA toolkit.

nvcc puts each compiled source file's GPU code in a fatbinary: a 16-byte header
(magic 0xBA55ED50, version 1, header size 16, size of what follows), then images,
each a header (kind: 1 PTX, 2 SASS; its own size; the padded payload size; the
architecture at byte 28, 86 for sm_86) and its payload. The layout is NVIDIA's and
undocumented; this reads only those fields, as cuobjdump's listings show them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import struct
import tempfile
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

FATBIN_MAGIC = struct.pack("<I", 0xBA55ED50)
CONTAINER_HEADER = struct.Struct("<HHQ")  # version 1, header size 16, size of what follows
IMAGE_HEADER = struct.Struct("<HHIQ")  # kind, version, header size, padded payload size
IMAGE_ARCH_OFFSET = 28  # u32: 86 for sm_86 / compute_86
CACHE_FORMAT = 1  # part of the cache key: a change to what is read here invalidates it
PTX, SASS_KINDS = 1, (2, 0x10)  # 0x10: an ELF (SASS) variant newer CUDA releases write


@dataclass(frozen=True)
class Fatbinary:
    """The architectures one fatbinary has code for, e.g. sass=(50, 60, 70, 80, 86)."""

    sass: tuple[int, ...]
    ptx: tuple[int, ...]


def read_fatbinaries(data: bytes | mmap.mmap) -> Counter[Fatbinary]:
    """Every fatbinary in a library's bytes, counted by the set of images it holds."""
    found: Counter[Fatbinary] = Counter()
    position = data.find(FATBIN_MAGIC)
    while position >= 0:
        end = container_end(data, position)
        if end is None:  # the magic bytes by chance, not a container
            position = data.find(FATBIN_MAGIC, position + 1)
            continue
        images = read_images(data, position + 16, end)
        if images.sass or images.ptx:  # an empty container holds no kernel to run
            found[images] += 1
        position = data.find(FATBIN_MAGIC, end)
    return found


def container_end(data: bytes | mmap.mmap, position: int) -> int | None:
    """Where the container whose magic is at `position` ends; None when its header is
    not one (the four magic bytes can occur by chance) or it runs past the data."""
    if position + 16 > len(data):
        return None
    version, header_size, size = CONTAINER_HEADER.unpack_from(data, position + 4)
    end = position + 16 + size
    return end if version == 1 and header_size == 16 and end <= len(data) else None


def read_images(data: bytes | mmap.mmap, start: int, end: int) -> Fatbinary:
    """The architectures of the images between `start` and `end`; images of kinds
    other than SASS and PTX are passed over."""
    sass, ptx = set(), set()
    while start + IMAGE_ARCH_OFFSET + 4 <= end:
        kind, _version, header_size, payload_size = IMAGE_HEADER.unpack_from(data, start)
        (arch,) = struct.unpack_from("<I", data, start + IMAGE_ARCH_OFFSET)
        if kind in SASS_KINDS:
            sass.add(arch)
        elif kind == PTX:
            ptx.add(arch)
        if header_size == 0:
            break
        start += header_size + payload_size
    return Fatbinary(tuple(sorted(sass)), tuple(sorted(ptx)))


def library_fatbinaries(library: Path, cache_dir: Path) -> Counter[Fatbinary]:
    """`read_fatbinaries` of a file, cached by its path, size and modification time:
    libmxnet.so is about 900 MB and the preflight runs on every rank. A cache that
    cannot be read or written (permissions, a read-only home) only costs time; the
    library that cannot be read raises OSError."""
    stat = library.stat()
    if stat.st_size == 0:  # mmap cannot map an empty file
        return Counter()
    key = f"{CACHE_FORMAT}:{library.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    cached = cache_dir / f"fatbinaries-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    try:
        return Counter({Fatbinary(tuple(f["sass"]), tuple(f["ptx"])): f["count"]
                        for f in json.loads(cached.read_text())})
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not there, unreadable or damaged: read the library again
    found = read_file(library)
    partial = cached.with_name(f"{cached.name}.{os.getpid()}.partial")
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps([{"sass": list(f.sass), "ptx": list(f.ptx), "count": n}
                                       for f, n in found.items()]))
        os.replace(partial, cached)
    except OSError:
        with contextlib.suppress(OSError):
            partial.unlink()
    return found


def read_file(path: str | os.PathLike) -> Counter[Fatbinary]:
    """Those of one file, mapped rather than read into memory."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return read_fatbinaries(data)


def wheel_fatbinaries(wheel: str | os.PathLike) -> Counter[Fatbinary]:
    """Those of an MXNet wheel's libmxnet.so, unpacked to a temporary directory."""
    with zipfile.ZipFile(wheel) as archive, tempfile.TemporaryDirectory() as scratch:
        return read_file(archive.extract("mxnet/libmxnet.so", scratch))
