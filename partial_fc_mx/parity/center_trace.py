"""A run of our arm with its class centers' updates recorded, and the record replayed
through the dense and the exact update: whether `exact` keeps the dense update's rows
along a real run's own gradients (sampled rows, rates, idle spans), not only along the
tests' (tests/test_idle_rows.py).

The run recorded is a `dense` one, so that its rows need no bringing current to be
saved and the recording changes nothing it computes. Each rank writes, below the trace
folder, its rows at the start, every step's sampled rows, gradient and rate, and its
rows every --rows-every steps. The replay starts both updates from the first rows,
feeds them the recorded steps, and prints at each saved step the largest per-row
relative difference (||diff|| / ||run's row||) of each against the run's own rows:
the dense replay must give 0 (it is the run's arithmetic again), `exact` differs by
rounding only.

`current-at` answers the other half: how far a change of rounding alone moves the end
of a run. It trains an `exact` run unchanged except that after step N every row is
brought current (the steps each missed, applied then rather than when it is next
sampled): the same arithmetic, rounded otherwise from there on.

    mpirun -np 2 python -m partial_fc_mx.parity.center_trace record TRACE <our arm's arguments>
    python -m partial_fc_mx.parity.center_trace replay TRACE
    mpirun -np 2 python -m partial_fc_mx.parity.center_trace current-at N <our arm's arguments>
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import mxnet as mx
import numpy as np

from .. import dist
from ..cli.messages import report
from ..errors import UserError
from ..pfc.center_optimizers.sgd import SGD
from ..pfc.centers import ClassCenters, Shard
from . import ours
from .recipe import Recipe, add_arguments, from_args
from .task import load_task, run_steps


class Recorder:
    """Wraps one rank's ClassCenters.update to write what each step gives it."""

    def __init__(self, folder: Path, rows_every: int) -> None:
        self.folder, self.rows_every, self.steps = folder, rows_every, 0

    def attach(self, centers: ClassCenters) -> None:
        self.folder = self.folder / f"shard{centers.shard.start}"
        self.folder.mkdir(parents=True)
        optimizer = centers.optimizer
        (self.folder / "trace.json").write_text(json.dumps({
            "start": centers.shard.start, "momentum": optimizer.momentum,
            "weight_decay": optimizer.weight_decay}))
        self.save_rows(centers)
        update = centers.update

        def recorded(index, w, grad, lr):
            np.savez(self.folder / f"step-{self.steps:06d}.npz", index=index,
                     grad=grad.asnumpy(), lr=lr)
            update(index, w, grad, lr)
            self.steps += 1
            if self.steps % self.rows_every == 0:
                self.save_rows(centers)

        centers.update = recorded

    def save_rows(self, centers: ClassCenters) -> None:
        state = centers.state_dict()
        np.savez(self.folder / f"rows-{self.steps:06d}.npz", weight=state["weight"],
                 mom=state["mom"])


def bring_current_after(step: int) -> Callable[[ClassCenters], None]:
    """A `watch` for ours.train that brings every row of the centers current right
    after their update number `step` (counted from this process's first)."""

    def attach(centers: ClassCenters) -> None:
        update, done = centers.update, 0

        def counted(index, w, grad, lr):
            nonlocal done
            update(index, w, grad, lr)
            done += 1
            if done == step:
                centers.bring_all_current()
                print(f"every row of centers {centers.shard.start}-{centers.shard.stop - 1}"
                      f" brought current after step {step}", flush=True)

        centers.update = counted

    return attach


def record(trace: Path, recipe: Recipe, rows_every: int) -> None:
    """Train `recipe`, a dense run, with every rank's center updates written below
    `trace`."""
    train_from_the_beginning(recipe, Recorder(trace, rows_every).attach, "dense",
                             "record a dense run, whose rows are current at every step, "
                             "so that saving them changes nothing it computes", [trace])


def current_at(step: int, recipe: Recipe) -> None:
    """Train `recipe`, an exact run, with every row brought current after step `step`."""
    train_from_the_beginning(recipe, bring_current_after(step), "exact",
                             "this changes the rounding of an exact run, whose rows take "
                             "the steps they missed when they are sampled", [],
                             watched_step=step)


def train_from_the_beginning(recipe: Recipe, watch: Callable[[ClassCenters], None],
                             update: str, needs: str, folders: list[Path],
                             watched_step: int | None = None) -> None:
    """ours.train with `watch`; refused on every rank together, before any writes,
    unless the run's center update is `update`, `folders` and its own are empty (a run
    that went on from a saved state would be watched from the middle) and the run
    reaches `watched_step` (a watch that never acts would leave the plain run)."""
    world = dist.init()
    problem = start_problem(recipe, update, needs, folders)
    if problem is None and watched_step is not None:
        problem = step_problem(recipe, watched_step, world.size)
    dist.raise_on_every_rank(problem, "center_trace.start")
    recipe.out.mkdir(parents=True, exist_ok=True)
    ours.train(recipe, watch=watch)


