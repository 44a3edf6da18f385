"""arcface_torch's arm of the parity study: the recipe (recipe.py) trained as its
train_v2.py trains, with its own modules loaded from an insightface checkout
unmodified (PartialFC_V2, CombinedMarginLoss, PolynomialLRWarmup): one torch SGD
(momentum, weight decay) over the network and the centres, the network in
DistributedDataParallel, the backbone's gradient clipped at norm 5, every rank seeded
alike (train_v2.py's setup_seed); on the images task, the backbone its own
`get_model` builds, as train_v2.py calls it. Only the data (task.py's arrays, in our
loader's order) and the scale task's MLP are the study's. Runs in a torch
environment (CPU, gloo) that has no MXNet:

    PYTHONPATH=<this repository> torch-venv/bin/torchrun --nproc-per-node 2 \\
        -m partial_fc_mx.parity.anchor --arcface-torch insightface/recognition/arcface_torch \\
        --task DIR --out DIR --sample-rate 0.1
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from .. import durable
from ..bench.anchor import load_reference
from ..pfc.threads import rank_threads
from ..tools.anchor_shapes import anchor_get_model
from . import resume
from .recipe import (
    Recipe,
    add_arguments,
    check_network,
    evaluation_steps,
    from_args,
    recipe_wherever,
    write_log,
)
from .task import INPUT, as_input, input_batches, load_task, rank_rows, steps_per_epoch

FILES = ("partial_fc_v2.py", "losses.py", "lr_scheduler.py")


def mlp(torch, recipe: Recipe):
    """The study's network (recipe.py): torch's default nn.Linear initialisation is
    the +-1/sqrt(fan_in) uniform ours draws (kaiming_uniform with a = sqrt(5))."""
    layers, fan_in = [], INPUT
    for width in (recipe.hidden, recipe.hidden):
        layers += [torch.nn.Linear(fan_in, width, bias=False), torch.nn.BatchNorm1d(width),
                   torch.nn.PReLU(width)]
        fan_in = width
    layers += [torch.nn.Linear(fan_in, recipe.embedding_size, bias=False),
               torch.nn.BatchNorm1d(recipe.embedding_size)]
    return torch.nn.Sequential(*layers)


def network(torch, recipe: Recipe, arcface_torch: Path):
    """The MLP, or arcface_torch's backbone as train_v2.py builds it (float32)."""
    if recipe.network == "mlp":
        return mlp(torch, recipe)
    return anchor_get_model(arcface_torch)(recipe.network, dropout=0.0, fp16=False,
                                           num_features=recipe.embedding_size)


def embed(torch, module, rows: np.ndarray, batch: int) -> np.ndarray:
    """The held-out embeddings in eval mode (task.input_batches, as ours.embed)."""
    module.eval()
    with torch.no_grad():
        embeddings = np.concatenate([module(torch.from_numpy(inputs)).numpy()
                                     for inputs in input_batches(rows, batch)])
    module.train()
    return embeddings


def accept_verbose(torch) -> None:
    """arcface_torch's lr_scheduler.py passes `verbose` (only printing) to the base
    class, which torch removed after 2.6: where it is gone, the legacy base class its
    PolynomialLRWarmup derives from takes the word and drops it, so their file runs
    unchanged."""
    legacy = torch.optim.lr_scheduler._LRScheduler
    if "verbose" in inspect.signature(torch.optim.lr_scheduler.LRScheduler.__init__).parameters:
        return
    base = legacy.__init__

    def init(self, optimizer, last_epoch=-1, verbose=False):
        base(self, optimizer, last_epoch=last_epoch)

    legacy.__init__ = init


def step_with_rate_inside(torch, optimizer) -> None:
    """torch's SGD step as MXNet's: each gradient and the weight decay scaled by the
    step's rate, the step taken at rate 1, so the momentum accumulates lr (g + wd w)
    (the diagnostic arm arcface_torch-mxnet-momentum; the scheduler's rates stay)."""
    saved = [(group["lr"], group["weight_decay"]) for group in optimizer.param_groups]
    for group, (lr, decay) in zip(optimizer.param_groups, saved):
        for parameter in group["params"]:
            if parameter.grad is not None:
                parameter.grad.mul_(lr)
        group["lr"], group["weight_decay"] = 1.0, lr * decay
    optimizer.step()
    for group, (lr, decay) in zip(optimizer.param_groups, saved):
        group["lr"], group["weight_decay"] = lr, decay


