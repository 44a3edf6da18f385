"""Helpers shared by the tests: launching real processes, and small datasets on disk."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(cmd: list[str], timeout: float = 300, env: dict | None = None,
        cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run a command to completion; stdout and stderr together in `.stdout`."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(cmd, cwd=cwd, env=full_env, timeout=timeout, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def mpirun_command(np: int, args: list[str]) -> list[str]:
    return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(np),
            "-x", "PATH", "-x", "PYTHONUNBUFFERED", *args]


def mpirun(np: int, args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return run(mpirun_command(np, args), **kwargs)


def horovodrun_gloo_command(np: int, args: list[str]) -> list[str]:
    return [str(BIN / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}", "--gloo", *args]


def horovodrun_gloo(np: int, args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return run(horovodrun_gloo_command(np, args), **kwargs)


def python_module(*args: str) -> list[str]:
    return [sys.executable, "-m", "partial_fc_mx", *args]


@pytest.fixture(autouse=True)
def venv_on_path(monkeypatch):
    """Launchers and child processes find the venv's python, mpirun and horovodrun."""
    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ['PATH']}")
