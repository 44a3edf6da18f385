"""After a training job ended abnormally: why, after which step, and whether to launch
it again.

run.sh and setup-utils/slurm.sbatch relaunch a failed job (MAX_RESTARTS, in
setup-utils/restarts.sh) on the hosts that still answer. Between two launches they run
`python -m partial_fc_mx restart`, which reads what the job left behind (the
heartbeats' verdict, the launcher's output, the ranks' last steps, the checkpoints),
writes the restart into training.log and metrics.jsonl, and answers with the arguments
to relaunch with, or refuses: a second failure of the same job for the same reason after
the same step (or with no checkpoint saved since) is the job itself (a bad record, a
bug), not a lost host, and relaunching it would loop. A job is one supervisor's run
(its PFC_JOB id): an earlier job's records in the same work dir are not its own. A job
stopped on purpose is not relaunched either, but the supervisor sees that itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from . import checkpoint, heartbeat
from .metrics import METRICS, append_record, read_records


@dataclass(frozen=True)
class Failure:
    """Why a launch ended: `kind` and `who` say whether two failures are the same."""

    kind: str
    """"stall", "lost host", "signal", "watchdog", "error" or "exit"."""
    who: str
    """The rank, the host or the error message it concerns."""
    reason: str
    """The sentence for the log."""
    step: int | None
    """The last step every rank had finished (None: no step was reached)."""

    def same_as(self, record: dict, checkpoint_step: int | None) -> bool:
        """Whether the previous restart (a record of metrics.jsonl) was for this very
        failure: the same kind and rank, host or error, after the same step or with no
        checkpoint saved since (steps are known to about a second)."""
        return (record.get("failure"), record.get("who")) == (self.kind, self.who) and (
            record.get("step") == self.step or record.get("checkpoint") == checkpoint_step)


JOB_VARIABLE = "PFC_JOB"
"""The supervisor's id of a job, exported to every launch (setup-utils/restarts.sh)."""
LOST_HOST = re.compile(r"(?:ORTE|PRTE) has lost communication with a remote daemon.*?"
                       r"Remote daemon:.*? on node (\S+)", re.DOTALL)
SIGNALLED = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exited on signal "
                       r"(\d+) \(([^)]*)\)")
SRUN_FIRST = re.compile(r"^srun: error: (\S+): tasks? ([\d,-]+): (.*)$", re.MULTILINE)
"""srun's first line about a task: the one that failed (with --kill-on-bad-exit, the
tasks it then ends follow as "Killed")."""
WATCHDOG = re.compile(r"^Timeout \(\d+:\d\d:\d\d\)!$", re.MULTILINE)
ERROR = re.compile(r"^error: (.*)$", re.MULTILINE)
INSPECTOR = re.compile(r"Missing ranks:\s*\n\s*(\d+): \[([^\]\n]*)")
"""Horovod's stall inspector (rank 0, after HOROVOD_STALL_CHECK_TIME_SECONDS): the first
rank that had not submitted a collective the others wait in, and the collectives' names.
It fires when that rank is alive but late; a frozen rank blocks it (heartbeat.py)."""


def failure_of(work_dir: Path, status: int, output: str) -> Failure:
    """The failure, from the most specific evidence to the least, with what Horovod's
    stall inspector said, if it spoke."""
    failure = evidence(work_dir, status, output)
    if inspector := INSPECTOR.search(output):
        rank, names = inspector.groups()
        return replace(failure, reason=f"{failure.reason} (Horovod's stall inspector: rank "
                                       f"{rank} had not submitted {names})")
    return failure


def evidence(work_dir: Path, status: int, output: str) -> Failure:
    """The heartbeats' verdict, a host the launcher lost, a rank ended by a signal, the
    watchdog, the ranks' own error, the exit status: the first found."""
    step = last_common_step(work_dir)
    if stall := heartbeat.read_stall(work_dir):
        who = re.match(r"(rank \d+)", stall["reason"])
        return Failure("stall", who.group(1) if who else stall["reason"],
                       f"the job stalled: {stall['reason']}", step)
    if lost := LOST_HOST.search(output):
        host = lost.group(1)
        return Failure("lost host", host, f"the launcher lost its link to host {host}", step)
    if signalled := SIGNALLED.search(output):
        rank, host, number, name = signalled.groups()
        return Failure("signal", f"rank {rank}",
                       f"rank {rank} on {host} was ended by signal {number} ({name})", step)
    if (first := SRUN_FIRST.search(output)) and first.group(3) == "Killed":
        host, tasks, _ = first.groups()
        return Failure("signal", f"task {tasks}", f"task {tasks} on {host} was killed", step)
    if WATCHDOG.search(output):
        return Failure("watchdog", "", "a rank made no progress for stall_timeout seconds "
                       "(the watchdog printed every thread's stack above)", step)
    if error := ERROR.search(output):
        return Failure("error", error.group(1), f"error: {error.group(1)}", step)
    return Failure("exit", str(status), f"the job exited with status {status}", step)


def last_common_step(work_dir: Path) -> int | None:
    """The last step every rank of the ended launch had finished: by its heartbeats
    (written about once a second), and at least its newest checkpoint's."""
    steps = [beat["step"] for beat in heartbeat.read_beats(work_dir).values()]
    saved = checkpoint.checkpoints(work_dir)
    known = [step for step in (min(steps) if steps else None,
                               checkpoint.step_of(saved[-1]) if saved else None)
             if step is not None]
    return max(known) if known else None


def previous_restart(work_dir: Path, job: str) -> dict | None:
    """The last restart record of this job (its supervisor's id) in the work dir's
    metrics.jsonl."""
    path = Path(work_dir) / METRICS
    records = read_records(path) if path.is_file() else []
    restarts = [r for r in records
                if r is not None and r.get("kind") == "restart" and r.get("job") == job]
    return restarts[-1] if restarts else None


def restart(work_dir: Path, status: int, output: str, hosts: list[str], processes: int,
            dropped: list[str], attempt: int, job: str, first_batch: int
            ) -> tuple[list[str], str | None]:
    """(the arguments to relaunch with, why not to relaunch or None), the decision written
    to training.log and metrics.jsonl. The relaunch resumes from the work dir when it
    holds a checkpoint; before the first one it starts again with the first launch's
    global batch (`first_batch`), which the schedule's step counts are steps of."""
    failure = failure_of(work_dir, status, output)
    heartbeat.clear(work_dir)  # read: the next launch starts with none
    previous = previous_restart(work_dir, job)
    saved = checkpoint.checkpoints(work_dir)
    latest = checkpoint.step_of(saved[-1]) if saved else None
    if previous is not None and failure.same_as(previous, latest):
        refusal = (f"not restarting: the job failed again after step {failure.step} for "
                   f"the same reason ({failure.reason}); fix the cause, then resume with "
                   f"--resume-from {work_dir}")
        append_record(work_dir, {"kind": "restart refused", "step": failure.step,
                                 "reason": refusal, "job": job})
        return [], refusal
    append_record(work_dir, {
        "kind": "restart", "attempt": attempt, "step": failure.step, "failure": failure.kind,
        "who": failure.who, "reason": failure.reason, "hosts": hosts, "processes": processes,
        "dropped": dropped, "checkpoint": latest, "job": job})
    if saved:
        return ["--resume-from", str(work_dir)], None
    return [f"reference_batch={first_batch}"], None
