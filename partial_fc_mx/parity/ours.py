"""Our arm of the parity study: the recipe (recipe.py) trained with this toolkit's own
step, `train.train_step` (the trainer's: Partial FC's forward and backward, the
backbone's Horovod-averaged update with its gradient clipped, the centres' update),
its classifier as the trainer builds it from a config, its learning-rate schedule
(run/schedule.py), its backbone optimizer and, on the images task, its backbone as
the trainer builds and initialises it (float32); only the data (task.py's arrays in
our loader's order) and the scale task's MLP are the study's. Started again on the
folder of an interrupted run, it goes on from its last evaluation (ours_resume.py).

    mpirun -np 2 python -m partial_fc_mx.parity.ours --task DIR --out DIR --sample-rate 0.1
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import SimpleNamespace

import mxnet as mx
import numpy as np
from mxnet.gluon import nn

from .. import dist
from ..backbones.iresnet import prelu
from ..config import Config
from ..data.loader import Batch
from ..errors import UserError
from ..evaluation.validator import Validator
from ..pfc.centers import ClassCenters
from ..run.precision import LossScaler, build_backbone, training_model
from ..run.schedule import Schedule
from ..train import agreed_gemm, build_classifier, make_trainer, train_step
from . import ours_resume, resume
from .recipe import Recipe, check_network, evaluation_steps, parse, write_log
from .task import INPUT, as_input, input_batches, load_task, rank_rows, run_steps


def mlp(recipe: Recipe) -> nn.HybridSequential:
    """The study's network (recipe.py), its Linear weights uniform in +-1/sqrt(fan_in)."""
    net = nn.HybridSequential()
    fan_in = INPUT
    for width in (recipe.hidden, recipe.hidden):
        net.add(dense(width, fan_in), nn.BatchNorm(in_channels=width), prelu(width))
        fan_in = width
    net.add(dense(recipe.embedding_size, fan_in),
            nn.BatchNorm(in_channels=recipe.embedding_size))
    return net


def dense(width: int, fan_in: int) -> nn.Dense:
    return nn.Dense(width, use_bias=False, in_units=fan_in,
                    weight_initializer=mx.init.Uniform(1 / np.sqrt(fan_in)))


def network(recipe: Recipe, config: Config, ctx: mx.Context) -> tuple:
    """(net, model): the MLP, initialised, or the backbone as the trainer builds it; and
    what trains it: its graph with the CPU's PReLU kernel (recipe.prelu "kernel", as the
    trainer's), or itself, with MXNet's LeakyReLU ("mxnet")."""
    if recipe.network != "mlp":
        net = build_backbone(config, ctx)[0]
    else:
        net = mlp(recipe)
        net.initialize(ctx=ctx)
        net.hybridize(static_alloc=True)
        net(mx.nd.zeros((2, INPUT), ctx=ctx))
    return net, training_model(net, ctx, "float32") if recipe.prelu == "kernel" else net


def parts(recipe: Recipe, config: Config, world: dist.World, ctx: mx.Context,
          gemm_dtype: str) -> tuple:
    """(net, model), trainer, classifier: local work only, which builds and loads the
    CPU kernels (Partial FC's, and the PReLU's with recipe.prelu "kernel") and can fail
    on one host and not another; run under dist.run_agreed, as the trainer's start-up,
    so that every rank stops together instead of one waiting in the first collective."""
    net, model = network(recipe, config, ctx)
    return (net, model), make_trainer(config, net), build_classifier(config, world, ctx,
                                                                     gemm_dtype=gemm_dtype)


def embed(net, rows: np.ndarray, batch: int, ctx: mx.Context) -> np.ndarray:
    """The held-out embeddings (task.input_batches)."""
    return np.concatenate([net(mx.nd.array(inputs, ctx=ctx)).asnumpy()
                           for inputs in input_batches(rows, batch)])


def recipe_config(recipe: Recipe, num_classes: int) -> Config:
    """The trainer's config for `recipe` (ArcFace s = 64, m = 0.5; SGD), validated."""
    config = Config(num_classes=num_classes, embedding_size=recipe.embedding_size,
                    sample_rate=recipe.sample_rate, batch_size=recipe.batch_size,
                    lr=recipe.lr, momentum=recipe.momentum,
                    weight_decay=recipe.weight_decay, clip_grad=recipe.clip_grad,
                    center_update=recipe.center_update, seed=recipe.seed,
                    margin_list=(1.0, 0.5, 0.0), scale=64.0, num_epoch=recipe.epochs,
                    lr_power=recipe.power,
                    interclass_filtering_threshold=recipe.interclass_filtering_threshold,
                    num_subcenters=recipe.num_subcenters, pfc_gemm=recipe.pfc_gemm,
                    **({} if recipe.network == "mlp" else {"network": recipe.network}))
    config.validate()
    return config


