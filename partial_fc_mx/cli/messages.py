"""How a command tells the user why it stopped, under a launcher of many processes:
one line per error, once for an error every rank raised together."""

from __future__ import annotations

import os
import sys
import time

PEER_REPORT_SECONDS = 3.0
RANK_0_REPORT_SECONDS = 10.0
LAUNCHER_WORLD_SIZE = ("OMPI_COMM_WORLD_SIZE", "HOROVOD_SIZE", "PMI_SIZE")


def report(error: Exception | str) -> None:
    """One write per message: under mpirun the ranks' lines then never interleave. An
    error every rank raised together (dist.agreed) is printed by rank 0; the others
    give it a moment before they exit, which ends the job under a launcher."""
    if getattr(error, "printed_by_rank_0", False):
        time.sleep(RANK_0_REPORT_SECONDS)
        return
    sys.stderr.write(f"error: {error}\n")
    sys.stderr.flush()


def let_peers_report() -> None:
    """A config error found before Horovod starts (the command line's own) fails
    every rank alike, before any collective; but a launcher ends the job at the first
    exit, and a rank still importing MXNet would be killed before it said why. Under
    a launcher of several processes, wait a moment first."""
    if any(int(os.environ.get(name, "1")) > 1 for name in LAUNCHER_WORLD_SIZE):
        time.sleep(PEER_REPORT_SECONDS)
