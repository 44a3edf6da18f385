"""Where an interrupted arm of the study goes on from: a run of arcface_torch at 100,000
identities and r = 1.0 takes about 3.5 hours here, longer than a machine may be held.
At each evaluation step every rank of arcface_torch's arm writes its whole training
state to its own file (durable.write_atomically: a file present is complete); a run
started again in the same folder goes on from the latest step for which every rank's
file is there, and the older files are removed once the next set is complete. Only
the file names are decided here, so the rule is tested without torch. Ours saves the
trainer's own checkpoints (run/checkpoint.py) in a folder of the run's
(ours_resume.py)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

PATTERN = re.compile(r"resume-(\d+)-rank(\d+)\.pt")


def ours_folder(out: Path) -> Path:
    """Where our arm keeps its checkpoints and their progress."""
    return out / "ours-state"


def state_file(out: Path, step: int, rank: int) -> Path:
    return out / f"resume-{step:06d}-rank{rank}.pt"


def saved(out: Path) -> dict[int, set[int]]:
    """The ranks that have a state file, per step."""
    ranks: dict[int, set[int]] = {}
    for path in out.glob("resume-*-rank*.pt"):
        match = PATTERN.fullmatch(path.name)
        if match:
            ranks.setdefault(int(match[1]), set()).add(int(match[2]))
    return ranks


def latest_complete(out: Path, world: int) -> int:
    """The latest step every one of `world` ranks saved; 0 (the beginning) if none."""
    complete = [step for step, ranks in saved(out).items() if ranks == set(range(world))]
    return max(complete, default=0)


def remove(out: Path, rank: int, keep: int | None = None) -> None:
    """This rank's state files but that of step `keep` (all of them if None)."""
    for step, ranks in saved(out).items():
        if rank in ranks and step != keep:
            state_file(out, step, rank).unlink(missing_ok=True)


def clear(out: Path) -> None:
    """Every rank's state files, and ours' checkpoints: a finished run needs none, and a
    run stopped between writing its log and removing them keeps its last set (100 MB a
    rank at 100,000 identities) until the study finds it finished. A file already gone
    is no error: the run's ranks may be removing theirs at the same moment."""
    for step, ranks in saved(out).items():
        for rank in ranks:
            state_file(out, step, rank).unlink(missing_ok=True)
    shutil.rmtree(ours_folder(out), ignore_errors=True)
