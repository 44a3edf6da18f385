"""Where the toolkit keeps what it can always compute again: Horovod wheels, the
fatbinary table of libmxnet.so, the parsed record index of a read-only dataset."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """~/.cache/partial_fc_mx (XDG_CACHE_HOME moves ~/.cache; PFC_CACHE_DIR replaces
    the whole path). install.sh keeps its Horovod wheels there too."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(os.environ.get("PFC_CACHE_DIR") or Path(base) / "partial_fc_mx")
