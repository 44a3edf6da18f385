"""A process a training rank starts beside itself (the precision probe, the ONNX
export): a new Python interpreter, started by fork + exec, never a fork of an MPI rank
that goes on running. It must never outlive, slow down or endanger the rank.

The rank starts it in a session of its own (subprocess's start_new_session=True): a
signal to the rank's process group (a terminal's Ctrl-C, a launcher's stop) is for the
rank, which then ends its side processes itself; PR_SET_PDEATHSIG ends them if the rank
dies."""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import sys

NICENESS = 19


def become_side_process(parent: int, nice: bool = True) -> None:
    """Called first in the side process: end with the rank that started it (a kill -9
    of the rank runs no cleanup in it), let the rank's work go first (niced; the OOM
    killer's first choice, not a rank), and leave no core file when it crashes (the
    probe may crash in oneDNN on purpose). Linux; elsewhere only what is portable."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the rank died before prctl took effect
        sys.exit(1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # finally runs
    with contextlib.suppress(OSError, ValueError):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    with contextlib.suppress(OSError):
        with open("/proc/self/oom_score_adj", "w") as score:
            score.write("1000")
    if nice:
        os.nice(NICENESS)
