"""The trainer users launch: `horovodrun -np N -H ... bash config.sh` or `bash run.sh`.

One process per GPU (or CPU slot). Per step:
  images of this rank's shard --> backbone (Horovod-averaged gradients) --> embeddings
  --> Partial FC (all-gathers every rank's embeddings; exact margin softmax over the
  sampled centers) --> loss and d loss / d embeddings --> backbone backward
  --> backbone update (SGD) and sparse update of the sampled centers.
The loss is the mean over the global batch, so the true backbone gradient is the
SUM of the ranks' gradients; Horovod averages, and the update rescales by W.

Progress is kept in images (schedule.py), so a run resumed on another number of
processes covers the same epochs with the same learning rate at each point.
Anything that can go wrong on one rank only (a file, a bad value) is agreed on
before the next collective, so every rank stops with the same message.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import horovod.mxnet as hvd
import mxnet as mx
import numpy as np

from . import dist
from .config import Config
from .data import DataError
from .data.device import on_device
from .data.joined import JoinedDataset
from .data.loader import Batch, FaceLoader, RandomLoader, in_step
from .data.recordio import RecordDataset
from .errors import UserError
from .evaluation.baseline import eigenfaces_accuracy
from .evaluation.validator import Validator
from .evaluation.verification import load_bin, mxnet_forward
from .pfc.gemm import GemmChoice, classifier_gemm
from .pfc.gemm import choose as choose_gemm
from .pfc.partial_fc import NoTimer, PartialFC
from .run import checkpoint, cpu_precision, workdir
from .run.backbone_optimizer import BackboneAdamW, OptimizerStateError
from .run.background_export import BackgroundExport
from .run.checkpoint import CheckpointError, TrainState
from .run.data_source import identity_of, make_loader, open_dataset
from .run.heartbeat import Heartbeat
from .run.interrupts import StopRequest, Watchdog
from .run.precision import LossScaler, build_backbone, clip_global_norm
from .run.recompute import Recomputed, forward_for_backward
from .run.restarts import JOB_VARIABLE
from .run.schedule import Schedule
from .run.training_log import TrainingLog
from .sizing.preflight import dataset_disagreement_across_ranks


class TrainingError(UserError, RuntimeError):
    """Training cannot go on (e.g. a non-finite loss); the message says why."""


@dataclass
class Run:
    """What one training process holds."""

    config: Config
    world: dist.World
    ctx: mx.Context
    precision: cpu_precision.Choice
    """The backbone's compute type (float16, bfloat16 or float32) and why."""
    work_dir: Path
    dataset: RecordDataset | None
    loader: FaceLoader | RandomLoader
    net: mx.gluon.HybridBlock
    """The backbone's parameters, float32, saved and exported by its structure."""
    model: mx.gluon.HybridBlock | Recomputed
    """What computes the embeddings: `net`, or with fp16 its 16-bit graph sharing
    `net`'s parameters (precision.py); with recompute_activations, that graph and its
    segments (recompute.py)."""
    pfc: PartialFC
    trainer: mx.gluon.Trainer
    validator: Validator
    state: TrainState
    schedule: Schedule
    scaler: LossScaler
    log: TrainingLog
    exports: BackgroundExport
    """backbone.onnx of each save, written by another process on rank 0."""


def train(config: Config, resume_from: str | None = None, load_from: str | None = None) -> int:
    """Train to the end of the run (0), or until a signal asks to stop (StopRequest's status):
    batch -> train_step -> after_step, step after step."""
    with StopRequest() as stop, Watchdog(config.stall_timeout) as watchdog:
        run = start(config, resume_from, load_from)  # watched too: a stuck file system
        with contextlib.closing(run.log), run.exports, Heartbeat(
                run.work_dir, run.world, socket.gethostname(), config.heartbeat_timeout,
                run.state.step) as heartbeat:
            first_step = run.state.step
            if first_step == 0 and config.val_targets:
                evaluate(run)  # the untrained network: what training adds
            for batch in batches_to_the_end(run):
                watchdog.restart()
                seed_step(run)
                lr = learning_rate(run)
                loss = train_step(run, batch, lr)
                due = after_step(run, loss, lr, stopping=stop.signal is not None)
                heartbeat.finished(run.state.step)
                run.exports.poll()
                if due.stop:
                    return stop.exit_code
                if due.done:
                    break
            watchdog.restart()  # finish's evaluation and baseline too
            finish(run, trained=run.state.step > first_step)
            return 0


