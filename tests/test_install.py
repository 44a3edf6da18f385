"""What install.sh says when it is done: the Horovod build by section, each mark once."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHECK_BUILD = """Horovod v0.28.1:

Available Frameworks:
    [ ] TensorFlow
    [X] PyTorch
    [X] MXNet

Available Controllers:
    [X] MPI
    [X] Gloo

Available Tensor Operations:
    [{nccl}] NCCL
    [ ] DDL
    [ ] CCL
    [X] MPI
    [X] Gloo
"""


def summary(tmp_path: Path, check_build: str) -> subprocess.CompletedProcess:
    """horovod_summary of install.sh (sourced: its functions alone) against a venv
    whose horovodrun prints `check_build`."""
    (tmp_path / "bin").mkdir(exist_ok=True)
    stub = tmp_path / "bin" / "horovodrun"
    stub.write_text(f"#!/bin/sh\ncat <<'EOF'\n{check_build}EOF\n")
    stub.chmod(0o755)
    return subprocess.run(["bash", "-c", f"VENV={tmp_path} source {REPO}/setup-utils/install.sh"
                           " && horovod_summary"], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("nccl, operations", [(" ", "MPI, Gloo"), ("X", "NCCL, MPI, Gloo")])
def test_the_closing_line_names_each_part_of_the_build_once(tmp_path, nccl, operations):
    result = summary(tmp_path, CHECK_BUILD.format(nccl=nccl))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("Horovod v0.28.1 for MXNet; controllers: MPI, Gloo; "
                                     f"tensor operations: {operations}")


def test_a_check_build_without_the_marks_is_a_failure(tmp_path):
    assert summary(tmp_path, "error: no horovod\n").returncode != 0
