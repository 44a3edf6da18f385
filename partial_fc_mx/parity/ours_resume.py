"""Where our arm of the study goes on from after an interruption: the trainer's own
checkpoint (run/checkpoint.py: backbone, both optimizers' states, the centres, the
sampler's generator), saved in the run's `ours-state/` (resume.ours_folder) at every
evaluation but the last, loaded as `train --resume-from` loads one. Beside each, the
progress so far (losses, step times, minutes, the steps it went on from) and what
trained it, taken when the run started: the recipe, the number of processes, MXNet
and the code it runs. A checkpoint goes on only under the same, otherwise every rank
stops with the fix; so a run never mixes two recipes, global batches or codes."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import mxnet as mx

from .. import dist, durable
from ..errors import UserError
from ..run import checkpoint
from ..run.checkpoint import TrainState
from ..train import restore
from . import resume
from .recipe import Recipe, recipe_wherever, same_recipe

PACKAGE = Path(__file__).resolve().parents[1]
KERNEL_SOURCES = ("pfc/kernels/*.cc", "pfc/kernels/*.h")
"""Compiled when first used (pfc/kernels), so hashed as sources."""
DESCRIBED = {"recipe": "recipe", "processes": "number of processes", "mxnet": "MXNet",
             "code": "code"}
"""What trained_by records, as a refusal names it."""


def trained_by(recipe: Recipe, world_size: int) -> dict:
    """What trains this run (not its folder: recipe_wherever). Taken
    once, when the run has loaded its code: the files may change while it trains."""
    return {"recipe": recipe_wherever(recipe),
            "processes": world_size, "mxnet": mx.__version__,
            "code": code_digest(loaded_code(), PACKAGE)}


def loaded_code() -> list[Path]:
    """This package's modules the process has imported (`python -m`'s __main__ too),
    and the kernels' sources."""
    files = [Path(module.__file__).resolve() for module in list(sys.modules.values())
             if isinstance(getattr(module, "__file__", None), str)]
    return [path for path in files if PACKAGE in path.parents] + [
        path for pattern in KERNEL_SOURCES for path in PACKAGE.glob(pattern)]


def code_digest(files: list[Path], root: Path) -> str:
    """A hash of `files` (their paths under `root` and their bytes)."""
    digest = hashlib.sha256()
    for path in sorted(set(files)):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def progress_file(folder: Path, step: int) -> Path:
    return folder / f"progress-{step:06d}.json"


def progress_step(path: Path) -> int:
    """The step of a progress file (progress_file's name)."""
    return int(path.stem.split("-")[1])


def read_progress(path: Path, step: int, recipe: Recipe, trained: dict) -> dict:
    """The progress in `path` (of step `step`), if a run of `recipe` trained by
    `trained` wrote it; else a UserError naming the file, what differs and the fix."""
    progress = {}
    try:
        progress = json.loads(path.read_text())
        problem = progress_problem(progress, step, recipe, trained)
    except (OSError, ValueError) as error:
        problem = f"it does not load ({type(error).__name__}: {error})"
    if problem:
        raise UserError(f"cannot go on from {path}: {problem}; remove {path.parent} to "
                        "train this run from the beginning")
    return progress


def progress_problem(progress, step: int, recipe: Recipe, trained: dict) -> str:
    """What keeps a run of `recipe`, trained by `trained`, from going on with this
    progress of step `step` ("" if nothing)."""
    kinds = {"losses": list, "seconds": list, "wall": (int, float), "resumed_at": list,
             "trained_by": dict}
    if not isinstance(progress, dict) or not all(isinstance(progress.get(key), kind)
                                                 for key, kind in kinds.items()):
        return f"it lacks some of {', '.join(kinds)}"
    if len(progress["losses"]) != step:
        return f"it holds {len(progress['losses'])} losses for {step} steps"
    saved = progress["trained_by"]
    differs = [key for key in trained if key != "recipe" and saved.get(key) != trained[key]]
    recipe_saved = saved.get("recipe")
    if not isinstance(recipe_saved, dict) or not same_recipe(
            {**recipe_saved, "out": str(recipe.out)}, recipe):
        differs.insert(0, "recipe")
    return ("it was trained by another " + ", another ".join(DESCRIBED[key] for key in differs)
            if differs else "")


def go_on_from(run: SimpleNamespace, recipe: Recipe, trained: dict) -> tuple[TrainState, dict]:
    """Where the arm stands and its progress ({"losses", "seconds", "wall",
    "resumed_at"}): the newest checkpoint in the run's folder that verifies, if a run
    trained by `trained` saved it (every progress file there is checked before any
    is loaded); else the beginning, progress files of a start that saved no checkpoint
    removed. Every rank stops alike on a refusal."""
    folder, world = resume.ours_folder(recipe.out), run.world
    saved = dist.allgather_object(bool(checkpoint.checkpoints(folder)), name="parity.saved")[0]
    checked = {}
    if saved:
        checked = dist.run_agreed(lambda: {
            progress_step(path): read_progress(path, progress_step(path), recipe, trained)
            for path in sorted(folder.glob("progress-*.json"))},
            "parity.trained_by", (UserError,), UserError,
            f"cannot read the progress files in {folder}")
    else:
        dist.run_agreed(lambda: remove_progress(folder), "parity.progress.stray", (),
                        UserError, f"cannot remove progress files in {folder}",
                        on=world.is_main)
    state, notes = restore(run.config, world, run.ctx, folder, run.net, run.trainer,
                           run.pfc, run.validator, str(folder) if saved else None, None)
    if not saved:
        return state, {"losses": [], "seconds": [], "wall": 0.0, "resumed_at": []}
    progress = dist.run_agreed(  # read again only to refuse a checkpoint without one
        lambda: checked[state.step] if state.step in checked else read_progress(
            progress_file(folder, state.step), state.step, recipe, trained),
        "parity.progress", (UserError,), UserError,
        f"cannot read the progress of step {state.step} in {folder}")
    if world.is_main:
        print(f"going on from step {state.step}: {'; '.join(notes)}", flush=True)
    return state, {key: progress[key] for key in ("losses", "seconds", "wall")} | {
        "resumed_at": [*progress["resumed_at"], state.step]}


def save(run: SimpleNamespace, recipe: Recipe, state: TrainState, progress: dict,
         trained: dict) -> None:
    """The trainer's checkpoint of `state` (the newest only), after its progress: a
    checkpoint that verifies always has its progress file."""
    folder = resume.ours_folder(recipe.out)
    record = json.dumps({**progress, "trained_by": trained})

    def write_progress() -> None:
        folder.mkdir(parents=True, exist_ok=True)
        durable.write_atomically(progress_file(folder, state.step),
                                 lambda path: path.write_text(record))

    dist.run_agreed(write_progress, "parity.progress.write", (), UserError,
                    f"cannot write the progress of step {state.step} in {folder}",
                    on=run.world.is_main)
    checkpoint.save(folder, state, run.net, run.trainer, run.pfc, run.validator, run.world,
                    keep=1)
    dist.run_agreed(lambda: remove_progress(folder, keep=state.step), "parity.progress.prune",
                    (), UserError, f"cannot remove older progress files in {folder}",
                    on=run.world.is_main)


def remove_progress(folder: Path, keep: int | None = None) -> None:
    """The progress files in `folder` but that of step `keep` (all if None)."""
    for path in folder.glob("progress-*.json"):
        if keep is None or path != progress_file(folder, keep):
            path.unlink()
