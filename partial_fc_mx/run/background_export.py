"""backbone.onnx written beside training, never in its way.

MXNet's ONNX exporter takes seconds to tens of seconds for r50 and r100 on a CPU.
Run inside a save on rank 0, it made every other rank wait in the next collective:
on 64 GPUs each save idled all of them. So rank 0 hands it to a side process
(side_process.py: niced, ended with its rank), which reads the backbone-symbol.json
and backbone-0000.params the save has just written and replaces backbone.onnx
atomically (export.export_onnx).

One export runs at a time. A save while one runs makes another due, which starts when
the running one ends and exports the newest backbone then: saves in between are
superseded, never queued. The run's last save is exported by rank 0 itself, at once:
no step follows that an export could delay, and a process would only add its
start-up (about 3 s); an export still running then is superseded and ended. Any
failure, of the export or of starting its process, is a warning in training.log: the
checkpoint it comes from is safe, and rank 0 alone must never stop over it (the
other ranks would wait for it in the next collective). A run that stops on a signal
or an error ends its export process; the previous backbone.onnx stays whole.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

DONE = "EXPORTED "
"""The export process's last line on success, before the step it exported."""
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
            self._export_now(step)
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
        """Until the running export and a due one have ended (benchmarks, tests)."""
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

    def __enter__(self) -> BackgroundExport:
        return self

    def __exit__(self, *_) -> None:
        self.close()

    def _end_running(self) -> bool:
        """Whether an export was still running (now ended and reaped); one that had
        finished is reported as poll() would."""
        if self.process is None:
            return False
        if self.process.poll() is not None:
            self._report()
            return False
        process, self.process = self.process, None
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.output.close()
        return True

    def _start(self) -> None:
        try:
            output = tempfile.TemporaryFile("w+")
            self.process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(self.work_dir), str(os.getpid())],
                stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1"},
                start_new_session=True)  # side_process.py
        except OSError as error:  # no temporary file, no process (a limit, no memory)
            self.log(f"WARNING: could not start the export of backbone.onnx: {error}; {SAFE}")
            return
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

    def _export_now(self, step: int) -> None:
        from .export import export_onnx

        started = time.time()
        try:
            export_onnx(self.work_dir)
        except Exception as error:  # the checkpoint is safe: say so, go on
            self.log(f"WARNING: could not export backbone.onnx: {error!r}; {SAFE}")
            return
        self.log(f"wrote {self.work_dir / 'backbone.onnx'} (step {step}) in "
                 f"{time.time() - started:.1f} s")


def saved_step(work_dir: Path) -> str:
    """The step of the backbone a work dir holds, from the record beside it."""
    try:
        return str(json.loads((work_dir / "backbone.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return "?"


def export_process(work_dir: Path, parent: int) -> None:
    """The export process itself: the newest backbone to backbone.onnx."""
    from ..side_process import become_side_process

    become_side_process(parent)
    from .export import export_onnx

    step = saved_step(work_dir)
    export_onnx(work_dir)
    print(f"{DONE}{step}", flush=True)


if __name__ == "__main__":
    export_process(Path(sys.argv[1]), int(sys.argv[2]))
