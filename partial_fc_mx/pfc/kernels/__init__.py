"""The project's C++ operators for the CPU, built on first use and loaded into MXNet with
its library API (as `mx.library.load` does, without its cost: mxnet_library.py), which
then offers them as mx.nd.pfc_* and mx.sym.pfc_*: Partial FC's row passes (rows.cc) and
the backbones' PReLU and LayerNorm (prelu.cc, layer_norm.cc), one library, with what
they need in common.h.

They are compiled on the machine that runs them, once per version of their sources, headers
and MXNet, into PARTIAL_FC_MX_KERNELS (default: kernels/ in the toolkit's cache
folder, caches.default_cache_dir): g++ is all they need, and setup-utils/install.sh installs it for
Horovod's build anyway. Ranks that start together build once: one builds under a file
lock while the others wait for it (where the file system has no locks, each builds),
and the library appears under its final name only
when complete and on disk, so a rank never loads a half-written file, even on a folder
that several hosts share. A new build removes killed builds' temporary files and the
libraries older sources or compilers built over 30 days before (`prune`). Every
failure is a KernelBuildError that says what to do; training's start-up raises it on
every rank together (train.start).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from ...caches import default_cache_dir
from ...errors import UserError

FOLDER = Path(__file__).parent
SOURCES = [FOLDER / "rows.cc", FOLDER / "prelu.cc", FOLDER / "layer_norm.cc", FOLDER / "gemm.cc"]
HEADER = FOLDER / "common.h"
FLAGS = ["-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno",
         "-fno-trapping-math", "-Wl,-Bsymbolic"]
"""No -ffast-math: a NaN must stay a NaN (the step's check for non-finite losses); no
-march=native: target_clones (common.h) picks the vector width when it loads.
-fno-trapping-math: no code here reads floating-point exception flags, and without it
the compiler does not vectorize the exp's selects on CPUs without AVX-512.
-Bsymbolic: the library API's classes bind to this library's own copy; libmxnet.so
exports a copy built with another C++ ABI, which Horovod's import makes global (the
library then crashed as it loaded)."""


class KernelBuildError(UserError, RuntimeError):
    """The C++ kernels could not be built; says what to install or where to look."""


@functools.cache
def load() -> None:
    """Build (where not yet built) and load the kernels into this process, once."""
    import mxnet as mx

    from .mxnet_library import load_library

    library = build(mxnet_folder())
    try:
        load_library(library)
    except mx.base.MXNetError as error:
        raise KernelBuildError(f"MXNet cannot load partial_fc_mx's CPU kernels from {library} "
                               f"({last_line(str(error))}): delete that file, it is built "
                               "again on next use (if MXNet refuses the new one too, this "
                               "MXNet cannot load it: reinstall with setup-utils/install.sh)"
                               ) from error


def last_line(message: str) -> str:
    """MXNet's error without its stack trace: the last line, where it says why."""
    lines = message.strip().splitlines()
    return lines[-1] if lines else "no reason given"


def mxnet_folder() -> Path:
    """The installed MXNet package, which ships the library API's header and source."""
    import mxnet as mx

    return Path(mx.__file__).parent


def build(mxnet: Path) -> Path:
    """The built library for these sources and this MXNet, compiled when missing."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise KernelBuildError("partial_fc_mx's CPU kernels need a C++ compiler: install g++ "
                               "(apt-get install g++, as setup-utils/install.sh does) or set "
                               "CXX to one")
    api_source, api_header = mxnet / "src" / "lib_api.cc", mxnet / "include" / "mxnet" / "lib_api.h"
    for needed in (api_source, api_header):
        if not needed.is_file():
            raise KernelBuildError(f"{needed} is missing: the MXNet package at {mxnet} lacks "
                                   "its library API; reinstall it (setup-utils/install.sh)")
    sources, headers = [*SOURCES, api_source], [HEADER, api_header]
    command = [compiler, *FLAGS, f"-I{HEADER.parent}", f"-I{mxnet / 'include'}",
               *map(str, sources)]
    try:
        folder = kernel_folder()
    except RuntimeError as error:  # no HOME, and a uid without a passwd entry (caches.py)
        raise KernelBuildError(f"no folder to build partial_fc_mx's CPU kernels in ({error}): "
                               "set PARTIAL_FC_MX_KERNELS to a writable folder") from error
    try:
        library = folder / f"kernels-{fingerprint(command, [*sources, *headers])}.so"
        folder.mkdir(parents=True, exist_ok=True, mode=0o755)
        if not os.environ.get("PARTIAL_FC_MX_KERNELS"):
            only_owner_writes(folder)  # the toolkit's own folder, whatever the umask made it
        refuse_if_others_write(folder)
        if library.is_file():
            refuse_if_others_write(library)
            with contextlib.suppress(OSError):  # in use: prune() keeps it
                os.utime(library)
            return library
        with open(folder / f"{library.name}.lock", "w") as lock:
            # another rank may be building it; a file system without locks (Lustre
            # mounted noflock, NFS nolock) refuses: then ranks build alike, and
            # compile_to publishes whole files only, the first one kept
            with contextlib.suppress(OSError):
                fcntl.flock(lock, fcntl.LOCK_EX)
            if not library.is_file():
                compile_to(command, library)
                prune(folder, library)
    except OSError as error:  # raised, like every failure here, by each rank that meets it
        raise KernelBuildError(f"cannot build partial_fc_mx's CPU kernels in {folder}: {error}; "
                               "set PARTIAL_FC_MX_KERNELS to a writable folder") from error
    return library


PARTIAL_AGE_SECONDS = 3600
"""A build's temporary file older than this was left by a killed build."""
OLD_LIBRARY_SECONDS = 30 * 86400
"""A library of another source, MXNet or compiler that nothing loaded for this long is
removed when a new one is built (a host that uses one again builds it again)."""