def train(recipe: Recipe, watch: Callable[[ClassCenters], None] | None = None) -> None:
    """Train `recipe`; `watch` is given the classifier's centers before its first step
    (center_trace.py records their updates)."""
    if (recipe.momentum_form, recipe.seeding, recipe.margin_gradient) != ("own", "alike",
                                                                          "own"):
        raise SystemExit("--momentum-form, --seeding and --margin-gradient are "
                         "arcface_torch's diagnostics: ours is MXNet's SGD, draws each "
                         "class's centre from its id and differentiates its margin")
    data = load_task(recipe.task)
    x, y = data["train_x"], data["train_y"]
    check_network(recipe, x.ndim)
    world, ctx = dist.init(), mx.cpu()
    config = recipe_config(recipe, int(y.max()) + 1)
    config.check_world_size(world.size)
    mx.random.seed(recipe.seed)
    gemm = agreed_gemm(config, ctx)  # as the trainer's start-up chooses them
    (net, model), trainer, pfc = dist.run_agreed(
        lambda: parts(recipe, config, world, ctx, gemm.dtype), "parity.start", (UserError,),
        UserError,
        "the parity arm's start-up")
    dist.broadcast_parameters(net.collect_params(), root_rank=0)
    run = SimpleNamespace(trainer=trainer, scaler=LossScaler(False), ctx=ctx, model=model,
                          net=net, world=world, config=config, pfc=pfc,
                          validator=Validator([], resume.ours_folder(recipe.out)))
    trained = dist.allgather_object(ours_resume.trained_by(recipe, world.size),
                                    name="parity.trained")[0]  # rank 0's, its code loaded
    state, progress = ours_resume.go_on_from(run, recipe, trained)
    if watch is not None:
        watch(pfc.centers)
    losses, seconds = progress["losses"], progress["seconds"]
    global_batch = recipe.batch_size * world.size
    schedule = Schedule.of(len(y), global_batch, recipe.epochs, 0, 0.0, [], config.lr_power)
    total = run_steps(len(y), global_batch, recipe.epochs)
    evaluate_at = evaluation_steps(total, recipe.evaluations)
    started = time.perf_counter() - progress["wall"]
    for epoch in range(state.epoch, recipe.epochs):
        batches = rank_rows(len(y), global_batch, recipe.seed, epoch, world.rank, world.size)
        for rows in batches[state.images_in_epoch // global_batch:]:
            lr = schedule.learning_rate(config.lr, schedule.position(state.epoch,
                                                                     state.images_in_epoch))
            begin = time.perf_counter()
            batch = Batch(mx.nd.array(as_input(x[rows]), ctx=ctx), np.asarray(y[rows]))
            losses.append(train_step(run, batch, lr))
            seconds.append(time.perf_counter() - begin)
            state.step += 1
            state.advance(global_batch, len(y))
            if state.step in evaluate_at:
                if world.is_main:
                    np.save(recipe.out / f"embeddings-{state.step:06d}.npy",
                            embed(net, data["heldout_x"], recipe.batch_size, ctx))
                if state.step < total:
                    ours_resume.save(run, recipe, state, {
                        "losses": losses, "seconds": seconds, "resumed_at":
                        progress["resumed_at"], "wall": time.perf_counter() - started},
                        trained)
    if recipe.num_subcenters > 1:  # what the study's cleaning reads (parity/cleaned.py)
        save_for_cleaning(recipe, net, pfc, x, world, ctx)
    if world.is_main:
        write_log(recipe, "ours", losses, seconds, time.perf_counter() - started, total,
                  resumed_at=progress["resumed_at"])
        resume.clear(recipe.out)


def save_for_cleaning(recipe: Recipe, net, pfc, train_x: np.ndarray, world: dist.World,
                      ctx: mx.Context) -> None:
    """The trained model's embeddings of the training samples and every rank's
    sub-centers (C K x D, class by class), as rank 0's .npy files beside the log."""
    shards = dist.allgather_object(pfc.centers.state_dict()["weight"], name="parity.centers")
    if world.is_main:
        np.save(recipe.out / CLEANING_FILES[0], embed(net, train_x, 4096, ctx))
        np.save(recipe.out / CLEANING_FILES[1], np.concatenate(shards))


CLEANING_FILES = ("train_embeddings.npy", "subcenters.npy")
"""What a sub-center arm leaves for the cleaning arm (parity/cleaned.py)."""


def main(argv: list[str] | None = None) -> int:
    recipe = parse(argv, "python -m partial_fc_mx.parity.ours", __doc__.split("\n\n")[0])
    recipe.out.mkdir(parents=True, exist_ok=True)
    train(recipe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
