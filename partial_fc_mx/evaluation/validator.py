"""A run's verification: its sets, their last accuracies and the best model so far.

The best (mean accuracy, step) is part of the run's state: checkpoints keep it
(`state_dict`), and `backbone-best.json` beside `backbone-best-*` keeps a best found
after the last checkpoint, so a resume never replaces the best model by a worse one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from .. import durable
from .verification import NonFiniteEmbeddings, VerificationResult, VerificationSet, verify

BEST_MODEL = "backbone-best"
BEST_RECORD = f"{BEST_MODEL}.json"


class Validator:
    """Evaluates a model on the sets (rank 0 holds them; the others hold none) and
    tracks the best mean accuracy of `work_dir`'s run."""

    def __init__(self, sets: list[VerificationSet], work_dir: Path) -> None:
        self.sets = sets
        self.work_dir = Path(work_dir)
        self.accuracy: dict[str, float] = {}
        """The last accuracy of each set."""
        self.before_training: dict[str, float] = {}
        """Each set's accuracy at step 0, before any training step (the untrained
        network, or the weights --load-from took): what training added is measured
        from it."""
        self.best_accuracy = -1.0
        self.best_step = 0
        self.unscored: dict[str, str] = {}
        """The sets of the last evaluation whose embeddings were not finite: why."""
        self.evaluated_step: int | None = None
        """The step whose model was last evaluated, kept on every rank (the trainer
        sets it) and in checkpoints: a run resumed at its end evaluates only if its
        last step was not (a save on a signal skips the evaluation)."""

    def evaluate(self, forward, step: int) -> dict[str, VerificationResult]:
        """Every set's result for the model `forward` (images -> embeddings) at `step`; a
        set whose embeddings are not finite has none, and why is in `unscored`."""
        results, self.unscored = {}, {}
        for pairs in self.sets:
            try:
                results[pairs.name] = verify(forward, pairs)
            except NonFiniteEmbeddings as error:
                self.unscored[pairs.name] = str(error)
                self.accuracy.pop(pairs.name, None)
        self.accuracy.update({name: result.accuracy for name, result in results.items()})
        if step == 0:
            self.before_training = dict(self.accuracy)
        return results

    def keep_if_best(self, step: int, save_model: Callable[[Path], None]) -> float | None:
        """The mean accuracy just measured if it beats the best so far (the untrained
        network of step 0 never does); then `save_model(prefix)` writes the model and
        the record follows it, so the record never names a model not yet on disk."""
        if step == 0 or self.unscored or not self.accuracy:
            return None
        mean = sum(self.accuracy.values()) / len(self.accuracy)
        if mean <= self.best_accuracy:
            return None
        self.best_accuracy, self.best_step = mean, step
        save_model(self.work_dir / BEST_MODEL)
        record = json.dumps({"accuracy": mean, "step": step})
        durable.write_atomically(self.work_dir / BEST_RECORD, lambda tmp: tmp.write_text(record))
        return mean

    def state_dict(self) -> dict:
        return {"best_accuracy": self.best_accuracy, "best_step": self.best_step,
                "evaluated_step": self.evaluated_step, "before_training": self.before_training}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's best, or backbone-best.json's when that one is better (found
        after the checkpoint was written)."""
        self.best_accuracy, self.best_step = max(
            (float(state["best_accuracy"]), int(state["best_step"])), self.best_on_disk())
        evaluated = state.get("evaluated_step")  # None in checkpoints written before it
        self.evaluated_step = None if evaluated is None else int(evaluated)
        self.before_training = {str(name): float(accuracy) for name, accuracy
                                in dict(state.get("before_training", {})).items()}

    def best_on_disk(self) -> tuple[float, int]:
        """(accuracy, step) of backbone-best.json, (-1, 0) when there is none."""
        try:
            record = json.loads((self.work_dir / BEST_RECORD).read_text())
            return float(record["accuracy"]), int(record["step"])
        except (OSError, ValueError, KeyError, TypeError):
            return -1.0, 0
