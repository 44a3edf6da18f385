"""What ends a training process other than its last step: a stop request (SIGTERM
from a scheduler, Ctrl-C) and the stall watchdog. Both are context managers, so a
process that trains twice (a test, a notebook) gets its signal handlers back and
leaves no watchdog armed."""

from __future__ import annotations

import faulthandler
import signal


class StopRequest:
    """SIGTERM or SIGINT asks for a checkpoint and a clean exit after the current step."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

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
        """128 + the signal, as a shell reports a process ended by it."""
        return 128 + (self.signal or signal.SIGTERM)


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