@dataclass(frozen=True)
class Due:
    """What follows a step."""

    evaluate: bool
    save: bool
    stop: bool
    done: bool


def due_after(config: Config, state: TrainState, done: bool, stopping: bool) -> Due:
    """The one place that decides what follows a step. Evaluate every `verbose` steps
    and at the end (not when stopping: a scheduler's grace period is short); save
    every `save_every` steps (0: when an epoch has just ended), at the end and when
    stopping; evaluation comes first, so the checkpoint keeps the best accuracy."""
    evaluate = bool(config.val_targets) and not stopping and (
        state.step % config.verbose == 0 or done)
    saving_due = (state.step % config.save_every == 0 if config.save_every
                  else state.images_in_epoch == 0)
    return Due(evaluate, stopping or done or saving_due, stopping, done)


def after_step(run: Run, loss: float, lr: float, stopping: bool) -> Due:
    """Count the step, check its loss, log it, then evaluate, save or stop as due:
    whether to stop is agreed by every rank (a signal may reach only some)."""
    state, epoch = run.state, run.state.epoch
    state.step += 1
    state.advance(run.loader.global_batch, run.loader.num_images)
    if not np.isfinite(loss):  # the global batch's: the same on every rank
        raise dist.agreed(TrainingError(
            f"the loss became {loss} at step {state.step} (lr {lr:g}); stopping "
            "without saving. The last good checkpoint is untouched: lower lr or "
            "set clip_grad, then resume with --resume-from"))
    filtered = run.pfc.filtered_fraction  # the inter-class filter's share (None: off)
    run.log.step(state.step, epoch, loss, lr, run.scaler.scale if run.scaler.dynamic else None,
                 state.images_seen, None if filtered is None else float(filtered.asscalar()))
    due = due_after(run.config, state, run.schedule.done(state.epoch, state.images_in_epoch),
                    dist.any_rank(stopping, name="stop"))
    if due.evaluate:
        evaluate(run)
    if due.save:
        save(run, export=not due.stop, last=due.done)
    if due.stop:
        run.log.stopped(state.step, run.work_dir)
    return due


def seed_step(run: Run) -> None:
    """Reseed MXNet's generator (dropout) from the step, so a resumed run draws what
    the uninterrupted one did."""
    mx.random.seed(run.config.seed + 7919 * run.state.step + run.world.rank)


def learning_rate(run: Run) -> float:
    """The schedule's rate where the run stands."""
    state, schedule = run.state, run.schedule
    position = schedule.position(state.epoch, state.images_in_epoch)
    return schedule.learning_rate(run.config.lr, position)


def finish(run: Run, trained: bool) -> None:
    """After the last step: its evaluation if no step was trained and the checkpoint's
    step was not evaluated (saved on a signal, or resumed past it on more processes),
    then the baseline if the config asks. A run resumed at an evaluated end adds
    nothing: no second evaluation of the same model."""
    if not trained:
        run.log.info(f"nothing left to train: step {run.state.step} is the end of the run")
        if not run.config.val_targets or run.validator.evaluated_step == run.state.step:
            return
        evaluate(run)
    if run.validator.sets and run.config.report_baseline:
        report_baseline(run)


