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
import logging
import sys
import time
from pathlib import Path
from typing import NamedTuple

METRICS = "metrics.jsonl"
LINE_FORMAT = "%(asctime)s %(message)s"
"""training.log's lines: the time, then the human line of a record."""


def step_line(record: dict) -> str:
    return (f"Speed {record['speed']:.2f} samples/sec   Loss {record['loss']:.4f}   "
            f"LearningRate {record['learning_rate']:.6f}   Epoch: {record['epoch']}   "
            f"Global Step: {record['step']}   Required: {record['required_hours']:.1f} hours   "
            f"DataWait: {record['data_wait_percent']:.1f}%   Images: {record['images']}"
            + (f"   Filtered: {record['filtered_percent']:.2f}%" if "filtered_percent" in record
               else ""))


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


def restart_line(record: dict) -> str:
    after = f" after step {record['step']}" if record["step"] is not None else ""
    dropped = f", without {', '.join(record['dropped'])}" if record["dropped"] else ""
    resumed = (f"from checkpoint step {record['checkpoint']}"
               if record["checkpoint"] is not None else "from the start: no checkpoint yet")
    return (f"restart {record['attempt']}: {record['reason']}{after}; relaunching "
            f"{record['processes']} processes on {', '.join(record['hosts'])}{dropped}, "
            f"{resumed}")


def refusal_line(record: dict) -> str:
    return record["reason"]


def stop_line(record: dict) -> str:
    return (f"stopped by a signal at step {record['step']}; resume with --resume-from "
            f"{record['work_dir']}")


HUMAN_LINES = {"step": step_line, "evaluation": evaluation_line, "baseline": baseline_line,
               "restart": restart_line, "restart refused": refusal_line, "stop": stop_line}


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


def read_records(path: Path) -> list:
    """Every whole record of a metrics.jsonl, and None for each line that is not one
    (cut off by a crash, a full disk, a power loss)."""
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            records.append(None)
    return records


def read_metrics(work_dir: str | Path) -> dict:
    """{"step", "loss", "learning_rate", "speed", "images": [...] in step order,
    "verification": {set name: [Evaluation]}, "baseline": {set name: eigenfaces accuracy},
    "restarts": [restart records], "stops": [stop records], "unreadable_lines": how many
    lines were not whole records} of the latest run in work_dir/metrics.jsonl, with the
    steps before its start from the runs it resumed. A start at step 0 begins a new run,
    unless it is a relaunch of the same job (restarts.sh, before any checkpoint): the
    restarts and stops of earlier runs are not this one's."""
    steps, evaluations, baselines, restarts, stops, unreadable = {}, {}, {}, [], [], 0
    for record in read_records(Path(work_dir) / METRICS):
        if record is None:
            unreadable += 1
        elif record["kind"] == "restart":
            restarts.append(record)
        elif record["kind"] == "stop":
            stops.append(record)
        elif record["kind"] == "start":
            start = record["step"]
            if start == 0:
                job = record.get("job")
                restarts = [r for r in restarts if job is not None and r.get("job") == job]
                stops = []
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
    series["restarts"] = restarts
    series["stops"] = stops
    series["unreadable_lines"] = unreadable
    return series


def last_logged_step(work_dir: str | Path) -> int:
    """The last step the work dir's metrics.jsonl has a record of (0: none): a run
    resumed from an earlier checkpoint trains the steps after its own again."""
    try:
        return max(read_metrics(work_dir)["step"], default=0)
    except (OSError, ValueError, KeyError, TypeError):  # none, or not ours: nothing to say
        return 0


def open_metrics(path: Path):
    """metrics.jsonl for appending, after a newline if a killed run left its last line
    unfinished (a resume would otherwise glue its first record onto it)."""
    if path.is_file() and path.stat().st_size:
        with open(path, "rb") as existing:
            existing.seek(-1, 2)
            unfinished = existing.read(1) != b"\n"
    else:
        unfinished = False
    metrics = open(path, "a")  # noqa: SIM115 (TrainingLog.close closes it)
    if unfinished:
        metrics.write("\n")
    return metrics


def append_record(work_dir: Path, record: dict) -> None:
    """A record and its training.log line from outside a run (the restart supervisor,
    between two launches), as a run's rank 0 writes them; the line also to stderr."""
    record = {**record, "time": round(time.time(), 3)}
    line = logging.Formatter(LINE_FORMAT).format(logging.makeLogRecord(
        {"msg": human_line(record)}))
    work_dir.mkdir(parents=True, exist_ok=True)
    with open_metrics(work_dir / METRICS) as metrics:
        metrics.write(json.dumps(record) + "\n")
    with open(work_dir / "training.log", "a") as log:
        log.write(line + "\n")
    print(line, file=sys.stderr, flush=True)
