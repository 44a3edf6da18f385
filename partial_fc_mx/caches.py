"""Where the toolkit keeps what it can always compute again: Horovod wheels, the
fatbinary table of libmxnet.so, the parsed record index of a read-only dataset."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """~/.cache/partial_fc_mx (XDG_CACHE_HOME moves ~/.cache; PFC_CACHE_DIR replaces
    the whole path). install.sh keeps its Horovod wheels there too. RuntimeError where
    neither is set and there is no home folder (no HOME, a uid without a passwd entry):
    a cache must not land in a folder named "~" under the current one."""
    if folder := os.environ.get("PFC_CACHE_DIR"):
        return Path(folder)
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "partial_fc_mx"