def batches_to_the_end(run: Run) -> Iterator[Batch]:
    """Every batch from the run's position to its end, epoch after epoch, its images on
    the training device; each epoch starts where the state stands in it (a resumed
    run: mid-epoch)."""
    while not run.schedule.done(run.state.epoch, run.state.images_in_epoch):
        epoch = run.state.epoch
        yield from on_device(in_step(run.log.data_wait.timed(
            run.loader.epoch(epoch, run.state.images_in_epoch))), run.ctx)
        if run.state.epoch == epoch:  # advance() moves on after an epoch's last batch
            raise TrainingError(f"epoch {epoch} ended before its last global batch")


# ----- start-up -----
def start(config: Config, resume_from: str | None, load_from: str | None) -> Run:
    """Everything a run needs, with every rank failing together on bad input."""
    world = dist.init()
    ctx = dist.training_device(world)
    precision, gemm = agreed_precision(config, ctx), agreed_gemm(config, ctx)
    mx.random.seed(config.seed)
    work_dir, dataset, loader, validator, (net, model), pfc, trainer = dist.run_agreed(
        lambda: build(config, world, ctx, precision.dtype,
                      fresh_centers=not (resume_from or load_from), gemm_dtype=gemm.dtype),
        "start", (UserError,), TrainingError,
        "start-up failed")
    workdir.check_shared(work_dir, world)
    if problem := dataset_disagreement_across_ranks(
            dataset.records.fingerprint() if dataset is not None else None):
        raise dist.agreed(DataError(problem))
    state, notes = restore(config, world, ctx, work_dir, net, trainer, pfc, validator,
                           resume_from, load_from, composition(dataset))
    dist.broadcast_parameters(net.collect_params(), root_rank=0)
    schedule = Schedule.of(loader.num_images, state.reference_batch, config.num_epoch,
                           config.max_steps, config.warmup_epoch, config.lr_steps,
                           config.lr_power)
    state.advance(loader.global_batch, loader.num_images, steps=0)  # no batch left in epoch?
    total = state.step + schedule.steps_left(state.epoch, state.images_in_epoch,
                                             loader.global_batch)
    log = TrainingLog(work_dir, world.is_main, total, loader.global_batch, config.frequent,
                      first_step=state.step, job=os.environ.get(JOB_VARIABLE))
    for note in [*notes, describe(config, world, ctx, precision, loader, state, total),
                 f"classifier GEMMs: {gemm.dtype} inputs ({gemm.reason})"]:
        log.info(note)
    scaler = LossScaler.resumed(precision.dtype != "float32",
                                state.loss_scale if resume_from else None)
    return Run(config, world, ctx, precision, work_dir, dataset, loader, net, model, pfc, trainer,
               validator, state, schedule, scaler, log,
               BackgroundExport(work_dir, world.is_main, log.info))


def agreed_precision(config: Config, ctx: mx.Context) -> cpu_precision.Choice:
    """The backbone's compute type, the same on every rank (cpu_precision.py): each
    rank's host decides, cached, before anything is built; a forced bfloat16 that
    a host cannot run stops every rank."""
    return agreed_host_choice(
        lambda: cpu_precision.host_choice(config, ctx.device_type == "gpu"), "precision",
        "cannot choose the backbone's precision")


def agreed_gemm(config: Config, ctx: mx.Context) -> GemmChoice:
    """The classifier GEMMs' input type (config pfc_gemm, pfc/gemm.py), the same on
    every rank, as the backbone's precision."""
    return agreed_host_choice(lambda: choose_gemm(config.pfc_gemm, ctx.device_type == "gpu"),
                              "pfc_gemm", "cannot choose the classifier's GEMMs")


def agreed_host_choice(decide, name: str, failure: str):
    """What every host decides for itself (`decide`, raising a UserError where it cannot),
    made one choice for all ranks (cpu_precision.agree); a failure stops every rank."""
    mine = dist.run_agreed(decide, name, (UserError,), TrainingError, failure)
    return cpu_precision.agree(dist.allgather_object((socket.gethostname(), mine),
                                                     name=f"{name}.hosts"))


