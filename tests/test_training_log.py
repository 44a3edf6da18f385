"""What the trainer writes to training.log."""

from __future__ import annotations

import re
import time

import pytest

from partial_fc_mx.evaluation.verification import VerificationResult
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


def write_run(work_dir, losses: list[float], accuracies: dict[int, float]) -> None:
    work_dir.mkdir(parents=True)
    log = TrainingLog(work_dir, enabled=True, total_steps=len(losses), global_batch=8,
                      frequent=1)
    for step, loss in enumerate(losses, start=1):
        log.step(step, epoch=0, loss=loss, lr=0.1, loss_scale=1.0, images=8 * step)
        if step in accuracies:
            log.evaluation("heldout", step, VerificationResult(accuracies[step], 0.01, 0.5))
    log.close()


def test_plot_compares_several_runs_on_the_same_figures(tmp_path, monkeypatch):
    import matplotlib.figure

    from partial_fc_mx.plot import plot_work_dirs

    write_run(tmp_path / "plain" / "split0", [3.0, 2.0, 1.5, 1.0], {2: 0.80, 4: 0.85})
    write_run(tmp_path / "augmented" / "split0", [3.0, 2.5, 2.0, 1.8], {2: 0.82, 4: 0.90})
    curves = {}
    real_savefig = matplotlib.figure.Figure.savefig

    def savefig(figure, path, **kwargs):
        curves[path.name] = {line.get_label(): list(line.get_ydata())
                             for line in figure.axes[0].get_lines()}
        curves[path.name]["title"] = figure.axes[0].get_title()
        return real_savefig(figure, path, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    written = plot_work_dirs([str(tmp_path / "plain" / "split0"),
                              str(tmp_path / "augmented" / "split0")], str(tmp_path / "out"))
    assert sorted(p.name for p in written) == ["learning_rate.png", "loss.png", "speed.png",
                                               "verification.png"]
    assert all(p.parent == tmp_path / "out" and p.stat().st_size > 5000 for p in written)
    assert curves["loss.png"] == {"plain/split0": [3.0, 2.0, 1.5, 1.0],
                                  "augmented/split0": [3.0, 2.5, 2.0, 1.8],
                                  "title": "loss (plain/split0, augmented/split0)"}
    assert curves["verification.png"] == {
        "plain/split0 heldout": [0.80, 0.85], "augmented/split0 heldout": [0.82, 0.90],
        "title": "verification accuracy (plain/split0, augmented/split0)"}
    alone = plot_work_dirs([str(tmp_path / "plain" / "split0")])
    assert {p.parent for p in alone} == {tmp_path / "plain" / "split0" / "plots"}
    assert curves["loss.png"]["title"] == f"loss ({tmp_path / 'plain' / 'split0'})"
