"""What both arms train: one argument parser, so that an arm of either toolkit is
started with the same words and cannot drift from the other.

On the images task the network is a face backbone both toolkits name alike (`mbf`, r18
... r200; issue 38 made their layers the same), each built and initialised by its own
toolkit, as a user of either gets it. On the scale task it is a small MLP written the
same way in both toolkits: Linear (no bias) -> BatchNorm -> PReLU (per channel),
twice, then Linear (no bias) -> BatchNorm as the embedding (the shape of a face
backbone's head). Its Linear weights start uniform in +-1/sqrt(fan_in) in both
(torch's default for nn.Linear; MXNet's is not), BatchNorm at gamma 1, beta 0, PReLU
slopes at 0.25. The classifier is each toolkit's own: ArcFace (s = 64, m = 0.5) over
class centres drawn N(0, 0.01), SGD with momentum and weight decay on the network and
the centres, polynomial decay of the learning rate to zero from the first step, the
backbone's gradient clipped at norm 5 (arcface_torch's train_v2.py does so always;
ours with clip_grad = 5)."""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from .. import durable
from ..tools.anchor_shapes import NAMES as BACKBONES


@dataclass(frozen=True)
class Recipe:
    task: Path
    """A folder task.write_task made."""
    out: Path
    seed: int = 0
    sample_rate: float = 1.0
    epochs: int = 10
    batch_size: int = 128
    """Per process."""
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    embedding_size: int = 128
    hidden: int = 512
    clip_grad: float = 5.0
    power: float = 2.0
    """Of the polynomial decay: our default (config lr_power) is 2; arcface_torch's
    PolynomialLRWarmup defaults to 1 (train_v2.py does not set it)."""
    center_update: str = "exact"
    """Ours only: "exact", "lazy" or "dense". arcface_torch's dense SGD is "dense"."""
    momentum_form: str = "own"
    """arcface_torch only: "mxnet" makes its SGD take the rate inside the momentum, as
    MXNet's does (m <- mu m - lr (g + wd w); w <- w + m), where torch's applies it
    after (m <- mu m + g + wd w; w <- w - lr m); the two agree only at a constant rate."""
    seeding: str = "alike"
    """arcface_torch only: "alike" seeds every rank with the seed, as train_v2.py's
    setup_seed does, so that each rank's shard of centres starts as the same random
    matrix (class j of rank 0 and of rank 1 alike); "per-rank" seeds rank r with seed + r
    before the centres are drawn. Ours draws every class's centre from (seed, class)."""
    margin_gradient: str = "own"
    """arcface_torch only: its CombinedMarginLoss applies the ArcFace margin under
    torch.no_grad, so the gradient of every logit, the target's too, is s times that of
    the plain cosine; "exact" gives its arm the derivative of s cos(theta + m), as ours
    computes (pfc/margins/combined.py)."""
    prelu: str = "mxnet"
    """Ours only: "mxnet" computes PReLU with MXNet's LeakyReLU, whose slopes' gradient
    in this MLP's compiled graph comes out as the true one times the slopes (a quarter of
    it at 0.25; tests/test_cpu_kernels.py); "kernel" with the kernel the trainer uses on a
    CPU (run/cpu_kernels.py), as arcface_torch's autograd: the true gradient. The scale
    task's runs of ours before 2026-11-26 are "mxnet", the default, so that they are
    reused as what they trained."""
    evaluations: int = 10
    """Held-out embeddings written this many times along the run (the curves)."""
    network: str = "mlp"
    """"mlp" for the scale task; a backbone both toolkits build (BACKBONES) for images."""
    interclass_filtering_threshold: float = 0.0
    """Both: arcface_torch's inter-class filtering (its CombinedMarginLoss's; ours the
    config key of the same name); 0: off."""
    num_subcenters: int = 1
    """Ours only: sub-center ArcFace's rows per class (config num_subcenters)."""
    pfc_gemm: str = "float32"
    """Ours only: the classifier GEMMs' inputs (config pfc_gemm): "bfloat16" where the
    CPU computes it (refused elsewhere)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True,
                        help="where rank 0 writes the held-out embeddings and the log")
    for name, value in vars(Recipe(Path(), Path())).items():
        if name not in ("task", "out"):
            parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value,
                                choices=CHOICES.get(name))


CHOICES = {"center_update": ("exact", "lazy", "dense"), "momentum_form": ("own", "mxnet"),
           "seeding": ("alike", "per-rank"), "margin_gradient": ("own", "exact"),
           "prelu": ("mxnet", "kernel"), "pfc_gemm": ("float32", "bfloat16"),
           "network": ("mlp", *BACKBONES)}


def check_network(recipe: Recipe, train_x_dims: int) -> None:
    """Refuse a network that cannot read the task (every rank alike, before any
    collective): the MLP reads the scale task's vectors, a backbone images."""
    reads_images = recipe.network != "mlp"
    if reads_images != (train_x_dims == 4):
        wanted = "an images task" if reads_images else "the scale (latent) task"
        raise SystemExit(f"--network {recipe.network} trains on {wanted}; {recipe.task} "
                         f"holds {'images' if train_x_dims == 4 else 'vectors'}")


def from_args(args: argparse.Namespace) -> Recipe:
    return Recipe(**{name: getattr(args, name) for name in Recipe.__dataclass_fields__})


def command_line(recipe: Recipe) -> list[str]:
    """The arguments that make `recipe` again (the study launches arms with them)."""
    words = []
    for name, value in vars(recipe).items():
        words += [f"--{name.replace('_', '-')}", str(value)]
    return words


def parse(argv: list[str] | None, prog: str, description: str) -> Recipe:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    return from_args(parser.parse_args(argv))


def evaluation_steps(total_steps: int, count: int) -> list[int]:
    """The steps after which the held-out embeddings are written: `count` of them,
    evenly spread, the last step included."""
    return sorted({max(1, round(total_steps * (k + 1) / count)) for k in range(count)})


def recipe_record(recipe: Recipe) -> dict[str, str]:
    """The recipe as the study's json files keep it (compared by same_recipe)."""
    return {name: str(value) for name, value in vars(recipe).items()}


def recipe_wherever(recipe: Recipe) -> dict[str, str]:
    """recipe_record without the run's folder: what a resumed run must share with the
    start that saved its state (a run's folder moved elsewhere, its task's where it
    was, goes on)."""
    return {name: value for name, value in recipe_record(recipe).items() if name != "out"}


def same_recipe(saved: dict, recipe: Recipe) -> bool:
    """Whether a run whose files keep `saved` (recipe_record) trained `recipe`. A field
    the record lacks (added to the recipe since) counts as its default, which is what
    such a run trained."""
    defaults = {name: str(field.default) for name, field in Recipe.__dataclass_fields__.items()}
    return {**defaults, **saved} == recipe_record(recipe)


def write_log(recipe: Recipe, toolkit: str, losses: list[float], seconds: list[float],
              wall: float, total: int, resumed_at: list[int] | None = None) -> None:
    """log.json beside the embeddings: written last, so its presence marks a finished
    arm. The loss every 10 steps (the global batch's mean over the sampled classes);
    the steps an interrupted run went on from (its minutes add up its starts)."""
    log = {"toolkit": toolkit, "recipe": recipe_record(recipe),
           "steps": total, "minutes": wall / 60,
           "ms_per_step": 1000 * statistics.median(seconds), "loss": losses[::10],
           "resumed_at": resumed_at or []}
    durable.write_atomically(recipe.out / "log.json",  # never a half-written log
                             lambda path: path.write_text(json.dumps(log)))