def build(config: Config, world: dist.World, ctx: mx.Context, dtype: str,
          fresh_centers: bool, gemm_dtype: str) -> tuple:
    """The run's parts, from local work only: no collective, so a rank that fails here
    cannot leave the others waiting. Without `fresh_centers` (a checkpoint will
    replace them: restore() fails the run otherwise) the centers are not drawn: minutes
    for a shard of tens of GiB."""
    config.check_world_size(world.size)
    work_dir = workdir.create(config.output)
    dataset = open_dataset(config)
    loader = make_loader(config, world, dataset)
    validator = Validator([load_bin(p) for p in config.val_paths()] if world.is_main else [],
                          work_dir)
    net, model = build_backbone(config, ctx, dtype)
    if config.recompute_activations:
        model = Recomputed(model, net, ctx, dtype)
    return (work_dir, dataset, loader, validator, (net, model),
            build_classifier(config, world, ctx, fresh_centers, gemm_dtype),
            make_trainer(config, net))


def build_classifier(config: Config, world: dist.World, ctx: mx.Context,
                     fresh_centers: bool = True, gemm_dtype: str = "float32") -> PartialFC:
    """This rank's Partial FC as the config describes it, its GEMMs' inputs in
    `gemm_dtype` (agreed_gemm's; the parity study's arm builds its classifier here too)."""
    return PartialFC(config.num_classes, config.embedding_size, rank=world.rank,
                     world_size=world.size, ctx=ctx, sample_rate=config.sample_rate,
                     margin=config.margin_function(), fp16_centers=config.fp16_centers,
                     seed=config.seed, center_update=config.center_update_mode(),
                     optimizer=config.centers_optimizer(), initialize_centers=fresh_centers,
                     interclass_filtering_threshold=config.interclass_filtering_threshold,
                     num_subcenters=config.num_subcenters,
                     gemm=classifier_gemm(gemm_dtype))


def describe(config: Config, world: dist.World, ctx: mx.Context,
             precision: cpu_precision.Choice, loader, state: TrainState, total: int) -> str:
    """The log's first line about the run: what trains where, and from which point."""
    resumed = (f", resumed at step {state.step} (epoch {state.epoch}, "
               f"{state.images_in_epoch} images into it)" if state.step else "")
    why = f" ({precision.reason})" if config.fp16 else ""
    k = config.gradient_accumulation
    accumulated = (f" (each {k} micro-batches of {config.batch_size} per process, "
                   f"accumulated)" if k > 1 else "")
    recomputed = ", its activations recomputed" if config.recompute_activations else ""
    return (f"training {config.network} on {config.rec}: {config.num_classes} classes, "
            f"{world.size} processes on {ctx}, backbone in {precision.dtype}{why}{recomputed}, "
            f"global batch {loader.global_batch}{accumulated}, {len(loader)} steps "
            f"per epoch, {total} steps{resumed}")


def make_trainer(config: Config, net) -> mx.gluon.Trainer:
    """Over the float32 parameters in either precision (the 16-bit graph casts them)."""
    options = {"learning_rate": config.lr, "wd": config.weight_decay}
    if config.optimizer == "adamw":  # an instance: MXNet's registry is never touched
        return hvd.DistributedTrainer(net.collect_params(), BackboneAdamW(**options))
    return hvd.DistributedTrainer(net.collect_params(), "sgd",
                                  {**options, "momentum": config.momentum})


def composition(dataset) -> list | None:
    """The datasets of a `rec` list as checkpoints keep them (None for one dataset)."""
    return dataset.composition() if isinstance(dataset, JoinedDataset) else None


