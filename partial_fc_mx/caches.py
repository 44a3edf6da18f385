"""Where the toolkit keeps what it can always compute again: Horovod wheels, the
fatbinary table of libmxnet.so, the parsed record index of a read-only dataset."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """~/.cache/partial_fc_mx (XDG_CACHE_HOME moves ~/.cache; PFC_CACHE_DIR replaces
    the whole path, taken from the current folder when relative). install.sh keeps its
    Horovod wheels there too. A relative XDG_CACHE_HOME is ignored, as the XDG
    specification says. RuntimeError where neither is set and there is no home folder
    (no HOME, a uid without a passwd entry): a cache must not land in a folder named
    "~" under the current one. Always absolute: MXNet loads a library only by an
    absolute path (pfc/kernels)."""
    if folder := os.environ.get("PFC_CACHE_DIR"):
        return Path(folder).absolute()
    base = os.environ.get("XDG_CACHE_HOME")
    if base and Path(base).is_absolute():
        return Path(base) / "partial_fc_mx"
    return Path.home() / ".cache" / "partial_fc_mx"
