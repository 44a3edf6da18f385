"""Files that survive a crash or a power loss: written under a temporary name,
flushed to the disk (fsync), renamed over the final name, and the directory
flushed too, so the name points either to the old complete file or to the new
complete one. Without the fsyncs a power loss after the rename can leave the new
name pointing at an empty or partly written file.

Checksums are CRC-32 (zlib): they catch truncation and damaged bytes, not
tampering, and cost far less than the write itself (docs/benchmarks.md).
"""

from __future__ import annotations

import errno
import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

CHUNK = 16 * 2**20


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's or a directory's contents and metadata to the disk. Some file
    systems (FUSE, CIFS, some parallel ones) cannot fsync a directory (EINVAL,
    ENOTSUP): there a directory's entries are as durable as the file system makes them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as error:
        if not (os.path.isdir(path) and error.errno in (errno.EINVAL, errno.ENOTSUP)):
            raise
    finally:
        os.close(fd)


def replace(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Rename a written temporary file or directory over `final`, durably."""
    fsync_path(tmp)
    os.replace(tmp, final)
    fsync_path(Path(final).parent)


def write_atomically(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """`write(tmp)` writes the content to a temporary path beside `path`, which then
    replaces `path` durably; a crash leaves the old file (and a stray .partial)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial")
    write(tmp)
    replace(tmp, path)


class ChecksumWriter:
    """A binary file that counts and checksums what is written to it, so a
    checkpoint file is checksummed while it is written, not read back afterwards."""

    def __init__(self, file: BinaryIO) -> None:
        self.file, self.size, self.crc = file, 0, 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.size += len(view)
        return self.file.write(view)

    def flush(self) -> None:
        self.file.flush()


def write_file(path: str | os.PathLike, write: Callable[[ChecksumWriter], None]) -> dict:
    """Write `path` through `write(file)`, fsync it; returns {"bytes", "crc32"}."""
    with open(path, "wb") as raw:
        out = ChecksumWriter(raw)
        write(out)
        raw.flush()
        os.fsync(raw.fileno())
    return {"bytes": out.size, "crc32": out.crc}


def written_by(path: str | os.PathLike, write: Callable[[str], None]) -> dict:
    """For writers that need a path (MXNet's save_parameters, np.savez): `write(path)`,
    then fsync and checksum what it wrote; returns {"bytes", "crc32"}."""
    write(str(path))
    fsync_path(path)
    return file_record(path)


def file_record(path: str | os.PathLike) -> dict:
    """{"bytes", "crc32"} of a file already on disk (read back in chunks)."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return {"bytes": size, "crc32": crc}
