"""Where our arm of the study goes on from after an interruption: the trainer's own
checkpoint (run/checkpoint.py: backbone, both optimizers' states, the centres, the
sampler's generator), saved in the run's `ours-state/` (resume.ours_folder) at every
evaluation but the last, loaded as `train --resume-from` loads one. Beside each, the
progress so far (losses, step times, minutes, the steps it went on from) and what
trained it: the recipe, the number of processes, MXNet and this package's code. A
checkpoint goes on only under the same, otherwise every rank stops with the fix; so a
run never mixes two recipes, batches or codes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import mxnet as mx

from .. import dist, durable
from ..errors import UserError
from ..run import checkpoint
from ..run.checkpoint import TrainState
from ..train import restore
from . import resume
from .recipe import Recipe, recipe_record, same_recipe

PROGRESS_KEYS = ("losses", "seconds", "wall", "resumed_at", "trained_by")


def trained_by(recipe: Recipe, world_size: int) -> dict:
    """What a checkpoint of this run must have been trained by (not its folder: a run
    moved elsewhere goes on)."""
    return {"recipe": {k: v for k, v in recipe_record(recipe).items() if k != "out"},
            "processes": world_size, "mxnet": mx.__version__, "code": code_digest()}


def code_digest() -> str:
    """A hash of this package's code (Python and the C++ kernels)."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*")):
        if path.suffix in (".py", ".cc", ".h") and path.is_file():
            digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def progress_file(folder: Path, step: int) -> Path:
    return folder / f"progress-{step:06d}.json"


def read_progress(path: Path, step: int, recipe: Recipe, trained: dict) -> dict:
    """The progress in `path` (of step `step`), if a run of `recipe` trained by
    `trained` wrote it; else a UserError naming the file, what differs and the fix."""
    problem, progress = "", {}
    try:
        progress = json.loads(path.read_text())
        if not isinstance(progress, dict) or any(key not in progress for key in PROGRESS_KEYS):
            problem = f"it lacks some of {', '.join(PROGRESS_KEYS)}"
        elif len(progress["losses"]) != step:
            problem = f"it holds {len(progress['losses'])} losses for {step} steps"
    except (OSError, ValueError) as error:
        problem = f"it does not load ({type(error).__name__}: {error})"
    if not problem:
        saved = progress["trained_by"]
        differs = [key for key in trained if key != "recipe" and saved.get(key) != trained[key]]
        if not same_recipe({**saved.get("recipe", {}), "out": str(recipe.out)}, recipe):
            differs.insert(0, "recipe")
        problem = f"it was trained by another {' and '.join(differs)}" if differs else ""
    if problem:
        raise UserError(f"cannot go on from {path}: {problem}; remove {path.parent} to "
                        "train this run from the beginning")
    return progress


def go_on_from(run: SimpleNamespace, recipe: Recipe) -> tuple[TrainState, dict]:
    """Where the arm stands and its progress ({"losses", "seconds", "wall",
    "resumed_at"}): the newest checkpoint in the run's folder that verifies, if this
    run's recipe, processes and code trained it (every progress file there is checked
    before any is loaded); the beginning if none. Every rank stops alike on a refusal."""
    folder, world = resume.ours_folder(recipe.out), run.world
    trained = trained_by(recipe, world.size)
    saved = dist.allgather_object(bool(checkpoint.checkpoints(folder)), name="parity.saved")[0]
    if saved:
        dist.run_agreed(lambda: [read_progress(path, int(path.stem.split("-")[1]), recipe,
                                               trained)
                                 for path in sorted(folder.glob("progress-*.json"))],
                        "parity.trained_by", (UserError,), UserError,
                        f"cannot read the progress files in {folder}")
    state, notes = restore(run.config, world, run.ctx, folder, run.net, run.trainer,
                           run.pfc, run.validator, str(folder) if saved else None, None)
    if not saved:
        return state, {"losses": [], "seconds": [], "wall": 0.0, "resumed_at": []}
    progress = dist.run_agreed(
        lambda: read_progress(progress_file(folder, state.step), state.step, recipe,
                              trained), "parity.progress", (UserError,), UserError,
        f"cannot read the progress of step {state.step} in {folder}")
    if world.is_main:
        print(f"going on from step {state.step}: {'; '.join(notes)}", flush=True)
    return state, {key: progress[key] for key in ("losses", "seconds", "wall")} | {
        "resumed_at": [*progress["resumed_at"], state.step]}


def save(run: SimpleNamespace, recipe: Recipe, state: TrainState, progress: dict) -> None:
    """The trainer's checkpoint of `state` (the newest only), after its progress: a
    checkpoint that verifies always has its progress file."""
    folder = resume.ours_folder(recipe.out)
    record = json.dumps({**progress, "trained_by": trained_by(recipe, run.world.size)})

    def write_progress() -> None:
        folder.mkdir(parents=True, exist_ok=True)
        durable.write_atomically(progress_file(folder, state.step),
                                 lambda path: path.write_text(record))

    dist.run_agreed(write_progress, "parity.progress.write", (), UserError,
                    f"cannot write the progress of step {state.step} in {folder}",
                    on=run.world.is_main)
    checkpoint.save(folder, state, run.net, run.trainer, run.pfc, run.validator, run.world,
                    keep=1)

    def remove_older() -> None:
        for old in folder.glob("progress-*.json"):
            if old != progress_file(folder, state.step):
                old.unlink()

    dist.run_agreed(remove_older, "parity.progress.prune", (), UserError,
                    f"cannot remove older progress files in {folder}", on=run.world.is_main)