def restore(config: Config, world: dist.World, ctx: mx.Context, work_dir: Path, net, trainer,
            pfc: PartialFC, validator: Validator, resume_from: str | None,
            load_from: str | None, datasets: list | None = None
            ) -> tuple[TrainState, list[str]]:
    """The state to start from and notes for the log: a checkpoint's (--resume-from),
    or step 0, with a checkpoint's weights (--load-from) or fresh ones. Checkpoints in
    work_dir past that step belong to another run (or an abandoned future): moved aside."""
    state = TrainState(reference_batch=config.reference_batch
                       or config.images_per_step() * world.size)
    notes = []
    source = resume_from or load_from
    if source:
        path, notes = checkpoint.find_resumable(source, world, weights_only=not resume_from)

        def load() -> TrainState:
            if not resume_from:
                checkpoint.load_weights(path, net, pfc, ctx)
                return state
            return checkpoint.resume(path, net, trainer, pfc, validator, world, ctx, datasets)

        state = dist.run_agreed(load, "restore", (CheckpointError, OptimizerStateError),
                                CheckpointError, f"cannot load {path}")
        notes.append(f"{'resuming from' if resume_from else 'loaded the weights of'} {path}")
        if resume_from and config.reference_batch not in (0, state.reference_batch):
            notes.append(f"reference_batch={config.reference_batch} is not used: the "
                         f"resumed run's steps are steps of {state.reference_batch} images, "
                         "as it started")
        if resume_from and (change := checkpoint.update_change(path, pfc)):
            notes.append(change)
    aside = dist.run_agreed(lambda: checkpoint.set_aside(work_dir, newer_than=state.step
                                                         if resume_from else -1),
                            "restore.aside", (), CheckpointError,
                            f"cannot move checkpoints in {work_dir} aside", on=world.is_main)
    if aside:
        notes.append(f"{work_dir} held checkpoints past step {state.step} of another run: "
                     f"moved them to {aside}")
    return state, notes


# ----- one step -----
def train_step(run: Run, batch: Batch, lr: float, timer=None) -> float:
    """One optimizer step on a batch whose images are on the device (data/device.py),
    in gradient_accumulation micro-batches; `timer` (bench train's) times its phases,
    synchronizing at each."""
    trainer, scaler, ctx = run.trainer, run.scaler, run.ctx
    timer = timer or NoTimer()
    parts = micro_batches(batch, run.config.gradient_accumulation)
    if len(parts) > 1:
        with timer.phase("classifier"):
            run.pfc.accumulate(batch.labels, len(parts))
    loss, sums = 0.0, None
    for position, part in enumerate(parts):
        with timer.phase("backbone forward"):
            embeddings, backward = forward_for_backward(run.model, part.images)
        with timer.phase("classifier"):
            part_loss, grad = run.pfc.forward_backward(
                embeddings, part.labels, grad_scale=scaler.scale if scaler.dynamic else 1.0)
            loss = loss + part_loss  # each part's share of the whole batch's mean
        with timer.phase("backbone backward"):
            backward(grad)
            if position < len(parts) - 1:
                sums = summed_gradients(run.net, ctx, sums)
    if sums is not None:  # the earlier micro-batches' join the last's, where the allreduce reads
        for parameter, total in zip(trained(run.net), sums):
            parameter.grad(ctx)[:] += total
    with timer.phase("backbone allreduce"):
        trainer.allreduce_grads()
    with timer.phase("backbone update"):
        grads = [p.grad(ctx) for p in trained(run.net)]
        finite = scaler.gradients_finite(grads)
        scaler.update(finite)
        if finite:
            # update() applies rescale_grad = trainer._scale / batch_size to the allreduced
            # gradients; batch_size = scale / W turns them into the sum over ranks, unscaled
            batch_size = scaler.scale / run.world.size
            if run.config.clip_grad:
                clip_global_norm(grads, run.config.clip_grad, unit=trainer._scale / batch_size)
            trainer.set_learning_rate(lr)
            trainer.update(batch_size)
    with timer.phase("classifier update"):
        run.pfc.step(lr * run.config.center_lr_scale)
    return float(loss.asscalar())


