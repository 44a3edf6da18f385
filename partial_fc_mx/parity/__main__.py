"""The parity study: ours and arcface_torch's own code trained on the same data with
the same recipe over several seeds, scored by one evaluator, side by side.

    python -m partial_fc_mx.parity --classes 3000 --seeds 0 1 2 --rates 1.0 0.1 \\
        --arms ours-exact ours-lazy arcface_torch \\
        --arcface-torch insightface/recognition/arcface_torch --torch-python torch-venv/bin/python

`--kind images` runs the images task instead (task.py, images.py): a face backbone
(`--network`, default mbf) on 3,000 look-alike identities, with the recipe changes
IMAGES_RECIPE lists.

Each arm of each seed and rate is kept in --work/<task>/<arm>-r<rate>: a finished run
(its log.json) with the same recipe is not trained again, so arms, seeds and rates can
be added and the tables printed again. One arm at a time: the machine's cores are the
processes'. Seed s makes the task's data (task.py), the data order, the network's and
the centres' initial values and the sampling; the two toolkits of one seed train on the
same data in the same order.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..quality import REPO, mean_std, mpirun_on_this_host
from . import resume
from .recipe import BACKBONES, Recipe, command_line, recipe_record, same_recipe
from .scoring import FARS, Score, score
from .task import KINDS, Task, load_task, write_task


@dataclass(frozen=True)
class Arm:
    toolkit: str
    """"ours" or "arcface_torch"."""
    changes: dict
    """Recipe fields this arm sets (recipe.py)."""
    cleaned_from: str | None = None
    """An arm of sub-centers whose run cleans the task first (cleaned.py): this arm
    trains on what that run's model keeps."""

    @property
    def power(self) -> float:
        return self.changes.get("power", Recipe.power)


def ours(**changes) -> Arm:
    return Arm("ours", changes)


def anchor(**changes) -> Arm:
    """torch's SGD updates every centre: the run's log says "dense" (anchor.py)."""
    return Arm("arcface_torch", {"center_update": "dense", **changes})


ARMS = {"ours-exact": ours(center_update="exact"), "ours-lazy": ours(center_update="lazy"),
        "ours-dense": ours(center_update="dense"), "arcface_torch": anchor(),
        "ours-exact-power1": ours(center_update="exact", power=1.0),
        "arcface_torch-power1": anchor(power=1.0),
        "arcface_torch-mxnet-momentum": anchor(momentum_form="mxnet"),
        "arcface_torch-rank-seeds": anchor(seeding="per-rank"),
        "arcface_torch-exact-margin": anchor(margin_gradient="exact"),
        "arcface_torch-all-three": anchor(momentum_form="mxnet", seeding="per-rank",
                                          margin_gradient="exact"),
        "ours-exact-prelu-kernel": ours(center_update="exact", prelu="kernel"),
        "ours-filter": ours(center_update="exact", interclass_filtering_threshold=0.4),
        "ours-sub3": ours(center_update="exact", num_subcenters=3),
        "arcface_torch-filter": anchor(interclass_filtering_threshold=0.4),
        "ours-sub3-clean": Arm("ours", {"center_update": "exact"}, cleaned_from="ours-sub3"),
        "ours-exact-gemm16": ours(center_update="exact", pfc_gemm="bfloat16")}
"""arcface_torch's SGD updates every centre each step (dense). Three differences of its
train_v2.py have an arm of their own: it decays the rate with power 1, ours with 2
(config lr_power), so the study trains both toolkits with 2, and both with 1 in the
-power1 arms; its SGD applies the rate after the momentum, MXNet's before
(-mxnet-momentum takes it before); it seeds every rank alike, so that the ranks'
shards start as one matrix (-rank-seeds seeds each rank apart); and its ArcFace margin
passes the plain cosine's gradient (-exact-margin differentiates it, as ours does;
recipe.py); -all-three changes the three at once. ours-exact-prelu-kernel trains the
scale task's PReLU with the trainer's CPU kernel, where the other arms of ours have
MXNet's LeakyReLU (recipe.py's `prelu`); on the images task, where every arm of ours
has the kernel, it is ours-exact. The noisy-label study's (--noise; docs/noisy_labels.md):
ours-filter and arcface_torch-filter filter at arcface_torch's own threshold, 0.4 (not
tuned: no split of the data chose it), ours-sub3 trains 3 sub-centers per class, and
ours-sub3-clean trains plain on what ours-sub3's model keeps within 75 degrees of each
class's dominant sub-center (the paper's angle, not tuned either). ours-exact-gemm16 is
ours-exact with the classifier GEMMs' inputs in bfloat16 (config pfc_gemm; a CPU with
AVX512_BF16 or AMX), whose models must end within the seeds' spread of ours-exact's
before bfloat16 becomes pfc_gemm's default."""
NOISY_BASELINE = "arcface_torch-filter"
"""What the noisy-label arms of ours are compared with: the anchor's best recipe."""


