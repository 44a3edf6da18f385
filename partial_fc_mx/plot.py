"""`python -m partial_fc_mx plot WORK_DIR`: training.log as pictures.

Writes loss.png, learning_rate.png, speed.png and verification.png into
WORK_DIR/plots, from the lines the trainer logs (no TensorBoard needed).
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from .data.recordio import DataError

STEP_LINE = re.compile(r"Speed ([\d.]+) samples/sec\s+Loss ([\d.naninf]+)\s+LearningRate "
                       r"([\d.e-]+)\s+Epoch: (\d+)\s+Global Step: (\d+)")
EVAL_LINE = re.compile(r"\[([^\]]+)\]\[(\d+)\]Accuracy-Flip: ([\d.]+)")


def read_log(path: Path) -> dict:
    """{"step": [...], "loss": [...], "learning_rate": [...], "speed": [...],
    "verification": {name: [(step, accuracy)]}} from a training.log."""
    series: dict = {"step": [], "loss": [], "learning_rate": [], "speed": [],
                    "verification": defaultdict(list)}
    for line in path.read_text().splitlines():
        if match := STEP_LINE.search(line):
            speed, loss, lr, _, step = match.groups()
            for key, value in (("step", int(step)), ("loss", float(loss)),
                               ("learning_rate", float(lr)), ("speed", float(speed))):
                series[key].append(value)
        elif match := EVAL_LINE.search(line):
            name, step, accuracy = match.groups()
            series["verification"][name].append((int(step), float(accuracy)))
    return series


def plot_work_dir(work_dir: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log = Path(work_dir) / "training.log"
    if not log.is_file():
        raise DataError(f"{log} does not exist: plot reads the training.log of a work dir")
    series = read_log(log)
    if not series["step"]:
        raise DataError(f"{log} has no training lines ('Speed ... Loss ... Global Step')")
    out = Path(work_dir) / "plots"
    out.mkdir(exist_ok=True)
    written = []
    for key, label in (("loss", "loss"), ("learning_rate", "learning rate"),
                       ("speed", "samples / s")):
        figure, axes = plt.subplots(figsize=(6, 4))
        axes.plot(series["step"], series[key])
        axes.set(xlabel="global step", ylabel=label, title=f"{label} ({Path(work_dir).name})")
        axes.grid(alpha=0.3)
        written.append(out / f"{key}.png")
        figure.savefig(written[-1], dpi=100, bbox_inches="tight")
        plt.close(figure)
    if series["verification"]:
        figure, axes = plt.subplots(figsize=(6, 4))
        for name, points in series["verification"].items():
            steps, accuracy = zip(*points)
            axes.plot(steps, accuracy, marker="o", label=name)
        axes.set(xlabel="global step", ylabel="verification accuracy", title="verification")
        axes.grid(alpha=0.3)
        axes.legend()
        written.append(out / "verification.png")
        figure.savefig(written[-1], dpi=100, bbox_inches="tight")
        plt.close(figure)
    return written
