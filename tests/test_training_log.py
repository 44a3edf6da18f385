"""What the trainer writes to training.log."""

from __future__ import annotations

import re
import time

import pytest

from partial_fc_mx.plot import read_log
from partial_fc_mx.training_log import TrainingLog


def slow_batches(count: int, seconds: float):
    for index in range(count):
        time.sleep(seconds)
        yield index


@pytest.mark.parametrize("data_seconds, step_seconds, low, high", [
    (0.1, 0.1, 35, 65),  # the loader takes half of every step
    (0.0, 0.1, 0, 5)])   # batches are ready at once
def test_the_log_says_how_much_of_a_step_waits_for_data(tmp_path, data_seconds, step_seconds,
                                                         low, high):
    log = TrainingLog(tmp_path, enabled=True, total_steps=6, global_batch=8, frequent=3)
    for step, _ in enumerate(log.data_wait.timed(slow_batches(6, data_seconds)), start=1):
        time.sleep(step_seconds)
        log.step(step, epoch=0, loss=1.0, lr=0.1, loss_scale=1.0, images=8 * step)
    log.close()
    text = (tmp_path / "training.log").read_text()
    waits = [float(x) for x in re.findall(r"DataWait: ([\d.]+)%", text)]
    assert len(waits) == 2 and all(low <= wait <= high for wait in waits), text
    assert read_log(tmp_path / "training.log")["step"] == [3, 6]  # plot still reads it