IMAGES_RECIPE = {"embedding_size": 512, "batch_size": 64, "epochs": 4, "evaluations": 5,
                 "prelu": "kernel"}
"""The images task's recipe, where it differs from the scale task's: arcface_torch's
512-d embedding, the batch and epochs of the earlier sampling study (748 steps; an mbf
step of ours 6.6 s on this 2-core machine alone, arcface_torch's 8.4 s: docs/parity.md),
and ours' PReLU as the trainer computes it on a CPU."""
IMAGES_HELDOUT = 600
"""Held-out identities of the images task (x 5 images: 4.5 million pairs, of which
6,000 genuine): each evaluation embeds them all with the backbone."""
IMAGES_SHARED = 0.6
"""How alike the images task's identities are (Task.shared): the earlier sampling
study's fraction. Alone it is too easy for `mbf` (TAR@FAR=1e-3 0.99 150 steps in), and
so is 0.8 at the run's end (docs/parity.md): what makes the task hard is IMAGES_KIN."""
IMAGES_KIN = 0.7
"""How alike the members of a family are (Task.kin): 30% of the rest of the picture,
12% of it in all, tells family members apart, 60% of what 0.8 alike left every
identity. At 0.8 `mbf` did not learn to tell them apart (accuracy 0.75 all run, what
telling none apart gives); its model scored the held-out identities of 0.7 well
between that and the ceiling (docs/parity.md). Strangers stay nearly as far apart as
at 0.6 alone (0.30 of a picture's spread against 0.4), so that training gets a signal
from its first steps (alike as a whole, the smallest networks stalled)."""


def task_of(kind: str, classes: int, per_class: int, seed: int, noise: str = "") -> Task:
    if kind == "images":
        return Task(classes, per_class, seed=seed, kind=kind, heldout=IMAGES_HELDOUT,
                    shared=IMAGES_SHARED, kin=IMAGES_KIN, noise=noise)
    return Task(classes, per_class, seed=seed, kind=kind, noise=noise)


def recipe_changes(args: argparse.Namespace) -> dict:
    """The recipe fields the study's options set, the task's own defaults first."""
    if args.kind == "latent":
        return {"epochs": args.epochs or Recipe.epochs}
    return {**IMAGES_RECIPE, "network": args.network,
            **({"epochs": args.epochs} if args.epochs else {})}


def arm_recipe(arm: Arm, base: Recipe, seed: int, rate: float,
               args: argparse.Namespace) -> Recipe:
    """`base` with the seed, the rate, the task's fields (recipe_changes) and then the
    arm's own, which win where both set one (ours-exact-prelu-kernel's prelu on images)."""
    return replace(base, seed=seed, sample_rate=rate,
                   **{**recipe_changes(args), **arm.changes})


@dataclass
class Result:
    seed: int
    scores: list[tuple[int, Score]]
    """(step, score) along the run; the last is the model at the end."""
    minutes: float
    ms_per_step: float


EVALUATION_PATIENCE_S = 900
"""How long Horovod's stall inspector waits in our arm before it warns: rank 0 embeds the
held-out set alone at each evaluation (about two minutes, sometimes more, for the
images task's MobileFaceNet on one thread) while the other ranks wait in the next
collective, which its default of 60 s reports as a possible deadlock."""


def launch(arm: Arm, recipe: Recipe, processes: int, args: argparse.Namespace) -> list[str]:
    words = command_line(recipe)
    if arm.toolkit == "ours":
        return [*mpirun_on_this_host(processes), "-x", "OMP_NUM_THREADS", "-x",
                f"HOROVOD_STALL_CHECK_TIME_SECONDS={EVALUATION_PATIENCE_S}", sys.executable,
                "-m", "partial_fc_mx.parity.ours", *words]
    if args.arcface_torch is None or args.torch_python is None:
        raise SystemExit("arcface_torch's arms need --arcface-torch and --torch-python")
    return [str(args.torch_python.absolute()), "-m", "torch.distributed.run", "--nproc-per-node",
            str(processes), "-m", "partial_fc_mx.parity.anchor", "--arcface-torch",
            str(args.arcface_torch.resolve()), *words]


