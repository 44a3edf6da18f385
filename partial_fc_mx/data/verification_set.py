"""Verification sets in insightface's .bin layout: pairs of faces, same person or not.

The file is a pickle of (encoded images, issame): images 2k and 2k+1 form pair k.
lfw.bin, cfp_fp.bin and agedb_30.bin have this layout; so do the held-out sets
made here from identities the model never trained on.

A pickle can name any Python callable to run while it is read, so a crafted .bin
could run commands on whoever evaluates it. `read_verification_bin` therefore
unpickles with a whitelist: containers, bytes, bools and numbers, and numpy's
array rebuilders (some .bin files hold images as uint8 arrays); anything else is
refused before it is called.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import numpy as np

from .. import durable
from . import DataError

# What an insightface .bin may reference: `_codecs.encode` turns Python 2 strings
# into bytes; the numpy entries rebuild arrays and scalars from raw bytes.
FOLDS = 10
"""The verification protocol's folds: a threshold chosen on nine, scored on the tenth
(evaluation/verification.py); a set needs at least this many pairs."""

ALLOWED_GLOBALS = {
    ("_codecs", "encode"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
}


class _BinUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(
                f"it references {module}.{name}, which an insightface .bin never holds; "
                "refused without running it (a crafted file could run code)")
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("it uses persistent ids, which a .bin never holds")


def read_verification_bin(path: str | os.PathLike) -> tuple[list[bytes], np.ndarray]:
    """(encoded images, issame as bools) of a .bin, read without running any code."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"verification set {path.absolute()} does not exist") from None
    try:
        content = _BinUnpickler(io.BytesIO(data), encoding="bytes").load()
    except Exception as error:
        raise DataError(f"{path} is not an insightface .bin (a pickle of (images, issame)): "
                        f"{error}") from error
    if not (isinstance(content, (tuple, list)) and len(content) == 2):
        raise DataError(f"{path} holds a {type(content).__name__}, not the pair "
                        "(images, issame) of an insightface .bin")
    images, issame = content
    if isinstance(images, np.ndarray) and images.dtype == np.uint8 and images.ndim == 2:
        images = list(images)
    if not isinstance(images, (list, tuple)) or not all(
            isinstance(i, (bytes, bytearray, np.ndarray)) for i in images):
        raise DataError(f"{path}: the images must be a list of encoded images (bytes)")
    flags = np.asarray(issame)
    if flags.ndim != 1 or not (flags.dtype == bool or np.isin(flags, (0, 1)).all()):
        raise DataError(f"{path}: issame must be a list of booleans, one per pair")
    return [bytes(memoryview(i).cast("B")) for i in images], flags.astype(bool)


def write_verification_bin(path: str | os.PathLike, images: list[bytes],
                           issame: list[bool]) -> None:
    if len(images) != 2 * len(issame):
        raise ValueError(f"{len(images)} images for {len(issame)} pairs")
    content = (list(images), [bool(s) for s in issame])
    durable.write_atomically(path, lambda tmp: tmp.write_bytes(pickle.dumps(content, protocol=4)))
