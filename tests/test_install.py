"""What install.sh says when it is done: the Horovod build by section, each mark once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_closing_line_names_each_part_of_the_build_once():
    venv = Path(sys.executable).parent.parent
    result = subprocess.run(
        ["bash", "-c", f"VENV={venv} source {REPO}/setup-utils/install.sh && horovod_summary"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("Horovod v0.28.1 for MXNet; controllers: MPI, Gloo; "
                                     "tensor operations: MPI, Gloo"), result.stdout
