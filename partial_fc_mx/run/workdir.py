"""The work dir contract: one directory that every rank, on every host, sees.

Each checkpoint holds every rank's shard of the class centers, written by that
rank into the same directory, and a resume on any number of processes reads all
of them; so `work_dir` must be on a file system shared by all hosts (NFS, Lustre,
GPFS, ...), as in the reference setups. A run (and the preflight) checks this at
start-up: every rank writes a token, rank 0 must see all of them and every rank
rank 0's. A host with its own private `work_dir` is named at once, not at the first
save hours later.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
import uuid
from pathlib import Path

from .. import dist
from ..errors import UserError

VISIBILITY_WAIT = 10.0
"""Seconds a rank waits for the other ranks' tokens (network file systems may lag)."""


class WorkDirError(UserError, ValueError):
    """A work dir that cannot be used; the message says how to fix it."""


def create(path: str | os.PathLike) -> Path:
    """Make the work dir (every rank does: on a shared file system this is harmless)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise WorkDirError(f"cannot create work_dir {path}: {error}; choose a writable "
                           "--work-dir") from error
    return path


def sharing_problems(work_dir: Path, world: dist.World) -> list[str]:
    """Called by every rank together; the same list on every rank, [] when every rank
    sees every other rank's files in `work_dir`."""
    if world.size == 1:
        return []
    token = dist.allgather_object(uuid.uuid4().hex if world.is_main else None,
                                  name="workdir.token")[0]
    probe = Path(work_dir) / f".shared-check-{token}"
    written = None
    try:
        probe.mkdir(parents=True, exist_ok=True)
        (probe / f"rank_{world.rank}").write_text(socket.gethostname())
    except OSError as error:
        written = f"cannot write into {work_dir}: {error}"
    dist.barrier("workdir.written")
    # rank 0 looks for every token, the others for rank 0's: W lookups in all, not W^2
    missing = unseen(probe, range(world.size) if world.is_main else [0])
    seen = dist.allgather_object((socket.gethostname(), missing, written), name="workdir.seen")
    (probe / f"rank_{world.rank}").unlink(missing_ok=True)  # each its own, then rank 0
    dist.barrier("workdir.checked")
    if world.is_main:
        shutil.rmtree(probe, ignore_errors=True)
    hosts = [host for host, _, _ in seen]
    problems = [f"rank {rank} ({hosts[rank]}): {written}"
                for rank, (_, _, written) in enumerate(seen) if written]
    for rank, (host, missing, _) in enumerate(seen):
        if missing:
            others = ", ".join(f"{r} ({hosts[r]})" for r in missing)
            problems.append(
                f"rank {rank} ({host}) does not see the files that rank(s) {others} wrote "
                f"into work_dir {work_dir}: it is not shared between the hosts. Every rank "
                "writes its shard of the class centers into each checkpoint, and a resume "
                "reads all of them: put work_dir on a file system every host mounts (NFS, "
                "Lustre, ...) with --work-dir")
    return problems


def unseen(probe: Path, ranks) -> list[int]:
    """Those of `ranks` whose token this rank cannot see, after waiting a little."""
    deadline = time.monotonic() + VISIBILITY_WAIT
    while True:
        missing = [r for r in ranks if not (probe / f"rank_{r}").exists()]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.2)


def check_shared(work_dir: Path, world: dist.World) -> None:
    """Raise WorkDirError on every rank when `work_dir` is not shared by all of them."""
    if problems := sharing_problems(work_dir, world):
        raise dist.agreed(WorkDirError("; ".join(problems)))