def exact_arcface(torch, scale: float, margin: float):
    """The diagnostic arm arcface_torch-exact-margin: CombinedMarginLoss's values for
    ArcFace (s cos(theta + m) on the target, s cos theta elsewhere; its labels of -1 mark
    the rows whose class another rank holds), with the derivative of the margin, where
    the original computes it under no_grad: s sin(theta + m) / sin(theta) on the
    target, s elsewhere, as autograd through clamp, acos and cos gives it (0 at the
    clamp's bounds and past them: torch's clamp passes none there). Past theta = pi - m
    it follows cos as the original does (ours continues along a line there: rare after
    the first steps).

    One autograd step over the whole logits (a pass forward, one back, as the
    original's `logits * s`): written as indexing under autograd, its backward filled
    and added whole copies of them, and the arm's tenths at 100,000 identities, r = 1.0
    took 36-46 minutes against the arm as it ships' 26.5-30 (docs/parity.md)."""

    class ExactArcFace(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, rows, columns):
            cosine = logits[rows, columns]
            bound = 1 - 1e-7
            held = cosine.clamp(-bound, bound)
            scaled = logits * scale
            scaled[rows, columns] = torch.cos(torch.acos(held) + margin) * scale
            ctx.save_for_backward(rows, columns, held, cosine.abs() < bound)
            return scaled

        @staticmethod
        def backward(ctx, grad):
            rows, columns, held, inside = ctx.saved_tensors
            slope = torch.sin(torch.acos(held) + margin) * (1 - held * held).rsqrt()
            grad_logits = grad * scale
            grad_logits[rows, columns] *= slope * inside
            return grad_logits, None, None

    def apply(logits, labels):
        rows = torch.where(labels != -1)[0]
        return ExactArcFace.apply(logits, rows, labels[rows].view(-1))

    return apply


def trained_by(torch, recipe: Recipe, arcface_torch: Path) -> dict[str, str]:
    """What a saved state was trained by: the recipe (wherever its folder is now), torch,
    and the code (arcface_torch's files and this one). A run goes on only from a state
    of the same."""
    code = hashlib.sha256()
    for path in [arcface_torch.resolve() / name for name in FILES] + [Path(__file__)]:
        code.update(path.read_bytes())
    return {"recipe": json.dumps(recipe_wherever(recipe)), "torch": str(torch.__version__),
            "code": code.hexdigest()}


def save_state(torch, distributed, out: Path, step: int, parts: dict, progress: dict) -> None:
    """Every rank's training state at `step` (resume.py), the random generator's too
    (PartialFC_V2 draws its negatives from it): a run started again goes on from here
    as if it had not stopped. Written whole (flushed to disk, then renamed); the older
    files go once every rank has written."""
    rank = distributed.get_rank()
    state = {name: part.state_dict() for name, part in parts.items()}
    state |= {"rng": torch.get_rng_state(), **progress}
    durable.write_atomically(resume.state_file(out, step, rank),
                             lambda partial: torch.save(state, partial))
    distributed.barrier()
    resume.remove(out, rank, keep=step)