def start_problem(recipe: Recipe, update: str, needs: str,
                  folders: list[Path]) -> UserError | None:
    """Why this diagnostic cannot run `recipe` (None: it can): it `needs` the center
    update `update` and, for a run from the beginning, empty folders."""
    if recipe.center_update != update:
        return UserError(f"--center-update is {recipe.center_update}: {needs}")
    for folder in (*folders, recipe.out):
        if folder.exists() and any(folder.iterdir()):
            return UserError(f"{folder} is not empty: this run starts from the "
                             "beginning (our arm would go on from a saved state); give "
                             "new folders")
    return None


def step_problem(recipe: Recipe, step: int, world_size: int) -> UserError | None:
    """Why step `step` is not one of the run's (None: it is)."""
    samples = len(load_task(recipe.task, ("train_y.npy",))["train_y"])
    total = run_steps(samples, recipe.batch_size * world_size, recipe.epochs)
    if step > total:
        return UserError(f"step {step} is beyond this run's last, {total} ({recipe.epochs} "
                         f"epochs of {samples} samples, {recipe.batch_size} x {world_size} "
                         f"a step): name a step from 1 to {total}")
    return None


def worst_relative(rows: np.ndarray, reference: np.ndarray, scale: np.ndarray) -> float:
    """max over rows of ||rows - reference|| / ||scale||, per row."""
    norms = np.maximum(np.linalg.norm(scale, axis=1), np.finfo(np.float64).tiny)
    return float(np.max(np.linalg.norm(rows - reference, axis=1) / norms))


def replay(trace: Path) -> Iterator[dict]:
    """For each rank's record and each saved step: the worst per-row differences of the
    dense and the exact replay's weight and momentum from the run's, and of the exact
    replay's momentum measured against the row's weight (momentum nears 0 as the rate
    does, so its own relative difference grows while mattering less)."""
    for folder in sorted(trace.glob("shard*"), key=lambda path: int(path.name[5:])):
        meta = json.loads((folder / "trace.json").read_text())
        first = np.load(folder / "rows-000000.npz")
        shard = Shard(meta["start"], len(first["weight"]))
        updates = {}
        for name, options in {"dense": {"lazy": False}, "exact": {"exact": True}}.items():
            centers = ClassCenters(shard, first["weight"].shape[1],
                                   SGD(meta["momentum"], meta["weight_decay"]),
                                   ctx=mx.cpu(), initialize=False, **options)
            centers.load_state_dict({"weight": first["weight"], "mom": first["mom"]})
            updates[name] = centers
        for step_file in sorted(folder.glob("step-*.npz")):
            with np.load(step_file) as step:  # each key read from the file once
                index, grad, lr = step["index"], mx.nd.array(step["grad"]), float(step["lr"])
            for centers in updates.values():
                centers.bring_current(index)
                centers.update(index, centers.sampled_weights(index), grad, lr)
            done = int(step_file.stem[5:]) + 1
            saved = folder / f"rows-{done:06d}.npz"
            if saved.is_file():
                yield compared(meta["start"], done, np.load(saved), updates)


def compared(start: int, step: int, run, updates: dict[str, ClassCenters]) -> dict:
    states = {name: centers.state_dict() for name, centers in updates.items()}
    figures = {"shard": start, "step": step}
    for name, state in states.items():
        figures[f"{name} weight"] = worst_relative(state["weight"], run["weight"],
                                                   run["weight"])
        figures[f"{name} momentum"] = worst_relative(state["mom"], run["mom"], run["mom"])
    figures["exact momentum / weight"] = worst_relative(states["exact"]["mom"], run["mom"],
                                                        run["weight"])
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m partial_fc_mx.parity.center_trace",
                                     description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    recording = commands.add_parser("record", help="train our arm (dense), recorded")
    recording.add_argument("trace", type=Path)
    recording.add_argument("--rows-every", type=int, default=50,
                           help="save each rank's rows after every this many steps")
    add_arguments(recording)
    replaying = commands.add_parser("replay", help="replay a record; print the differences")
    replaying.add_argument("trace", type=Path)
    rounding = commands.add_parser("current-at", help="train our arm (exact) with every "
                                   "row brought current after one step")
    rounding.add_argument("step", type=int)
    add_arguments(rounding)
    args = parser.parse_args(argv)
    if args.command == "current-at" and args.step < 1:
        parser.error(f"current-at {args.step}: the step is counted from 1 (after the "
                     "first update)")
    try:
        if args.command == "record":
            record(args.trace, from_args(args), args.rows_every)
            return 0
        if args.command == "current-at":
            current_at(args.step, from_args(args))
            return 0
    except UserError as error:
        report(error)
        return 2
    for figures in replay(args.trace):
        print(json.dumps({name: value if isinstance(value, int) else f"{value:.2e}"
                          for name, value in figures.items()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
