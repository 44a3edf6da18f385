"""Helpers shared by the tests: launching real processes, and small datasets on disk."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def start(cmd: list[str], env: dict | None = None, cwd: Path = REPO) -> subprocess.Popen:
    """Start a command in its own session (process group): a launcher killed alone
    would leave its ranks running, spinning in Horovod's loop. Its output goes to a
    file, not a pipe, so a process it leaves behind (a remote MPI daemon that lost its
    link) cannot keep the test waiting for the end of the output."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    output = tempfile.TemporaryFile("w+")
    process = subprocess.Popen(cmd, cwd=cwd, env=full_env, text=True, start_new_session=True,
                               stdout=output, stderr=subprocess.STDOUT)
    process.output = output
    return process


def output_of(process: subprocess.Popen) -> str:
    process.output.seek(0)
    return process.output.read()


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the process and everything it started in its session."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def finish(process: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Wait for a started command; past `timeout` kill its whole group and fail."""
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(process)
        process.wait()
        raise AssertionError(f"{' '.join(map(str, process.args))[:300]} did not finish "
                             f"within {timeout} s; output:\n{output_of(process)[-3000:]}"
                             ) from None
    finally:
        kill_group(process)  # nothing it started may outlive it
    return subprocess.CompletedProcess(process.args, process.returncode, output_of(process))


def rank_pids(pattern: str) -> list[int]:
    """The training processes whose command line matches (not the launcher's)."""
    found = subprocess.run(["pgrep", "-f", pattern], text=True, stdout=subprocess.PIPE)
    pids = [int(p) for p in found.stdout.split()]
    return [p for p in pids if Path(f"/proc/{p}/comm").read_text().startswith("python")]


def run(cmd: list[str], timeout: float = 300, env: dict | None = None,
        cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run a command to completion; stdout and stderr together in `.stdout`."""
    return finish(start(cmd, env, cwd), timeout)


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


@pytest.fixture(scope="session")
def fake_driver(tmp_path_factory) -> Path:
    """A directory holding the stand-in libcuda.so.1, for LD_LIBRARY_PATH."""
    directory = tmp_path_factory.mktemp("driver")
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wall", "-o", str(directory / "libcuda.so.1"),
                    str(REPO / "tests" / "fake_libcuda.c")], check=True)
    return directory


# ----- training runs on a small synthetic dataset -----
CLASSES = 120


@pytest.fixture(scope="session")
def synthetic(tmp_path_factory) -> Path:
    """120 synthetic identities x 6 images (720: a whole number of global batches of
    24 x 1, 2 or 3 processes), and 400 held-out verification pairs."""
    from partial_fc_mx.data.synthetic import prepare_synthetic

    directory = tmp_path_factory.mktemp("data") / "syn"
    prepare_synthetic(str(directory), CLASSES, per_class=6, heldout=40, pairs=200, seed=1)
    return directory


def config_file(tmp_path: Path, data: Path | str, name: str = "config.py", **keys) -> Path:
    values = {"rec": str(data), "num_classes": CLASSES, "network": "tiny",
              "embedding_size": 64, "batch_size": 24, "lr": 0.1, "num_epoch": 4,
              "margin_list": (1.0, 0.0, 0.35), "scale": 32.0, "frequent": 1, "verbose": 1000,
              "num_workers": 1, "stall_timeout": 120, **keys}
    path = tmp_path / name
    path.write_text("".join(f"{k} = {v!r}\n" for k, v in values.items()))
    return path


def train_args(config: Path, work_dir: Path, *extra: str) -> list[str]:
    return python_module("train", str(config), "--work-dir", str(work_dir), *extra)


def logged(work_dir: Path) -> dict:
    """From metrics.jsonl: {step: loss}, [(step, accuracy)] in the order written, every
    step record (loss, learning_rate, epoch, step, images seen after it, ...); and the
    text of training.log."""
    records = [json.loads(line) for line in (work_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    accuracy = [(r["step"], r["accuracy"]) for r in records if r["kind"] == "evaluation"]
    return {"losses": {r["step"]: r["loss"] for r in steps}, "steps": steps,
            "accuracy": accuracy, "text": (work_dir / "training.log").read_text()}
