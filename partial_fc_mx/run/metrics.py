"""The metrics stream: one JSON object per logged step, per evaluation and per
baseline comparison, appended by rank 0 to work_dir/metrics.jsonl.

training.log's lines are made from the same records by `human_line` (in the
insightface reference's format, which people grep), so the two never disagree;
plot, quality and the tests read the JSON, never the text. Every run appends a
"start" record with the step it starts from; `read_metrics` then forgets what an
earlier run wrote past that step (a resume repeats those steps; a new run at step 0
replaces everything), and skips a line a killed process left half-written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

METRICS = "metrics.jsonl"


def step_line(record: dict) -> str:
    return (f"Speed {record['speed']:.2f} samples/sec   Loss {record['loss']:.4f}   "
            f"LearningRate {record['learning_rate']:.6f}   Epoch: {record['epoch']}   "
            f"Global Step: {record['step']}   Required: {record['required_hours']:.1f} hours   "
            f"DataWait: {record['data_wait_percent']:.1f}%   Images: {record['images']}")


def evaluation_line(record: dict) -> str:
    tars = "".join(f"   TAR@FAR={float(far):g}: {tar:.5f}"
                   for far, tar in record["tar_at_far"].items())
    return (f"[{record['name']}][{record['step']}]Accuracy-Flip: {record['accuracy']:.5f}"
            f"+-{record['std']:.5f}{tars}")


def baseline_line(record: dict) -> str:
    before = record.get("before_training")
    at_start = f" ({before:.4f} at step 0, before training)" if before is not None else ""
    return (f"[{record['name']}] model accuracy {record['accuracy']:.4f}{at_start} vs "
            f"eigenfaces (PCA) baseline {record['eigenfaces']:.4f} on the same pairs")


HUMAN_LINES = {"step": step_line, "evaluation": evaluation_line, "baseline": baseline_line}


def human_line(record: dict) -> str:
    """The training.log line of a record."""
    return HUMAN_LINES[record["kind"]](record)


class Evaluation(NamedTuple):
    step: int
    accuracy: float
    std: float
    """Over the ten folds."""
    tar_at_far: dict
    """{FAR: TAR} where the set has enough impostor pairs."""


def read_metrics(work_dir: str | Path) -> dict:
    """{"step", "loss", "learning_rate", "speed", "images": [...] in step order,
    "verification": {set name: [Evaluation]}, "baseline": {set name: eigenfaces accuracy},
    "unreadable_lines": how many lines were not whole records} of the latest run in
    work_dir/metrics.jsonl, with the steps before its start from the runs it resumed."""
    steps, evaluations, baselines, unreadable = {}, {}, {}, 0
    for line in (Path(work_dir) / METRICS).read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # cut off by a crash, a full disk, a power loss
            unreadable += 1
            continue
        if record["kind"] == "start":
            start = record["step"]
            steps = {step: r for step, r in steps.items() if step <= start}
            evaluations = {name: {step: e for step, e in points.items() if step <= start}
                           for name, points in evaluations.items()}
            baselines = {}
        elif record["kind"] == "step":
            steps[record["step"]] = record
        elif record["kind"] == "evaluation":
            evaluations.setdefault(record["name"], {})[record["step"]] = Evaluation(
                record["step"], record["accuracy"], record["std"],
                {float(far): tar for far, tar in record["tar_at_far"].items()})
        elif record["kind"] == "baseline":
            baselines[record["name"]] = record["eigenfaces"]
    ordered = [steps[step] for step in sorted(steps)]
    series = {key: [record[key] for record in ordered]
              for key in ("step", "loss", "learning_rate", "speed", "images")}
    series["verification"] = {name: [points[step] for step in sorted(points)]
                              for name, points in evaluations.items()}
    series["baseline"] = baselines
    series["unreadable_lines"] = unreadable
    return series


def last_logged_step(work_dir: str | Path) -> int:
    """The last step the work dir's metrics.jsonl has a record of (0: none): a run
    resumed from an earlier checkpoint trains the steps after its own again."""
    try:
        return max(read_metrics(work_dir)["step"], default=0)
    except (OSError, ValueError, KeyError, TypeError):  # none, or not ours: nothing to say
        return 0
