"""backbone.onnx written beside training, never in its way.

MXNet's ONNX exporter takes about 20 s for r50 on 2 CPU cores, longer for r100. Run
inside a save on rank 0, it made every other rank wait in the next collective: on 64
GPUs each save idled all of them. So rank 0 hands it to a separate, niced process, a
new Python interpreter (started by fork + exec, never a fork of an MPI rank that goes
on running), which reads the backbone-symbol.json and backbone-0000.params the save
has just written and replaces backbone.onnx atomically (export.export_onnx).

One export runs at a time. A save while one runs makes another due, which starts when
the running one ends and exports the newest backbone then: saves in between are
superseded, never queued. The run's last save is exported by rank 0 itself, at once:
no step follows that an export could delay, and a process would only add its
start-up (about 3 s); an export still running then is superseded and ended. A failed
export is a warning in training.log; the checkpoint it comes from is safe. A run that
stops on a signal or an error ends its export process (the previous backbone.onnx
stays whole), and an export process whose rank dies is ended with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

DONE = "EXPORTED "
"""The export process's last line on success, before the step it exported."""
NICENESS = 19
SAFE = "the checkpoint is safe (`python -m partial_fc_mx export WORK_DIR` retries)"


class BackgroundExport:
    """Rank 0's export process (`enabled`); a no-op on the other ranks."""

    def __init__(self, work_dir: Path, enabled: bool, log: Callable[[str], None]) -> None:
        self.work_dir, self.enabled, self.log = Path(work_dir), enabled, log
        self.process: subprocess.Popen | None = None
        self.due = False
        self.newest = -1
        """The step of the newest save asked for."""
        self._started = 0.0

    def request(self, step: int, last: bool = False) -> None:
        """After the save of `step`: export it in the background now, or when the
        running export ends; the run's `last` save here and now."""
        if not self.enabled:
            return
        self.newest = step
        if last:
            self.due = False
            self._end_running()
            self._export_here(step)
        elif self.process is None:
            self._start()
        else:
            self.due = True

    def poll(self) -> None:
        """After each step: say how a finished export went; start a due one unless the
        finished one already read the newest save (it reads what is newest when it
        starts, which may be later than the save that started it)."""
        if self.process is not None and self.process.poll() is not None:
            exported = self._report()
            if self.due and exported != self.newest:
                self._start()
            self.due = False

    def wait(self) -> None:
        """At the end of training: the running export and a due one, to the end."""
        while self.process is not None:
            self.process.wait()
            self.poll()

    def close(self) -> None:
        """End a running export (a stop on a signal, an error) and reap it."""
        self.due = False
        if self._end_running():
            self.log(f"stopped the export of backbone.onnx in the background after "
                     f"{time.time() - self._started:.1f} s; {self.work_dir / 'backbone.onnx'} "
                     "is the previous one, if any (`export` writes it)")

    def _end_running(self) -> bool:
        """Whether an export was running; ended and reaped."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return False
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        return True

    def _export_here(self, step: int) -> None:
        from .export import export_onnx

        started = time.time()
        try:
            export_onnx(self.work_dir)
        except Exception as error:  # the checkpoint is safe: say so, go on
            self.log(f"WARNING: could not export backbone.onnx: {error!r}; {SAFE}")
            return
        self.log(f"wrote {self.work_dir / 'backbone.onnx'} (step {step}) in "
                 f"{time.time() - started:.1f} s")

    def __enter__(self) -> BackgroundExport:
        return self

    def __exit__(self, *_) -> None:
        self.close()

    def _start(self) -> None:
        output = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(self.work_dir), str(os.getpid())],
            stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1"})
        self.process.output = output
        self._started = time.time()

    def _report(self) -> int | None:
        """Log how the export ended; the step it exported, None if it failed."""
        process, seconds = self.process, time.time() - self._started
        self.process = None
        process.output.seek(0)
        lines = process.output.read().strip().splitlines()
        process.output.close()
        done = [line[len(DONE):] for line in lines if line.startswith(DONE)]
        if process.returncode == 0 and done:
            self.log(f"wrote {self.work_dir / 'backbone.onnx'} (step {done[-1]}) in the "
                     f"background in {seconds:.1f} s")
            return int(done[-1]) if done[-1].isdigit() else None
        said = lines[-1] if lines else f"exit code {process.returncode}"
        self.log(f"WARNING: could not export backbone.onnx in the background: {said}; {SAFE}")
        return None


def die_with(parent: int) -> None:
    """Linux: end this process when the rank that started it dies (a kill -9 of the
    rank must not leave its export running)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before prctl took effect
        sys.exit(1)


def saved_step(work_dir: Path) -> str:
    """The step of the backbone a work dir holds, from the record beside it."""
    try:
        return str(json.loads((work_dir / "backbone.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return "?"


def export_here(work_dir: Path, parent: int) -> None:
    die_with(parent)
    os.nice(NICENESS)
    from .export import export_onnx

    step = saved_step(work_dir)
    export_onnx(work_dir)
    print(f"{DONE}{step}", flush=True)


if __name__ == "__main__":
    export_here(Path(sys.argv[1]), int(sys.argv[2]))
