"""What MXNet the running interpreter already has, for `MXNET_PACKAGE=preinstalled`.

install.sh runs this with the system's python3 before it makes the venv, and with the
venv's python after installing our pins: both must find the same MXNet, numpy and
(when present) Horovod, in the same folders, or a pin of ours has shadowed the
machine's package. Standard library only, apart from importing what it checks.

Prints `key=value` lines (mxnet_version, mxnet_dir, mxnet_library, mxnet_cuda,
numpy_version, numpy_dir, horovod_version, horovod_dir, python_version); exits 1 with
the reason on stderr when MXNet is missing, not 1.9.x, does not import with the numpy
beside it, or the interpreter is older than the package needs.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

NEEDED_PYTHON = (3, 10)
MXNET_SERIES = "1.9."


def fail(reason: str) -> None:
    print(f"{sys.executable}: {reason}", file=sys.stderr)
    sys.exit(1)


def found() -> dict[str, str]:
    """The facts install.sh compares, or an exit naming what is wrong."""
    if sys.version_info[:2] < NEEDED_PYTHON:
        fail(f"Python {sys.version.split()[0]} is older than partial_fc_mx needs "
             f"({'.'.join(map(str, NEEDED_PYTHON))})")
    if importlib.util.find_spec("mxnet") is None:
        fail("has no mxnet; MXNET_PACKAGE=preinstalled uses the MXNet this interpreter "
             "already has (an NGC MXNet container's, for one). Install MXNet 1.9.x for it "
             "first, or use MXNET_PACKAGE=mxnet to install the PyPI wheel into the venv")
    try:
        import mxnet
    except Exception as error:  # noqa: BLE001 - MXNet's import raises what its library raises
        fail(f"has mxnet, but it does not import: {type(error).__name__}: {error}. A numpy "
             "that the PyPI MXNet 1.9 cannot use (1.24 or newer, or none) or missing CUDA "
             "libraries are the usual causes")
    import numpy

    if not mxnet.__version__.startswith(MXNET_SERIES):
        fail(f"mxnet {mxnet.__version__} ({Path(mxnet.__file__).parent}) is not the "
             f"{MXNET_SERIES}x series partial_fc_mx is built and tested on")
    facts = {
        "python_version": sys.version.split()[0],
        "mxnet_version": mxnet.__version__,
        "mxnet_dir": str(Path(mxnet.__file__).resolve().parent),
        "mxnet_library": str(Path(mxnet.libinfo.find_lib_path()[0]).resolve()),
        "mxnet_cuda": "1" if mxnet.runtime.Features().is_enabled("CUDA") else "0",
        "numpy_version": numpy.__version__,
        "numpy_dir": str(Path(numpy.__file__).resolve().parent),
        "horovod_version": "",
        "horovod_dir": "",
    }
    try:
        import horovod
    except ImportError:
        return facts
    facts["horovod_version"] = horovod.__version__
    facts["horovod_dir"] = str(Path(horovod.__file__).resolve().parent)
    return facts


if __name__ == "__main__":
    for key, value in found().items():
        print(f"{key}={value}")
