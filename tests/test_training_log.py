"""What the trainer writes to metrics.jsonl and training.log, and plot reads."""

from __future__ import annotations

import json
import re
import time

import pytest

from partial_fc_mx.evaluation.verification import VerificationResult
from partial_fc_mx.run.metrics import human_line, read_metrics
from partial_fc_mx.run.training_log import TrainingLog


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
    assert read_metrics(tmp_path)["step"] == [3, 6]  # plot reads the same steps


def test_every_training_log_line_of_a_record_is_made_from_its_metrics_record(tmp_path):
    log = TrainingLog(tmp_path, enabled=True, total_steps=4, global_batch=8, frequent=2)
    log.evaluation("heldout", 0, VerificationResult(0.5, 0.1, 0.5, {1e-3: 0.25}))
    for step in range(1, 5):  # a float32 run scales no loss: it writes no loss scale
        log.step(step, epoch=0, loss=1.0 / step, lr=0.1 * step,
                 loss_scale=2.0 if step < 3 else None, images=8 * step)
    log.baseline("heldout", 0.9, 0.5, 0.8)
    log.stopped(4, tmp_path)
    log.info("a note, in training.log only")
    log.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    start = records.pop(0)
    assert start == {"kind": "start", "step": 0, "job": None, "time": start["time"]}
    assert abs(start["time"] - time.time()) < 60
    assert [r["kind"] for r in records] == ["evaluation", "step", "step", "baseline", "stop"]
    assert records[1]["loss"] == 0.75 and records[2]["learning_rate"] == 0.4  # full precision
    assert records[1]["loss_scale"] == 2.0 and "loss_scale" not in records[2]
    lines = [line.split(" ", 2)[2] for line in (tmp_path / "training.log").read_text().splitlines()]
    assert lines == [*map(human_line, records), "a note, in training.log only"]
    assert lines[0] == "[heldout][0]Accuracy-Flip: 0.50000+-0.10000   TAR@FAR=0.001: 0.25000"
    assert lines[3] == ("[heldout] model accuracy 0.9000 (0.5000 at step 0, before training) vs "
                        "eigenfaces (PCA) baseline 0.8000 on the same pairs")
    assert lines[4] == f"stopped by a signal at step 4; resume with --resume-from {tmp_path}"
    assert re.fullmatch(r"Speed [\d.]+ samples/sec   Loss 0\.2917   LearningRate 0\.400000   "
                        r"Epoch: 0   Global Step: 4   Required: 0\.0 hours   DataWait: [\d.]+%   "
                        r"Images: 32", lines[2])


def log_steps(work_dir, first: int, losses: list[float]) -> None:
    """A run that starts after step `first` - 1 and logs (and evaluates) every step."""
    log = TrainingLog(work_dir, enabled=True, total_steps=first + len(losses), global_batch=8,
                      frequent=1, first_step=first - 1)
    for step, loss in enumerate(losses, start=first):
        log.step(step, epoch=0, loss=loss, lr=0.1, loss_scale=1.0, images=8 * step)
        log.evaluation("heldout", step, VerificationResult(loss / 10, 0.0, 0.5))
    log.close()


def test_the_metrics_are_the_latest_runs_with_the_steps_it_resumed_from(tmp_path):
    """A resume in the same work dir repeats the steps after its checkpoint; one from an
    older checkpoint abandons the later steps; a new run replaces everything."""
    log_steps(tmp_path, 1, [4.0, 3.0, 2.0, 1.0])
    log_steps(tmp_path, 2, [2.5])  # resumed from step 1, stopped after step 2
    series = read_metrics(tmp_path)
    assert series["step"] == [1, 2] and series["loss"] == [4.0, 2.5]
    assert [e.accuracy for e in series["verification"]["heldout"]] == [0.4, 0.25]
    log_steps(tmp_path, 3, [1.5])
    assert read_metrics(tmp_path)["loss"] == [4.0, 2.5, 1.5]
    log_steps(tmp_path, 1, [9.0])  # a new run from step 0
    assert read_metrics(tmp_path)["loss"] == [9.0]


