"""Heartbeats: when a job stops progressing, which rank stopped it, on which host,
after which step.

A rank that freezes (SIGSTOP, a host swapping to death or hung as a whole) leaves every
other rank waiting in the next collective without knowing for whom. Horovod's stall
inspector runs on rank 0 only and needs the very coordination the frozen rank blocks,
and the watchdog (`stall_timeout`) fires only after half an hour and names nobody. So
every rank runs a thread that, every few seconds, rewrites a small file in the shared
work dir (heartbeats/<launch>.rank_<r>.json: its host, its pid, the last step it finished, a
beat counter) and, once its own steps have stopped moving, reads the others'. A rank
whose own step has not moved for `heartbeat_timeout` seconds while some peer's beat
counter has not changed for as long writes heartbeats/stall.json, which names that
peer, and ends its process; its launcher then ends the job, and the restart supervisor
(restarts.py) reads the reason.

Each reader times a peer by its own clock (when it last saw the counter change): the
hosts' clocks need not agree. A rank that finished writes a last beat marked done, so a
peer still at work (rank 0's final evaluation) never takes it for a frozen one. A
thread that beats while its process waits does not need the GIL for long: MXNet's and
Horovod's waits release it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from pathlib import Path

from .. import dist

HEARTBEATS = "heartbeats"
STALL = "stall.json"
LAUNCH = "launch"
"""The file naming the current launch: a process left from an earlier one (behind a
cut link) may still beat, under its own launch's names."""
WRITE_SPACING = 1.0
"""Seconds between two writes of a rank's beat: fast steps are written down once a
second, a file system is not asked for more."""
STALL_EXIT = 75
"""The exit status of a rank that found a stalled peer (EX_TEMPFAIL: try again)."""


def beats_dir(work_dir: str | os.PathLike) -> Path:
    return Path(work_dir) / HEARTBEATS


def write_text(path: Path, text: str) -> None:
    """Whole or not at all: a reader on another host never sees half a record."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)


def write_json(path: Path, record: dict) -> None:
    write_text(path, json.dumps(record))


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def beat_file(folder: Path, launch: str, rank: int) -> Path:
    return folder / f"{launch}.rank_{rank}.json"


def current_launch(work_dir: str | os.PathLike) -> str | None:
    try:
        return (beats_dir(work_dir) / LAUNCH).read_text().strip() or None
    except OSError:
        return None


def read_beats(work_dir: str | os.PathLike) -> dict[int, dict]:
    """{rank: its last beat} of the latest launch in the work dir."""
    launch = current_launch(work_dir)
    if launch is None:
        return {}
    beats = [read_json(path) for path in beats_dir(work_dir).glob(f"{launch}.rank_*.json")]
    return {beat["rank"]: beat for beat in beats if beat is not None}


def read_stall(work_dir: str | os.PathLike) -> dict | None:
    """What the latest launch's stall detection found: {"reason", "step"}, or None."""
    stall = read_json(beats_dir(work_dir) / STALL)
    return stall if stall and stall.get("launch") == current_launch(work_dir) else None


def clear(work_dir: str | os.PathLike) -> None:
    """Forget a launch's beats and verdict (the supervisor, once it has read them; rank
    0 at the start of a launch)."""
    for path in beats_dir(work_dir).glob("*"):
        try:
            path.unlink()
        except OSError:  # a file another host still holds open (NFS's .nfsXXXX)
            pass


