"""The study's cleaning arm: a sub-center run's model reads its training set back, the
samples far from their class's dominant sub-center are dropped (the rule `clean`
applies to a packed dataset: cleaning/dominant.py), and a plain run trains on what is
left. This module makes the cleaned task: the kept samples, their classes renumbered,
the held-out identities and pairs unchanged, and how well the cleaning found the
planted wrong labels (against the task's true labels)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from ..cleaning import dominant
from .ours import CLEANING_FILES
from .task import FILES, TRUE_LABELS, load_task


def cleaned_task(task: Path, trained: Path, angle: float = dominant.DEFAULT_ANGLE) -> Path:
    """The cleaned copy of `task` by the sub-center run in `trained`, made once, beside
    the task's folder (its name says from which run and at which angle)."""
    source = (trained / "log.json").read_text()  # the finished run, with its recipe
    # named by that run: one trained again makes another copy, and the arm trained on
    # it has another recipe (its task's path), so it is never taken for this one's
    digest = hashlib.sha256(source.encode()).hexdigest()[:8]
    out = task.with_name(f"{task.name}-cleaned-{trained.name}-{digest}-{angle:g}")
    made = out / "cleaning.json"
    if made.is_file():
        return out
    data = load_task(task, ("train_y.npy",))
    labels = np.asarray(data["train_y"])
    embeddings = np.load(trained / CLEANING_FILES[0], mmap_mode="r")
    centers = np.load(trained / CLEANING_FILES[1], mmap_mode="r")
    classes = int(labels.max()) + 1
    k = len(centers) // classes
    if k * classes != len(centers):
        raise SystemExit(f"{trained}: {len(centers)} sub-center rows for {classes} classes")
    by_class = np.asarray(centers).reshape(classes, k, -1)
    cosines = dominant.own_class_cosines(embeddings, labels, by_class[labels])
    degrees = dominant.angles(labels, cosines, dominant.dominant(
        dominant.pick_counts(labels, cosines, classes)))
    keep = degrees <= angle
    out.mkdir(parents=True, exist_ok=True)
    kept_ids = np.unique(labels[keep])
    np.save(out / "train_x.npy", np.load(task / "train_x.npy", mmap_mode="r")[keep])
    np.save(out / "train_y.npy", np.searchsorted(kept_ids, labels[keep]))
    for name in FILES[2:]:  # the held-out identities and their pairs: the task's own
        link = out / name
        if not link.exists():
            os.symlink((task / name).resolve(), link)
    (out / "task.json").write_text((task / "task.json").read_text())
    record = {"source": source, "angle": angle, "subcenters": k, "images": int(len(labels)),
              "kept": int(keep.sum()), "classes_kept": int(len(kept_ids)),
              **found(task, labels, keep)}
    made.write_text(json.dumps(record))  # last: marks the folder made
    return out


def found(task: Path, labels: np.ndarray, keep: np.ndarray) -> dict:
    """Precision and recall of the dropped samples as wrong labels (those whose label
    is not their identity's), for a task of flipped labels."""
    noise = json.loads((task / "task.json").read_text()).get("noise", "")
    if not noise.startswith("flips"):  # split identities have no wrong label to find
        return {}
    wrong = labels != np.load(task / TRUE_LABELS)
    dropped = ~keep
    return {"wrong": int(wrong.sum()), "dropped": int(dropped.sum()),
            "precision": float((wrong & dropped).sum() / max(dropped.sum(), 1)),
            "recall": float((wrong & dropped).sum() / max(wrong.sum(), 1))}