def go_on_from(torch, distributed, out: Path, parts: dict, trained: dict) -> dict:
    """The progress ({"step", "losses", "seconds", "wall", "resumed_at"}) of the latest
    state every rank saved in `out`, loaded into `parts` and the random generator;
    from the beginning if none. A state that does not load or was trained by another
    recipe or code stops every rank with the file to remove. Loaded with weights_only:
    a state file holds tensors, numbers and text, never code."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    step, problem, state = resume.latest_complete(out, world), "", None
    path = resume.state_file(out, step, rank)
    if step:
        try:
            state = torch.load(path, weights_only=True)
            differs = [key for key, value in trained.items() if state.get(key) != value]
            problem = f"it was trained by another {' and '.join(differs)}" if differs else ""
        except Exception as error:  # a damaged file: its rank says so, every rank stops
            problem = f"it does not load ({type(error).__name__}: {error})"
    agreed = torch.tensor([step, -step, bool(problem)])
    distributed.all_reduce(agreed, op=distributed.ReduceOp.MAX)
    if problem:
        raise SystemExit(f"rank {rank}: cannot go on from {path}: {problem}; remove the "
                         f"resume-*.pt files in {out} to train this run from the beginning")
    if agreed[0] != -agreed[1] or agreed[2]:
        raise SystemExit(f"rank {rank}: another rank cannot go on from step {step} in {out} "
                         "(its message says why)")
    resume.remove(out, rank, keep=step)  # a later, incomplete set of an earlier start
    if state is None:
        return {"step": 0, "losses": [], "seconds": [], "wall": 0.0, "resumed_at": []}
    for name, part in parts.items():
        part.load_state_dict(state[name])
    torch.set_rng_state(state["rng"])
    print(f"rank {rank}: going on from step {step} ({path})", flush=True)
    return {key: state[key] for key in ("losses", "seconds", "wall")} | {
        "step": step, "resumed_at": [*state["resumed_at"], step]}


def train(recipe: Recipe, arcface_torch: Path) -> None:
    reference = load_reference(arcface_torch, FILES)  # before any collective: fails alike
    data = load_task(recipe.task)
    x, y = data["train_x"], data["train_y"]
    check_network(recipe, x.ndim)
    import torch
    from torch import distributed

    distributed.init_process_group("gloo")  # torchrun's environment
    rank, world = distributed.get_rank(), distributed.get_world_size()
    torch.set_num_threads(rank_threads())
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # the reference moves tensors
    torch.manual_seed(recipe.seed)  # train_v2.py's setup_seed: every rank alike
    num_classes = int(y.max()) + 1
    backbone = torch.nn.parallel.DistributedDataParallel(
        network(torch, recipe, arcface_torch), broadcast_buffers=False)
    margin = reference["losses"].CombinedMarginLoss(64, 1.0, 0.5, 0.0,
                                                    recipe.interclass_filtering_threshold)
    if recipe.margin_gradient == "exact":
        margin = exact_arcface(torch, 64.0, 0.5)
    if recipe.seeding == "per-rank":
        torch.manual_seed(recipe.seed + rank)
    pfc = reference["partial_fc_v2"].PartialFC_V2(margin, recipe.embedding_size, num_classes,
                                                  recipe.sample_rate, False)
    optimizer = torch.optim.SGD([{"params": backbone.parameters()},
                                 {"params": pfc.parameters()}], lr=recipe.lr,
                                momentum=recipe.momentum, weight_decay=recipe.weight_decay)
    global_batch = recipe.batch_size * world
    per_epoch = steps_per_epoch(len(y), global_batch)
    total = per_epoch * recipe.epochs
    accept_verbose(torch)
    scheduler = reference["lr_scheduler"].PolynomialLRWarmup(optimizer, warmup_iters=0,
                                                             total_iters=total,
                                                             power=recipe.power)
    evaluate_at = evaluation_steps(total, recipe.evaluations)
    parts = {"backbone": backbone.module, "centers": pfc, "optimizer": optimizer,
             "scheduler": scheduler}
    trained = trained_by(torch, recipe, arcface_torch)
    progress = go_on_from(torch, distributed, recipe.out, parts, trained)
    step, losses, seconds = progress["step"], progress["losses"], progress["seconds"]
    started = time.perf_counter() - progress["wall"]
    for epoch in range(step // per_epoch, recipe.epochs):
        batches = rank_rows(len(y), global_batch, recipe.seed, epoch, rank, world)
        for rows in batches[step - epoch * per_epoch:]:
            begin = time.perf_counter()
            labels = torch.from_numpy(np.asarray(y[rows]))  # a copy: pfc rewrites it
            loss = pfc(backbone(torch.from_numpy(as_input(x[rows]))), labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(backbone.parameters(), recipe.clip_grad)
            if recipe.momentum_form == "mxnet":
                step_with_rate_inside(torch, optimizer)
            else:
                optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            losses.append(loss.item())
            seconds.append(time.perf_counter() - begin)
            step += 1
            if step in evaluate_at:
                if rank == 0:
                    np.save(recipe.out / f"embeddings-{step:06d}.npy",
                            embed(torch, backbone.module, data["heldout_x"],
                                  recipe.batch_size))
                save_state(torch, distributed, recipe.out, step, parts,
                           trained | {"losses": losses, "seconds": seconds,
                                      "wall": time.perf_counter() - started,
                                      "resumed_at": progress["resumed_at"]})
    if rank == 0:
        write_log(recipe, "arcface_torch", losses, seconds, time.perf_counter() - started,
                  total, resumed_at=progress["resumed_at"])
    distributed.barrier()
    resume.remove(recipe.out, rank)
    distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m partial_fc_mx.parity.anchor",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--arcface-torch", type=Path, required=True,
                        help="the recognition/arcface_torch folder of an insightface checkout")
    add_arguments(parser)
    args = parser.parse_args(argv)
    recipe = replace(from_args(args), center_update="dense")  # torch's SGD: every row
    if recipe.num_subcenters != 1:
        raise SystemExit("arcface_torch has no sub-center ArcFace: --num-subcenters 1")
    if recipe.margin_gradient == "exact" and recipe.interclass_filtering_threshold:
        raise SystemExit("--margin-gradient exact replaces CombinedMarginLoss, whose filter "
                         "--interclass-filtering-threshold is: one or the other")
    recipe.out.mkdir(parents=True, exist_ok=True)
    train(recipe, args.arcface_torch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
