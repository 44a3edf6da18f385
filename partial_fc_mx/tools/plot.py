"""`python -m partial_fc_mx plot WORK_DIR [WORK_DIR ...]`: metrics.jsonl as pictures.

Writes loss.png, learning_rate.png, speed.png and verification.png, from the records
the trainer writes (no TensorBoard needed); several work dirs share each figure; a
dashed line marks each automatic restart, a dotted one each stop on purpose.
"""

from __future__ import annotations

from pathlib import Path

from ..data import DataError
from ..evaluation.drawing import pyplot
from ..run.metrics import METRICS, read_metrics


def plot_work_dirs(work_dirs: list[str], out: str | None = None) -> list[Path]:
    """One figure per quantity, one curve per work dir: comparing runs (an ablation's
    arms) needs them on the same axes. Written to `out`, by default WORK_DIR/plots for
    one work dir and ./plots for several."""
    plt = pyplot()
    runs = {label(path, len(work_dirs)): read_work_dir(Path(path)) for path in work_dirs}
    out_dir = Path(out or (Path(work_dirs[0]) / "plots" if len(work_dirs) == 1 else "plots"))
    out_dir.mkdir(parents=True, exist_ok=True)
    title = work_dirs[0] if len(work_dirs) == 1 else ", ".join(runs)
    written = []

    def save(figure, axes, name: str, ylabel: str) -> None:
        mark_restarts(axes, runs)
        axes.set(xlabel="global step", ylabel=ylabel, title=f"{ylabel} ({title})")
        axes.grid(alpha=0.3)
        if len(axes.get_lines()) > 1:
            axes.legend()
        written.append(out_dir / f"{name}.png")
        figure.savefig(written[-1], dpi=100, bbox_inches="tight")
        plt.close(figure)

    for key, ylabel in (("loss", "loss"), ("learning_rate", "learning rate"),
                        ("speed", "samples / s")):
        figure, axes = plt.subplots(figsize=(6, 4))
        for name, series in runs.items():
            axes.plot(series["step"], series[key], label=name)
        save(figure, axes, key, ylabel)
    if any(series["verification"] for series in runs.values()):
        figure, axes = plt.subplots(figsize=(6, 4))
        for name, series in runs.items():
            for target, points in series["verification"].items():
                axes.plot([p.step for p in points], [p.accuracy for p in points], marker="o",
                          label=f"{name} {target}".strip())
        save(figure, axes, "verification", "verification accuracy")
    return written


def mark_restarts(axes, runs: dict) -> None:
    """A dashed line at the step after which each restart's job had failed (restarts.py):
    the curve goes on from the checkpoint before it; a dotted one where the run was
    stopped on purpose (it saved there, and a resume goes on from there)."""
    for key, name, style, color in (("restarts", "restart", "--", "tab:red"),
                                    ("stops", "stopped", ":", "tab:gray")):
        steps = [r["step"] for series in runs.values() for r in series[key]
                 if r["step"] is not None]
        for i, step in enumerate(steps):
            axes.axvline(step, color=color, linestyle=style, linewidth=1,
                         label=name if i == 0 else None)


def label(work_dir: str, runs: int) -> str:
    """'' for a single run; 'arm/split0' (the last two parts of the path) otherwise."""
    return "" if runs == 1 else "/".join(Path(work_dir).resolve().parts[-2:])


def read_work_dir(work_dir: Path) -> dict:
    metrics = work_dir / METRICS
    if not metrics.is_file():
        raise DataError(f"{metrics.absolute()} does not exist: plot reads the {METRICS} a "
                        "training run writes into its work dir")
    series = read_metrics(work_dir)
    if not series["step"]:
        raise DataError(f"{metrics} has no training steps yet")
    if series["unreadable_lines"]:
        print(f"warning: {metrics}: skipped {series['unreadable_lines']} unfinished line(s) "
              "(a run killed while writing, or one writing now)")
    return series
