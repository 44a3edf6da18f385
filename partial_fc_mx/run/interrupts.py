"""What ends a training process other than its last step: a stop request (SIGTERM
from a scheduler, Ctrl-C, SIGUSR1 from a launcher) and the stall watchdog. Both are
context managers, so a process that trains twice (a test, a notebook) gets its signal
handlers back and leaves no watchdog armed."""

from __future__ import annotations

import faulthandler
import os
import signal

STOPPED_STATUS = 143
"""A rank's exit status after a stop on purpose that saved, whatever the signal (128 +
SIGTERM, as a shell reports a process ended by it): not 0, so that `horovodrun ... &&
next` does not take a stopped run for a finished one."""
STOPPED_STATUS_VARIABLE = "PFC_STOPPED_STATUS"
"""Set by run.sh and slurm.sbatch to 0: they report the stop themselves (one line, exit
143), and a rank that exits non-zero would make mpirun end the ranks still closing
(waiting the whole STOP_GRACE twice first) and srun print its error lines."""


class StopRequest:
    """SIGTERM, SIGINT or SIGUSR1 asks for a checkpoint and a clean exit after the
    current step. SIGUSR1 is what Open MPI's mpirun (and srun) forward to every rank
    without ending the job; Slurm's `--signal=USR1@seconds` sends it before a time limit."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> StopRequest:
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        self.signal = signum

    @property
    def exit_code(self) -> int:
        """STOPPED_STATUS, or what the launcher asked for in PFC_STOPPED_STATUS."""
        asked = os.environ.get(STOPPED_STATUS_VARIABLE, "")
        return int(asked) if asked.isdigit() and int(asked) < 256 else STOPPED_STATUS


class Watchdog:
    """Past `seconds` without a restart() the process prints every thread's stack and
    exits, so a rank stuck in a collective (or a file system, or a link) fails instead
    of hanging, and its launcher ends the others. 0: no watchdog."""

    def __init__(self, seconds: int) -> None:
        self.seconds = seconds

    def __enter__(self) -> Watchdog:
        if self.seconds:
            faulthandler.enable()
            self.restart()
        return self

    def __exit__(self, *exc) -> None:
        if self.seconds:
            faulthandler.cancel_dump_traceback_later()

    def restart(self) -> None:
        if self.seconds:
            faulthandler.dump_traceback_later(self.seconds, exit=True)
