"""What rank 0 tells the user while training: training.log lines in the reference's
format, a tqdm bar on a terminal, and TensorBoard event files (tensorboardX)."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from tensorboardX import SummaryWriter
from tqdm import tqdm

from .data.loader import WaitTimer
from .evaluation.verification import VerificationResult


class TrainingLog:
    def __init__(self, work_dir: Path, enabled: bool, total_steps: int, global_batch: int,
                 frequent: int, first_step: int = 0) -> None:
        self.enabled, self.total_steps = enabled, total_steps
        self.global_batch, self.frequent = global_batch, frequent
        self.logger = logging.getLogger("partial_fc_mx.train")
        self.logger.propagate = False
        self.logger.setLevel(logging.INFO)
        self._losses: list[float] = []
        self._tic, self._tic_step = time.time(), first_step
        self.data_wait = WaitTimer()  # the trainer times its loader with it: DataWait
        self.bar = self.writer = None
        self.handlers: list[logging.Handler] = []
        if not enabled:
            return
        formatter = logging.Formatter("%(asctime)s %(message)s")
        self.handlers = [logging.FileHandler(work_dir / "training.log"),
                         logging.StreamHandler(sys.stdout)]
        for handler in self.handlers:
            handler.setFormatter(formatter)
            self.logger.addHandler(handler)
        self.writer = SummaryWriter(str(work_dir / "tensorboard"))
        if sys.stderr.isatty():
            self.bar = tqdm(total=total_steps, initial=first_step, unit="step")

    def info(self, message: str) -> None:
        if self.enabled:
            self.logger.info(message)

    def step(self, step: int, epoch: int, loss: float, lr: float, loss_scale: float,
             images: int) -> None:
        """Called after every step (`step` = steps done); writes every `frequent` steps."""
        self._losses.append(loss)
        if self.bar is not None:
            self.bar.update(1)
        if step % self.frequent and step != self.total_steps:
            return
        elapsed = time.time() - self._tic
        done = step - self._tic_step
        speed = done * self.global_batch / max(elapsed, 1e-9)
        required = (self.total_steps - step) * elapsed / max(done, 1) / 3600
        mean_loss = sum(self._losses) / len(self._losses)
        data_wait = 100 * self.data_wait.seconds / max(elapsed, 1e-9)
        self.info(f"Speed {speed:.2f} samples/sec   Loss {mean_loss:.4f}   "
                  f"LearningRate {lr:.6f}   Epoch: {epoch}   Global Step: {step}   "
                  f"Required: {required:.1f} hours   DataWait: {data_wait:.1f}%   "
                  f"Images: {images}")
        self.scalars(step, {"loss": mean_loss, "learning_rate": lr, "speed": speed,
                            "loss_scale": loss_scale, "data_wait_percent": data_wait})
        self._losses, self._tic, self._tic_step = [], time.time(), step
        self.data_wait.seconds = 0.0

    def evaluation(self, name: str, step: int, result: VerificationResult) -> None:
        """The reference's accuracy line, with TAR at the FARs the pairs resolve."""
        tars = "".join(f"   TAR@FAR={far:g}: {tar:.5f}" for far, tar in result.tar_at_far.items())
        self.info(f"[{name}][{step}]Accuracy-Flip: {result.accuracy:.5f}+-{result.std:.5f}{tars}")
        scalars = {f"verification/{name}": result.accuracy}
        # tensorboardX keeps [-/\w.] in a tag: "tar_at_far_0.001", not "tar@far=0.001"
        scalars.update({f"verification/{name}/tar_at_far_{far:g}": tar
                        for far, tar in result.tar_at_far.items()})
        self.scalars(step, scalars)

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