class Heartbeat:
    """Beat, watch the peers, and end the process when one of them froze the job.
    Every rank enters it together (it clears the previous launch's files)."""

    def __init__(self, work_dir: Path, world: dist.World, host: str, timeout: float,
                 first_step: int = 0) -> None:
        self.folder, self.world, self.host, self.timeout = beats_dir(work_dir), world, host, timeout
        self.interval = min(5.0, timeout / 6)
        self.step, self.moved = first_step, time.monotonic()
        self.beat, self.done = 0, False
        self.read = 0.0
        """When this rank last looked at its peers' beats."""
        self.seen: dict[int, tuple] = {}
        """{peer: (its last beat counter, when this rank saw it change)}"""
        self._stop, self._stepped = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def __enter__(self) -> Heartbeat:
        if not self.timeout:
            return self
        self.folder.mkdir(parents=True, exist_ok=True)
        mine = None
        if self.world.is_main:  # the previous launch's beats and verdict say nothing now
            clear(self.folder.parent)
            mine = uuid.uuid4().hex
            try:
                write_text(self.folder / LAUNCH, mine)
            except OSError:
                pass
        self.launch = (dist.allgather_object(mine, name="heartbeat.launch")[0]
                       if self.world.size > 1 else mine)
        self._write()
        now = time.monotonic()
        self.seen = {peer: (None, now) for peer in range(self.world.size)
                     if peer != self.world.rank}
        self._thread.start()
        return self

    def __exit__(self, error_type, *exc) -> None:
        """A rank that finished says so in a last beat; one that failed only stops
        beating (if it hangs on its way out, its peers name it)."""
        if not self.timeout:
            return
        self._stop.set()
        self._stepped.set()
        self._thread.join()
        if error_type is None:
            self.done = True
            self._write()

    def finished(self, step: int) -> None:
        """Called after every step: the thread writes it down (at most once a second),
        so the supervisor knows after which step a job failed."""
        self.step, self.moved = step, time.monotonic()
        self._stepped.set()

    def _write(self) -> None:
        self.beat += 1
        try:
            write_json(beat_file(self.folder, self.launch, self.world.rank), {
                "rank": self.world.rank, "host": self.host, "pid": os.getpid(),
                "step": self.step, "beat": self.beat, "launch": self.launch,
                "done": self.done})
        except OSError:  # a full or lagging disk: the watchdog remains
            pass

    def _run(self) -> None:
        written = time.monotonic()
        while not self._stop.is_set():
            self._stepped.wait(max(self.interval - (time.monotonic() - written), 0.0))
            self._stepped.clear()
            if self._stop.is_set():
                return
            self._write()
            written = time.monotonic()
            if reason := self.stalled_peers(written):
                self._end(reason)
            self._stop.wait(WRITE_SPACING)

    def stalled_peers(self, now: float) -> str | None:
        """Why the job stopped, when this rank has waited `timeout` for its next step
        and a peer has not beaten for as long; None while all is well. A rank whose
        steps move reads nothing: every peer took part in them."""
        if now - self.moved < 2 * self.interval or now - self.read > 2 * self.interval:
            # moving: every peer took part; or this rank itself could not look (a file
            # system that hung every rank's writes): a peer is timed from now on
            self.seen = {peer: (None, now) for peer in self.seen}
            self.read = now
            return None
        self.read = now
        frozen = []
        for peer, (last, since) in self.seen.items():
            beat = read_json(beat_file(self.folder, self.launch, peer))
            if beat is not None and beat["done"]:
                continue
            if beat is not None and beat["beat"] != last:
                self.seen[peer] = (beat["beat"], now)
            elif now - since > self.timeout:
                frozen.append((peer, beat, now - since))
        if not frozen:
            return None
        named = "; ".join(
            f"rank {peer} ({beat['host']}, pid {beat['pid']}) stopped beating after step "
            f"{beat['step']}" if beat else
            f"rank {peer} never beat" for peer, beat, _ in frozen)
        return (f"{named}: no heartbeat for {max(age for *_, age in frozen):.0f} s while "
                f"rank {self.world.rank} ({self.host}) waited for it "
                f"(heartbeat_timeout={self.timeout:g})")

    def _end(self, reason: str) -> None:
        """Leave the verdict for the supervisor and end this process: its launcher ends
        the job (a frozen rank cannot leave by itself)."""
        try:
            write_json(self.folder / STALL, {"reason": reason, "step": self.step,
                                             "launch": self.launch})
        except OSError:
            pass
        sys.stderr.write(f"error: the job stalled: {reason}\n")
        sys.stderr.flush()
        os._exit(STALL_EXIT)
