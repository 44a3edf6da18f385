"""The split study's bookkeeping: finished runs are reused, changed arms are trained
again, and the table reports the mean and spread over splits (the training itself is
what `bash run.sh` does, tested elsewhere)."""

from __future__ import annotations

from partial_fc_mx import quality
from partial_fc_mx.quality import RunResult, run_arm, table


def test_runs_are_reused_retrained_when_changed_and_tabled(tmp_path, monkeypatch):
    trained = []

    def fake_train(config, data, overrides, work_dir, processes):
        trained.append((work_dir.name, tuple(overrides)))
        work_dir.mkdir(parents=True)
        accuracy = 0.90 + 0.01 * int(work_dir.name.removeprefix("split"))
        return RunResult(overrides, 0.85, accuracy, 0.84, 3.0)

    monkeypatch.setattr(quality, "train_once", fake_train)
    monkeypatch.setattr(quality, "split_data", lambda work, seed: work / f"data{seed}")
    first = run_arm("cfg.py", tmp_path, "aug", ["augment_rotate=10"], [0, 1, 2], 2)
    assert [r.trained for r in first] == [0.90, 0.91, 0.92] and len(trained) == 3
    again = run_arm("cfg.py", tmp_path, "aug", ["augment_rotate=10"], [0, 1, 2, 3], 2)
    assert len(trained) == 4 and trained[-1][0] == "split3"  # only the new split ran
    assert [r.trained for r in again] == [0.90, 0.91, 0.92, 0.93]
    run_arm("cfg.py", tmp_path, "aug", ["augment_rotate=20"], [0], 2)  # the arm changed
    assert trained[-1] == ("split0", ("augment_rotate=20",))
    rows = table({"aug": again}).splitlines()
    assert rows[2] == ("| aug | `augment_rotate=10` | **0.9150 ± 0.0129** | 0.900 0.910 0.920 "
                       "0.930 | 0.8500 ± 0.0000 | 0.8400 ± 0.0000 | 3.0 |")