def test_a_line_a_killed_run_left_unfinished_is_skipped_and_not_glued_to(tmp_path):
    log_steps(tmp_path, 1, [4.0, 3.0])
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_bytes(metrics.read_bytes()[:-20])  # killed in the middle of a line
    log_steps(tmp_path, 2, [2.5])
    series = read_metrics(tmp_path)
    assert series["loss"] == [4.0, 2.5] and series["unreadable_lines"] == 1


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

    from partial_fc_mx.tools.plot import plot_work_dirs

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


def test_plot_marks_each_restart_where_the_job_had_failed_and_each_stop(tmp_path, monkeypatch):
    import matplotlib.figure

    from partial_fc_mx.run.metrics import append_record
    from partial_fc_mx.tools.plot import plot_work_dirs

    work = tmp_path / "run"
    write_run(work, [3.0, 2.0, 1.5, 1.0], {})
    append_record(work, {"kind": "restart", "attempt": 1, "step": 3, "failure": "signal",
                         "who": "rank 1", "reason": "rank 1 on b was ended by signal 9",
                         "hosts": ["a", "b"], "processes": 2, "dropped": [], "checkpoint": 2})
    marks = {}
    real_savefig = matplotlib.figure.Figure.savefig

    def savefig(figure, path, **kwargs):
        marks[path.name] = [(line.get_label(), list(line.get_xdata()))
                            for line in figure.axes[0].get_lines()
                            if line.get_label() in ("restart", "stopped")]
        return real_savefig(figure, path, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    append_record(work, {"kind": "stop", "step": 4, "work_dir": str(work)})
    plot_work_dirs([str(work)])
    assert marks == {name: [("restart", [3, 3]), ("stopped", [4, 4])]
                     for name in ("loss.png", "learning_rate.png", "speed.png")}
    assert "restart 1: rank 1 on b was ended by signal 9 after step 3; relaunching 2 " \
        "processes on a, b, from checkpoint step 2" in (work / "training.log").read_text()


def restart_record(work_dir, step: int, job: str) -> None:
    from partial_fc_mx.run.metrics import append_record

    append_record(work_dir, {"kind": "restart", "attempt": 1, "step": step, "failure": "signal",
                             "who": "rank 1", "reason": "rank 1 on b was ended by signal 9",
                             "hosts": ["a"], "processes": 1, "dropped": [],
                             "checkpoint": None, "job": job})


def test_a_new_run_in_the_work_dir_leaves_the_earlier_runs_restarts_and_stops_behind(tmp_path):
    """A job relaunched before its first checkpoint starts at step 0 again and keeps its
    restart; a new job (or a run by hand) in the same work dir starts afresh."""
    first = TrainingLog(tmp_path, enabled=True, total_steps=9, global_batch=8, frequent=1,
                        job="job-1")
    first.step(1, epoch=0, loss=3.0, lr=0.1, loss_scale=None, images=8)
    first.close()
    restart_record(tmp_path, 1, "job-1")
    again = TrainingLog(tmp_path, enabled=True, total_steps=9, global_batch=8, frequent=1,
                        job="job-1")
    again.step(1, epoch=0, loss=2.0, lr=0.1, loss_scale=None, images=8)
    again.stopped(1, tmp_path)
    again.close()
    series = read_metrics(tmp_path)
    assert [r["step"] for r in series["restarts"]] == [1] and series["loss"] == [2.0]
    assert [r["step"] for r in series["stops"]] == [1]
    resumed = TrainingLog(tmp_path, enabled=True, total_steps=9, global_batch=8, frequent=1,
                          first_step=1, job="job-2")
    resumed.close()
    assert len(read_metrics(tmp_path)["restarts"]) == len(read_metrics(tmp_path)["stops"]) == 1
    for job in ("job-2", None):  # another job, or a run launched by hand
        TrainingLog(tmp_path, enabled=True, total_steps=9, global_batch=8, frequent=1,
                    job=job).close()
        series = read_metrics(tmp_path)
        assert series["restarts"] == [] and series["stops"] == [] and series["step"] == []