def prune(folder: Path, keep: Path) -> None:
    """What builds leave behind: killed builds' temporary files, and libraries (with
    their lock files) that older sources, MXNets or compilers built and nothing loaded
    for OLD_LIBRARY_SECONDS (a load touches its library)."""
    now = time.time()
    for path in folder.glob("*.so.partial"):
        with contextlib.suppress(OSError):  # another rank's, removed already
            if now - path.stat().st_mtime > PARTIAL_AGE_SECONDS:
                path.unlink()
    # rows-*.so: the name of the library before prelu.cc joined it
    for old in [*folder.glob("kernels-*.so"), *folder.glob("rows-*.so")]:
        with contextlib.suppress(OSError):
            if old != keep and now - old.stat().st_mtime > OLD_LIBRARY_SECONDS:
                old.unlink()
                old.with_name(f"{old.name}.lock").unlink(missing_ok=True)


def only_owner_writes(folder: Path) -> None:
    """Take group and others' write permission off a folder of this user's (a umask of
    002 gives it to new folders)."""
    status = folder.stat()
    if status.st_uid == os.getuid() and status.st_mode & 0o022:
        folder.chmod(status.st_mode & 0o755)


def refuse_if_others_write(path: Path) -> None:
    """The library is loaded into every training process: a folder or file that another
    user (root aside) owns or can write could hand it their code (a planted kernels-*.so,
    or one swapped in while a build runs)."""
    status = path.stat()
    if status.st_uid not in (os.getuid(), 0):
        why = f"is owned by uid {status.st_uid}, not by this user (uid {os.getuid()}) or root"
    elif status.st_mode & 0o022:
        why = f"can be written by other users (mode {status.st_mode & 0o777:o})"
    else:
        return
    raise KernelBuildError(
        f"refusing partial_fc_mx's CPU kernels at {path}: it {why}, so another user could "
        f"replace the code every training process loads. Run `chmod go-w {path}` if it is "
        "yours, or set PARTIAL_FC_MX_KERNELS to a folder only you can write")


def kernel_folder() -> Path:
    """PARTIAL_FC_MX_KERNELS, else the toolkit cache's kernels/ folder; absolute (a
    relative setting from the current folder): MXNet's library loader takes no other
    path."""
    setting = os.environ.get("PARTIAL_FC_MX_KERNELS")
    return Path(setting).absolute() if setting else default_cache_dir() / "kernels"


def fingerprint(command: list[str], inputs: list[Path]) -> str:
    """A name for the build: it changes with the sources, the headers, the command, the
    compiler's version and the machine's architecture (a home folder may be shared by
    hosts of several), so that no stale or foreign library is ever loaded."""
    digest = hashlib.sha256("\0".join([platform.machine(), *command]).encode())
    version = subprocess.run([command[0], "--version"], capture_output=True, text=True)
    digest.update(version.stdout.encode())
    for path in inputs:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def compile_to(command: list[str], library: Path) -> None:
    """Compile to a temporary name beside `library`, flush it to disk, then publish it
    under its name as a hard link: readers see the whole file or none, and a library
    another host published meanwhile (where the lock does not reach across hosts) is
    kept, not replaced under a process that has it mapped. Readable by all, as a build
    output in a shared folder must be."""
    handle, partial = tempfile.mkstemp(dir=library.parent, suffix=".so.partial")
    os.close(handle)
    try:
        done = subprocess.run([*command, "-o", partial], capture_output=True, text=True)
        if done.returncode != 0:
            raise KernelBuildError(f"building partial_fc_mx's CPU kernels failed: "
                                   f"{' '.join(command)}\n{done.stderr[-3000:]}")
        os.chmod(partial, 0o755)
        with open(partial, "rb") as built:
            os.fsync(built.fileno())
        try:
            os.link(partial, library)
        except FileExistsError:  # another host's build, already published: keep it
            pass
        except OSError:  # a file system without hard links (s3fs, vfat, some CIFS)
            os.replace(partial, library)
    finally:
        with contextlib.suppress(FileNotFoundError):  # replaced: nothing left
            os.unlink(partial)
