"""The split study's bookkeeping: finished runs are reused, changed arms are trained
again, and the tables report the mean and spread over splits and each run's figures
as its training.log has them (the training itself is what `bash run.sh` does, tested
elsewhere)."""

from __future__ import annotations

import dataclasses
import json
from unittest import mock

import pytest

from partial_fc_mx import quality
from partial_fc_mx.evaluation.verification import VerificationResult
from partial_fc_mx.quality import read_result, run_arm, runs_table, table
from partial_fc_mx.run.training_log import TrainingLog


def write_log(work_dir, accuracy: float, seconds_per_step: float, baseline: bool = True,
              sets: tuple = ("heldout",)) -> None:
    """A run's metrics as the trainer writes them: 4 steps of a global batch of 8,
    logged every 2, the held-out set at step 0 and at the end, the eigenfaces baseline.
    Each step takes `seconds_per_step` of a clock that moves only then."""
    clock = [1000.0]
    with mock.patch("partial_fc_mx.run.training_log.time.time", lambda: clock[0]):
        log = TrainingLog(work_dir, enabled=True, total_steps=4, global_batch=8, frequent=2)
        for name in sets:
            log.evaluation(name, 0, VerificationResult(0.85, 0.03, 0.5))
        for step in range(1, 5):
            clock[0] += seconds_per_step
            log.step(step, epoch=0, loss=2.0 / step, lr=0.1, loss_scale=1.0, images=8 * step)
    for name in sets:
        log.evaluation(name, 4, VerificationResult(accuracy, 0.02, 0.5, {1e-3: 0.7}))
    if baseline:
        log.baseline("heldout", accuracy, 0.85, 0.84)
    log.close()


def test_runs_are_reused_retrained_when_changed_and_tabled(tmp_path, monkeypatch):
    trained = []

    def fake_train(config, data, overrides, work_dir, processes):
        trained.append((work_dir.name, tuple(overrides)))
        work_dir.mkdir(parents=True)
        write_log(work_dir, 0.90 + 0.01 * int(work_dir.name.removeprefix("split")), 10.0)
        return 3.0

    monkeypatch.setattr(quality, "train_once", fake_train)
    monkeypatch.setattr(quality, "split_data", lambda work, seed, synthetic: work / "data")
    config = tmp_path / "cfg.py"
    config.write_text("lr = 0.1\n")
    first = run_arm(str(config), tmp_path, "aug", ["augment_rotate=10"], [0, 1, 2], 2)
    assert [r.trained for r in first] == [0.90, 0.91, 0.92] and len(trained) == 3
    again = run_arm(str(config), tmp_path, "aug", ["augment_rotate=10"], [0, 1, 2, 3], 2)
    assert len(trained) == 4 and trained[-1][0] == "split3"  # only the new split ran
    assert [r.trained for r in again] == [0.90, 0.91, 0.92, 0.93]
    run_arm(str(config), tmp_path, "aug", ["augment_rotate=20"], [0], 2)  # the arm changed
    assert trained[-1] == ("split0", ("augment_rotate=20",))
    run_arm(str(config), tmp_path, "aug", ["augment_rotate=10"], [1], 3)  # other processes
    assert trained[-1] == ("split1", ("augment_rotate=10",)) and len(trained) == 6
    config.write_text("lr = 0.2\n")  # the config file was edited since
    run_arm(str(config), tmp_path, "aug", ["augment_rotate=10"], [2, 3], 2)
    assert trained[-2:] == [("split2", ("augment_rotate=10",)), ("split3", ("augment_rotate=10",))]
    @dataclasses.dataclass
    class Changed(quality.Config):  # a default of the toolkit changed since
        center_update: str = "lazy"

    monkeypatch.setattr(quality, "Config", Changed)
    run_arm(str(config), tmp_path, "aug", ["augment_rotate=10"], [3], 2)
    assert len(trained) == 9 and trained[-1][0] == "split3"
    rows = table({"aug": again}).splitlines()
    assert rows[2] == ("| aug | `augment_rotate=10` | **0.9150 ± 0.0129** | 0.900 0.910 0.920 "
                       "0.930 | 0.8500 ± 0.0000 | 0.8400 ± 0.0000 | 3.0 |")
    detail = runs_table({"aug": again}, [0, 1, 2, 3]).splitlines()
    assert detail[0].count("|") == detail[1].count("|") == 9 and "TAR@FAR=0.001" in detail[0]
    assert detail[3] == ("| aug | `augment_rotate=10` | 1 | 0.9100 ± 0.0200 | 0.7000 | 0.583 "
                         "| 10000 | 3.0 |")


def test_each_run_is_read_from_its_training_log(tmp_path):
    work_dir = tmp_path / "arm" / "split0"
    work_dir.mkdir(parents=True)
    write_log(work_dir, 0.93, 0.5)
    (work_dir / "result.json").write_text(json.dumps({"overrides": ["lr=0.2"], "minutes": 2.5}))
    result = read_result(work_dir)
    assert (result.overrides, result.minutes) == (["lr=0.2"], 2.5)
    assert (result.untrained, result.trained, result.fold_std) == (0.85, 0.93, 0.02)
    assert result.tar_at_far == {1e-3: 0.7} and result.eigenfaces == 0.84
    assert result.final_loss == pytest.approx((2 / 3 + 2 / 4) / 2, abs=1e-4)  # the last log line's
    assert result.ms_per_step == pytest.approx(500, rel=0.05)


def test_a_run_without_baseline_shows_a_dash_and_several_sets_are_refused(tmp_path):
    plain, several = tmp_path / "plain", tmp_path / "several"
    for work_dir in (plain, several):
        work_dir.mkdir()
        (work_dir / "result.json").write_text(json.dumps({"overrides": [], "minutes": 1.0}))
    write_log(plain, 0.93, 0.5, baseline=False)
    result = read_result(plain)
    assert result.eigenfaces is None
    assert table({"plain": [result]}).splitlines()[2].split(" | ")[5] == "-"
    write_log(several, 0.93, 0.5, sets=("heldout", "lfw"))
    with pytest.raises(SystemExit, match=r"one held-out set.*\['heldout', 'lfw'\]"):
        read_result(several)


def test_synthetic_splits_are_made_once_per_seed_and_likeness(tmp_path):
    harder = quality.SyntheticSet(classes=12, per_class=2, heldout=10, pairs=20, shared=0.5)
    data = quality.split_data(tmp_path, 1, harder)
    assert data.name == "synthetic12x2-shared0.5-heldout10x20-seed1"
    assert (data / "property").read_text().startswith("12,")
    made = (data / "train.rec").stat().st_mtime_ns
    assert quality.split_data(tmp_path, 1, harder) == data  # reused, not made again
    assert (data / "train.rec").stat().st_mtime_ns == made
    plain = quality.split_data(tmp_path, 1, quality.SyntheticSet(12, 2, 10, 20))
    assert plain.name == "synthetic12x2-heldout10x20-seed1"
    assert (plain / "train.rec").read_bytes() != (data / "train.rec").read_bytes()