def summed_gradients(net, ctx: mx.Context, sums: list | None) -> list:
    """The backbone's gradients of this backward added to `sums` (a copy of them after
    the first micro-batch: the next backward overwrites them). Not grad_req "add":
    the CPU's PReLU and LayerNorm kernels only write their gradients, and MXNet's
    LeakyReLU, which would take the PReLU's place, gets the slopes' gradient wrong in
    some graphs (cpu_kernels.py)."""
    grads = [p.grad(ctx) for p in trained(net)]
    if sums is None:
        return [grad.copy() for grad in grads]
    for total, grad in zip(sums, grads):
        total += grad
    return sums


def micro_batches(batch: Batch, count: int) -> list[Batch]:
    """`batch` cut into `count` equal micro-batches (the loader's batch is count x
    batch_size: Config.images_per_step)."""
    if count == 1:
        return [batch]
    if len(batch.labels) % count or len(batch.images) != len(batch.labels):
        raise ValueError(f"a batch of {len(batch.images)} images and {len(batch.labels)} "
                         f"labels does not cut into {count} equal micro-batches")
    size = len(batch.labels) // count
    return [Batch(batch.images[i * size:(i + 1) * size], batch.labels[i * size:(i + 1) * size])
            for i in range(count)]


def trained(net) -> list:
    """The backbone's parameters that have gradients."""
    return [p for p in net.collect_params().values() if p.grad_req != "null"]


# ----- saving and evaluating -----
def save(run: Run, export: bool = True, last: bool = False) -> None:
    """A checkpoint on every rank; then rank 0 has backbone.onnx derived from it by
    another process (background_export.py): no rank waits for the export. The run's
    `last` save is exported by rank 0 at once: no step follows it."""
    run.state.loss_scale = run.scaler.scale
    start_time = time.time()
    path = checkpoint.save(run.work_dir, run.state, run.net, run.trainer, run.pfc,
                           run.validator, run.world, run.config.keep_checkpoints,
                           composition(run.dataset), identity_of(run.dataset))
    exporting = ("; backbone.onnx of it (or of a later save) follows in the background"
                 if export and not last else "")
    run.log.info(f"saved checkpoint {path} in {time.time() - start_time:.1f} s{exporting}")
    if export:
        run.exports.request(run.state.step, last)


def evaluate(run: Run) -> None:
    """Every rank calls it; rank 0 logs every set's accuracy and exports the backbone
    as backbone-best-* whenever the mean accuracy beats the best so far (which the
    checkpoints and backbone-best.json keep). A failure stops every rank."""
    step, log = run.state.step, run.log

    def on_main() -> None:
        results = run.validator.evaluate(mxnet_forward(run.model, run.ctx), step)
        for name, result in results.items():
            log.evaluation(name, step, result)
        for name, why in run.validator.unscored.items():
            log.info(f"WARNING: [{name}][{step}] {why}")
        best = run.validator.keep_if_best(step, lambda prefix: checkpoint.save_backbone(
            run.net, prefix))
        if best is not None:
            log.info(f"best mean verification accuracy so far: {best:.5f} at step "
                     f"{step}; saved {run.work_dir}/backbone-best-*")

    dist.run_agreed(on_main, "evaluate", (UserError,), TrainingError,
                    f"evaluation at step {step} failed", on=run.world.is_main)
    run.validator.evaluated_step = step


def report_baseline(run: Run) -> None:
    """The eigenfaces (PCA) accuracy on the same pairs, beside the model's last one and
    its first (step 0): the gain from training is the gap between those two."""
    if run.dataset is None:
        return
    sample = FaceLoader(run.dataset, min(len(run.dataset), 2000), mirror=False, seed=0)
    train_images = next(iter(sample.epoch(0))).images
    for pairs in run.validator.sets:
        if pairs.name not in run.validator.accuracy:  # not scored (not finite): said so
            continue
        baseline = eigenfaces_accuracy(train_images, pairs)
        run.log.baseline(pairs.name, run.validator.accuracy[pairs.name],
                         run.validator.before_training.get(pairs.name), baseline.accuracy)
