"""What rank 0 tells the user while training: metrics.jsonl records (metrics.py),
the same records as training.log lines in the reference's format, a tqdm bar on a
terminal, and TensorBoard event files (tensorboardX)."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

from tensorboardX import SummaryWriter
from tqdm import tqdm

from ..data.loader import WaitTimer
from ..evaluation.verification import VerificationResult
from .metrics import (
    HUMAN_LINES,
    LINE_FORMAT,
    METRICS,
    human_line,
    last_logged_step,
    open_metrics,
)


class TrainingLog:
    def __init__(self, work_dir: Path, enabled: bool, total_steps: int, global_batch: int,
                 frequent: int, first_step: int = 0, job: str | None = None) -> None:
        """`job`: the restart supervisor's id of the job this launch belongs to (None:
        launched by hand), kept in the start record: metrics.py tells runs apart by it."""
        self.enabled, self.total_steps = enabled, total_steps
        self.global_batch, self.frequent = global_batch, frequent
        self.logger = logging.getLogger("partial_fc_mx.train")
        self.logger.propagate = False
        self.logger.setLevel(logging.INFO)
        self._losses: list[float] = []
        self._filtered: list[float] = []
        self._tic, self._tic_step = time.time(), first_step
        self.data_wait = WaitTimer()  # the trainer times its loader with it: DataWait
        self.bar = self.writer = self.metrics = None
        self.handlers: list[logging.Handler] = []
        if not enabled:
            return
        logged_to = last_logged_step(work_dir) if first_step else 0
        self.metrics = open_metrics(work_dir / METRICS)
        formatter = logging.Formatter(LINE_FORMAT)
        self.handlers = [logging.FileHandler(work_dir / "training.log"),
                         logging.StreamHandler(sys.stdout)]
        for handler in self.handlers:
            handler.setFormatter(formatter)
            self.logger.addHandler(handler)
        self.writer = SummaryWriter(str(work_dir / "tensorboard"))
        if sys.stderr.isatty():
            self.bar = tqdm(total=total_steps, initial=first_step, unit="step")
        self.record({"kind": "start", "step": first_step, "job": job}, {})
        if logged_to > first_step:
            self.info(f"resumed at step {first_step}: the lines above for steps "
                      f"{first_step + 1}..{logged_to} are the stopped run's; those steps are "
                      "trained again from here (plot and metrics.jsonl readers keep these)")

    def info(self, message: str) -> None:
        if self.enabled:
            self.logger.info(message)

    def step(self, step: int, epoch: int, loss: float, lr: float, loss_scale: float | None,
             images: int, filtered: float | None = None) -> None:
        """Called after every step (`step` = steps done); writes every `frequent` steps.
        `loss_scale`: None when the run scales no loss (float32), so none is written;
        `filtered`: the share of negatives the inter-class filter took (None: off),
        written as filtered_percent, the mean over the steps of the line."""
        self._losses.append(loss)
        if filtered is not None:
            self._filtered.append(filtered)
        if self.bar is not None:
            self.bar.update(1)
        if step % self.frequent and step != self.total_steps:
            return
        elapsed = time.time() - self._tic
        done = step - self._tic_step
        speed = done * self.global_batch / max(elapsed, 1e-9)
        required = (self.total_steps - step) * elapsed / max(done, 1) / 3600
        values = {"loss": sum(self._losses) / len(self._losses), "learning_rate": lr,
                  "speed": speed,
                  "data_wait_percent": 100 * self.data_wait.seconds / max(elapsed, 1e-9)}
        if loss_scale is not None:
            values["loss_scale"] = loss_scale
        if self._filtered:
            values["filtered_percent"] = 100 * sum(self._filtered) / len(self._filtered)
        self.record({"kind": "step", "step": step, "epoch": epoch, "images": images,
                     "required_hours": required, **values}, values)
        self._losses, self._filtered, self._tic, self._tic_step = [], [], time.time(), step
        self.data_wait.seconds = 0.0

    def evaluation(self, name: str, step: int, result: VerificationResult) -> None:
        """The accuracy on a verification set, with TAR at the FARs the pairs resolve."""
        scalars = {f"verification/{name}": result.accuracy}
        # tensorboardX keeps [-/\w.] in a tag: "tar_at_far_0.001", not "tar@far=0.001"
        scalars.update({f"verification/{name}/tar_at_far_{far:g}": tar
                        for far, tar in result.tar_at_far.items()})
        self.record({"kind": "evaluation", "name": name, "step": step,
                     "accuracy": result.accuracy, "std": result.std,
                     "tar_at_far": {f"{far:g}": tar for far, tar in result.tar_at_far.items()}},
                    scalars)

    def baseline(self, name: str, accuracy: float, before_training: float | None,
                 eigenfaces: float) -> None:
        """The model's last accuracy on a set beside its accuracy before training (None:
        not evaluated at step 0) and the eigenfaces (PCA) baseline's."""
        self.record({"kind": "baseline", "name": name, "accuracy": accuracy,
                     "before_training": before_training, "eigenfaces": eigenfaces}, {})

    def stopped(self, step: int, work_dir: Path) -> None:
        """A stop on purpose, saved at `step`: a record plot marks, and the line the
        restart supervisor reads (restarts.sh)."""
        self.record({"kind": "stop", "step": step, "work_dir": str(work_dir)}, {})

    def record(self, record: dict, scalars: dict) -> None:
        """One record: a metrics.jsonl line, its training.log line and TensorBoard scalars.
        A failed write (a full disk) is a warning, not the end of rank 0 alone: the
        other ranks would wait for it in the next collective."""
        if not self.enabled:
            return
        if self.metrics is not None:
            try:
                self.metrics.write(json.dumps({**record, "time": round(time.time(), 3)}) + "\n")
                self.metrics.flush()
            except (OSError, TypeError, ValueError) as error:
                self.metrics = None
                self.info(f"WARNING: stopped writing {METRICS}: {error!r}")
        if record["kind"] in HUMAN_LINES:
            self.info(human_line(record))
        if scalars:
            self.scalars(record["step"], scalars)

    def scalars(self, step: int, values: dict) -> None:
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)
            self.writer.flush()

    def close(self) -> None:
        """Also detaches its handlers: a later log in the same process (a second run,
        a test) must not write into this one's file."""
        for handler in self.handlers:
            self.logger.removeHandler(handler)
            handler.close()
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()
        if self.metrics is not None:
            self.metrics.close()