def run_arm(arm: Arm, recipe: Recipe, args: argparse.Namespace) -> Result | None:
    """Train (unless a finished run of the same recipe is there) and score the run; with
    --report, only score what finished (None for a run that did not)."""
    log_path = recipe.out / "log.json"
    finished = log_path.is_file() and same_recipe(json.loads(log_path.read_text())["recipe"],
                                                  recipe)
    if finished:
        resume.clear(recipe.out)  # left by a run stopped after its log, before its cleanup
    elif args.report:
        return None
    else:
        begin_or_go_on(recipe)
        environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        with open(recipe.out / "output.txt", "a") as output:
            done = subprocess.run(launch(arm, recipe, args.np, args), cwd=REPO,
                                  env=environment, stdout=output, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            raise SystemExit(f"the run failed (exit {done.returncode}); its output: "
                             f"{recipe.out / 'output.txt'}")
    log = json.loads(log_path.read_text())
    return Result(recipe.seed, scored(recipe), log["minutes"], log["ms_per_step"])


def arm_folder(work: Path, task: Path, name: str, rate: float,
               args: argparse.Namespace) -> Path:
    processes = "" if args.np == 2 else f"-np{args.np}"
    return work / task.name / f"{name}-r{rate:g}{processes}"


def task_of_arm(arm: Arm, task: Path, work: Path, rate: float, seed: int,
                args: argparse.Namespace) -> Path:
    """The task's folder, or for a cleaning arm its cleaned copy (its sub-center arm
    trained first where it has not been; with --report, made from that arm's run if it
    finished, else a folder that does not exist, which reports the arm as not run)."""
    if arm.cleaned_from is None:
        return task
    source = ARMS[arm.cleaned_from]
    folder = arm_folder(work, task, arm.cleaned_from, rate, args)
    if run_arm(source, arm_recipe(source, Recipe(task, folder), seed, rate, args), args) is None:
        return task.with_name(f"{task.name}-cleaned-{folder.name}-not-run")
    from .cleaned import cleaned_task  # MXNet's environment: this process has it

    return cleaned_task(task, folder)


def cleaning_line(task: Path) -> str:
    """What a cleaning arm's cleaning kept, and how well it found the wrong labels."""
    made = json.loads((task / "cleaning.json").read_text())
    found = (f"; of the dropped, {made['precision']:.3f} were wrong labels, and "
             f"{made['recall']:.3f} of the wrong labels were dropped" if "precision" in made
             else "")
    return (f"cleaning at {made['angle']:g} degrees kept {made['kept']:,} of "
            f"{made['images']:,} samples and {made['classes_kept']:,} classes{found}")


def begin_or_go_on(recipe: Recipe) -> None:
    """Empty the run's folder, unless it holds an interrupted run of the same recipe
    (its recipe.json, written here before the run starts): that is kept for the arm to
    go on from its last evaluation (arcface_torch's state files, parity/resume.py; our
    trainer's checkpoints, parity/ours_resume.py)."""
    started = recipe.out / "recipe.json"
    if started.is_file() and same_recipe(json.loads(started.read_text()), recipe):
        return
    started.unlink(missing_ok=True)  # first: a folder half emptied is not taken up
    resume.clear(recipe.out)
    for old in recipe.out.glob("*"):
        old.unlink()
    recipe.out.mkdir(parents=True, exist_ok=True)
    started.write_text(json.dumps(recipe_record(recipe)))


def scored(recipe: Recipe) -> list[tuple[int, Score]]:
    """Every embeddings file of the run scored (kept in scores.json beside them, for
    the task's pair list of the time: other pairs, scored again)."""
    data = load_task(recipe.task, ("heldout_y.npy", "pairs.npy", "issame.npy"))  # not train_x
    pairs = hashlib.sha256(data["pairs"].tobytes() + data["issame"].tobytes()).hexdigest()
    cache_path = recipe.out / "scores.json"
    saved = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    cache = saved.get("scores", {}) if saved.get("pairs") == pairs else {}
    results = []
    for path in sorted(recipe.out.glob("embeddings-*.npy")):
        if path.name not in cache:
            s = score(np.load(path), data["heldout_y"], data["pairs"], data["issame"])
            cache[path.name] = [s.accuracy, s.fold_std, [s.tar[far] for far in FARS]]
        accuracy, fold_std, tars = cache[path.name]
        results.append((int(path.stem.split("-")[1]),
                        Score(accuracy, fold_std, dict(zip(FARS, tars)))))
    cache_path.write_text(json.dumps({"pairs": pairs, "scores": cache}))
    return results


def difference(ours: list[float], anchor: list[float]) -> str:
    """Difference of the means and its standard error, each arm's seeds taken as
    independent; then paired by seed (both toolkits of a seed train on the same data,
    so the per-seed differences vary less). `ours[i]` and `anchor[i]` share a seed."""
    gap = statistics.mean(ours) - statistics.mean(anchor)
    if len(ours) < 2:
        return f"{gap:+.4f} (one seed)"
    error = math.sqrt(statistics.variance(ours) / len(ours)
                      + statistics.variance(anchor) / len(anchor))
    paired = [a - b for a, b in zip(ours, anchor)]
    paired_error = statistics.stdev(paired) / math.sqrt(len(paired))
    return f"{gap:+.4f} ± {error:.4f} (paired ± {paired_error:.4f})"


METRICS = {"accuracy": lambda s: s.accuracy, "TAR@FAR=1e-3": lambda s: s.tar[1e-3],
           "TAR@FAR=1e-4": lambda s: s.tar[1e-4]}


def baseline_of(name: str) -> str | None:
    """The arm `name` is compared with: ours with arcface_torch at the same power (the
    noisy-label arms with NOISY_BASELINE, ours-exact-gemm16 with ours-exact); an
    arcface_torch diagnostic with arcface_torch itself."""
    arm = ARMS[name]
    if "pfc_gemm" in arm.changes:  # the same training with other GEMM inputs
        return "ours-exact"
    noisy = ("interclass_filtering_threshold" in arm.changes or "num_subcenters" in arm.changes
             or arm.cleaned_from)
    if arm.toolkit == "ours" and noisy:
        return NOISY_BASELINE
    if arm.toolkit == "ours":
        return "arcface_torch" if arm.power == 2.0 else "arcface_torch-power1"
    return "arcface_torch" if name != "arcface_torch" and arm.power == 2.0 else None


def paired_ends(ours: list[Result], anchor: list[Result]) -> tuple[list[Score], list[Score]]:
    """The end-of-run scores of the seeds both arms finished, in the same seed order."""
    mine = {result.seed: result.scores[-1][1] for result in ours}
    theirs = {result.seed: result.scores[-1][1] for result in anchor}
    seeds = sorted(mine.keys() & theirs.keys())
    return [mine[seed] for seed in seeds], [theirs[seed] for seed in seeds]


def table(cells: dict, arms: list[str]) -> str:
    """One row per (classes, rate, arm): the end-of-run scores, mean ± std over seeds;
    then each arm minus the one it is compared with (baseline_of), over the seeds both
    finished (a seed one arm has not finished yet would bias the difference)."""
    rows = ["| classes | sample_rate | arm | seeds | " + " | ".join(METRICS)
            + " | minutes per run | ms/step |", "|---" * (6 + len(METRICS)) + "|"]
    for (classes, rate), by_arm in cells.items():
        ran = [name for name in arms if name in by_arm]
        for name in ran:
            results = by_arm[name]
            ends = [r.scores[-1][1] for r in results]
            rows.append(f"| {classes:,} | {rate:g} | {name} | {len(results)} | "
                        + " | ".join(mean_std([f(s) for s in ends]) for f in METRICS.values())
                        + f" | {statistics.mean(r.minutes for r in results):.1f} | "
                        f"{statistics.mean(r.ms_per_step for r in results):.0f} |")
        for name in ran:
            baseline = baseline_of(name)
            ours, anchor = paired_ends(by_arm[name], by_arm.get(baseline, []))
            if not ours:
                continue
            gaps = [difference([f(s) for s in ours], [f(s) for s in anchor])
                    for f in METRICS.values()]
            rows.append(f"| {classes:,} | {rate:g} | {name} − {baseline} | {len(ours)} | "
                        + " | ".join(gaps) + " | | |")
    return "\n".join(rows)


def figure_name(kind: str, classes: int, rate: float) -> str:
    """The scale task's figures keep the names docs/parity.md shows; the images task's
    are named apart, since both tasks have a 3,000-identity cell."""
    return f"{'' if kind == 'latent' else kind + '-'}c{classes}-r{rate:g}.png"


def plot(cells: dict, arms: list[str], folder: Path, kind: str) -> None:
    """TAR@FAR=1e-3 and accuracy along the run, each arm's mean over the seeds it
    finished (their number in the legend: arms half run are not alike), one figure
    per (classes, rate) where an arm has finished (an empty figure would replace one
    that docs/parity.md shows)."""
    from ..evaluation.drawing import pyplot

    plt = pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    for (classes, rate), by_arm in cells.items():
        ran = [name for name in arms if name in by_arm]
        if not ran:
            continue
        figure, axes = plt.subplots(1, 2, figsize=(10, 4))
        for name in ran:
            runs = by_arm[name]
            steps = [step for step, _ in runs[0].scores]
            label = f"{name} ({len(runs)} seed{'s' if len(runs) > 1 else ''})"
            for axis, metric in zip(axes, ("accuracy", "TAR@FAR=1e-3")):
                curve = np.mean([[METRICS[metric](s) for _, s in r.scores] for r in runs], 0)
                axis.plot(steps, curve, marker="o", label=label)
                axis.set_xlabel("step")
                axis.set_title(f"{metric}, {'scale' if kind == 'latent' else kind}, "
                               f"C = {classes:,}, r = {rate:g}")
        axes[0].legend()
        figure.tight_layout()
        figure.savefig(folder / figure_name(kind, classes, rate), dpi=80)
        plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m partial_fc_mx.parity",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--classes", type=int, nargs="+", default=[3000])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 0.1])
    parser.add_argument("--arms", nargs="+", default=["ours-exact", "arcface_torch"],
                        choices=sorted(ARMS))
    parser.add_argument("--kind", choices=KINDS, default="latent",
                        help="the scale task's vectors or the images task's pictures")
    parser.add_argument("--network", choices=BACKBONES, default="mbf",
                        help="the images task's backbone (the scale task trains an MLP)")
    parser.add_argument("--per-class", type=int, default=8)
    parser.add_argument("--noise", default="", metavar="KIND",
                        help="label noise of the training samples, e.g. flips0.4 or "
                        "splits0.3 (parity/noise.py); the held-out identities stay clean")
    parser.add_argument("--epochs", type=int,
                        help=f"default: {Recipe.epochs} (scale task), "
                        f"{IMAGES_RECIPE['epochs']} (images)")
    parser.add_argument("--np", type=int, default=2, help="processes per run")
    parser.add_argument("--work", type=Path, default=Path("work_dirs/parity"))
    parser.add_argument("--arcface-torch", type=Path,
                        help="the recognition/arcface_torch folder of an insightface checkout")
    parser.add_argument("--torch-python", type=Path,
                        help="the python of an environment with torch (CPU) and numpy")
    parser.add_argument("--plot", type=Path, metavar="DIR", help="also draw the curves")
    parser.add_argument("--report", action="store_true",
                        help="train nothing: tables of the runs that finished")
    args = parser.parse_args(argv)
    work = args.work.resolve()
    cells: dict = {}
    for classes in args.classes:
        for rate in args.rates:
            by_arm = cells.setdefault((classes, rate), {})
            for seed in dict.fromkeys(args.seeds):  # a seed given twice runs once
                task = write_task(task_of(args.kind, classes, args.per_class, seed,
                                          args.noise), work / "data")
                for name in args.arms:
                    arm = ARMS[name]
                    started = time.perf_counter()
                    trained_on = task_of_arm(arm, task, work, rate, seed, args)
                    result = run_arm(arm, arm_recipe(arm, Recipe(
                        trained_on, arm_folder(work, task, name, rate, args)), seed, rate,
                        args), args)
                    if result is None:
                        print(f"C={classes} r={rate:g} seed {seed} {name}: not run yet")
                        continue
                    by_arm.setdefault(name, []).append(result)
                    end = result.scores[-1][1]
                    print(f"C={classes} r={rate:g} seed {seed} {name}: accuracy "
                          f"{end.accuracy:.4f}, TAR@1e-3 {end.tar[1e-3]:.4f}, TAR@1e-4 "
                          f"{end.tar[1e-4]:.4f} ({result.minutes:.1f} min to train; "
                          f"{(time.perf_counter() - started) / 60:.1f} min here)", flush=True)
                    if arm.cleaned_from:
                        print(f"  {cleaning_line(trained_on)}")
    print(table(cells, args.arms))
    if args.plot:
        plot(cells, args.arms, args.plot, args.kind)
    return 0


if __name__ == "__main__":
    sys.exit(main())
