"""The trainer users launch: `horovodrun -np N -H ... bash config.sh` or `bash run.sh`.

One process per GPU (or CPU slot). Per step:
  images of this rank's shard --> backbone (Horovod-averaged gradients) --> embeddings
  --> Partial FC (all-gathers every rank's embeddings; exact margin softmax over the
  sampled centers) --> loss and d loss / d embeddings --> backbone backward
  --> backbone update (SGD) and sparse update of the sampled centers.
The loss is the mean over the global batch, so the true backbone gradient is the
SUM of the ranks' gradients; Horovod averages, and the update rescales by W.
"""

from __future__ import annotations

import faulthandler
import signal
import time
from pathlib import Path

import horovod.mxnet as hvd
import mxnet as mx
import numpy as np

from . import checkpoint, dist, optimizers  # noqa: F401  (registers adamw)
from .backbones import get_model
from .checkpoint import TrainState
from .config import Config
from .data.loader import Batch, FaceLoader, RandomLoader, in_step
from .data.recordio import RecordDataset
from .evaluation.baseline import eigenfaces_accuracy
from .evaluation.verification import load_bin, mxnet_forward, verify
from .export import export_onnx
from .partial_fc import PartialFC
from .precision import LossScaler, to_float16
from .schedule import learning_rate
from .training_log import TrainingLog


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. a non-finite loss); the message says why."""


class StopRequest:
    """SIGTERM or SIGINT asks for a checkpoint and a clean exit after the current step."""

    def __init__(self) -> None:
        self.signal = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signal = signum


def build_backbone(config: Config, ctx: mx.Context):
    """Parameters get their shapes by shape inference, not by a forward pass: an
    inference-mode forward lets oneDNN reorder the weights in place into its blocked
    layout, and the raw-byte writes of the parameter broadcast and load_parameters
    into such arrays corrupted them (crashes, MPI_ERR_TRUNCATE, hangs)."""
    net = get_model(config.network, config.embedding_size, config.dropout)
    net.initialize(mx.init.Xavier(rnd_type="gaussian", factor_type="out", magnitude=2),
                   ctx=ctx)
    net.infer_shape(mx.nd.zeros((1, 3, 112, 112), ctx=ctx))
    for param in net.collect_params().values():
        param._finish_deferred_init()
    net.hybridize(static_alloc=True, static_shape=True)
    return to_float16(net, ctx) if config.fp16 else net


def train(config: Config, resume_from: str | None = None, load_from: str | None = None) -> int:
    world = dist.init()
    ctx = dist.device(world.local_rank)
    mx.random.seed(config.seed)
    work_dir = Path(config.output)
    if world.is_main:
        work_dir.mkdir(parents=True, exist_ok=True)
    dataset, loader = make_loader(config, world)
    total_steps = config.max_steps or config.num_epoch * len(loader)
    net = build_backbone(config, ctx)
    pfc = PartialFC(config.num_classes, config.embedding_size, rank=world.rank,
                    world_size=world.size, ctx=ctx, sample_rate=config.sample_rate,
                    margin=tuple(config.margin_list), scale=config.scale,
                    momentum=config.momentum, weight_decay=config.weight_decay,
                    fp16_centers=config.fp16_centers, seed=config.seed)
    options = {"learning_rate": config.lr, "wd": config.weight_decay,
               "multi_precision": config.fp16}
    if config.optimizer == "sgd":
        options["momentum"] = config.momentum
    trainer = hvd.DistributedTrainer(net.collect_params(), config.optimizer, options)
    state = TrainState()
    if resume_from:
        state = checkpoint.resume(checkpoint.latest(resume_from), net, trainer, pfc, world, ctx)
    elif load_from:
        checkpoint.load_weights(checkpoint.latest(load_from), net, pfc, ctx)
    dist.broadcast_parameters(net.collect_params(), root_rank=0)
    scaler = LossScaler(dynamic=config.fp16, scale=state.loss_scale if resume_from else 2.0**16)
    log = TrainingLog(work_dir, world.is_main, total_steps, config.batch_size * world.size,
                      config.frequent, first_step=state.step)
    log.info(f"training {config.network} on {config.rec}: {config.num_classes} classes, "
             f"{world.size} processes on {ctx}, "
             f"{len(loader)} steps per epoch, {total_steps} steps"
             + (f", resumed at step {state.step}" if state.step else ""))
    validation = [load_bin(p) for p in config.val_paths()] if world.is_main else []
    best: dict = {}
    if validation and state.step == 0:
        evaluate(net, validation, ctx, log, 0, work_dir, best)  # what training adds
    stop = StopRequest()
    warmup = config.warmup_epoch * len(loader)
    faulthandler.enable()
    try:
        while state.step < total_steps:
            batches = log.data_wait.timed(loader.epoch(state.epoch, state.step_in_epoch))
            for batch in in_step(batches):
                if config.stall_timeout:
                    faulthandler.dump_traceback_later(config.stall_timeout, exit=True)
                lr = learning_rate(config.lr, state.step, total_steps, warmup, config.lr_steps)
                mx.random.seed(config.seed + 7919 * state.step + world.rank)  # dropout, resumable
                loss = train_step(net, pfc, trainer, batch, lr, config, scaler, world, ctx)
                state.step += 1
                state.step_in_epoch += 1
                if not np.isfinite(loss):
                    raise TrainingError(
                        f"the loss became {loss} at step {state.step} (lr {lr:g}); stopping "
                        "without saving. The last good checkpoint is untouched: lower lr or "
                        "set clip_grad, then resume with --resume-from")
                log.step(state.step, state.epoch, loss, lr, scaler.scale)
                done = state.step >= total_steps  # the last step is evaluated at the end
                if world.is_main and validation and state.step % config.verbose == 0 \
                        and not done:
                    evaluate(net, validation, ctx, log, state.step, work_dir, best)
                stopping = dist.any_rank(stop.signal is not None, name="stop")
                if stopping or done or (config.save_every and
                                        state.step % config.save_every == 0):
                    save(work_dir, state, net, trainer, pfc, world, config, scaler, log)
                if stopping:
                    log.info(f"stopped by a signal at step {state.step}; resume with "
                             f"--resume-from {work_dir}")
                    return 128 + (stop.signal or signal.SIGTERM)
                if done:
                    break
            else:
                state.epoch, state.step_in_epoch = state.epoch + 1, 0
                if not config.save_every and state.step < total_steps:
                    save(work_dir, state, net, trainer, pfc, world, config, scaler, log)
        if world.is_main and validation:
            final_report(net, validation, ctx, log, state.step, dataset, config, work_dir,
                         best)
        return 0
    finally:
        faulthandler.cancel_dump_traceback_later()
        log.close()


def make_loader(config: Config, world: dist.World) -> tuple:
    """(dataset, loader); rec = "random" feeds random tensors (speed runs, no dataset)."""
    if config.rec == "random":
        global_batch = config.batch_size * world.size
        steps = max(1, config.num_image // global_batch) if config.num_image else 1000
        return None, RandomLoader(config.batch_size, config.num_classes, steps,
                                  seed=config.seed + world.rank)
    dataset = RecordDataset(config.rec, config.num_classes)
    return dataset, FaceLoader(dataset, config.batch_size, rank=world.rank,
                               world_size=world.size, seed=config.seed,
                               num_workers=config.num_workers,
                               skip_corrupt=config.skip_corrupt)


def train_step(net, pfc: PartialFC, trainer, batch: Batch, lr: float, config: Config,
               scaler: LossScaler, world: dist.World, ctx: mx.Context) -> float:
    images = mx.nd.array(batch.images, ctx=ctx)
    with mx.autograd.record():
        embeddings = net(images)
    loss, grad = pfc.forward_backward(embeddings, batch.labels)
    embeddings.backward(grad * scaler.scale if scaler.dynamic else grad)
    trainer.allreduce_grads()
    grads = [p.grad(ctx) for p in net.collect_params().values() if p.grad_req != "null"]
    finite = scaler.gradients_finite(grads)
    scaler.update(finite)
    if finite:
        # update() applies rescale_grad = trainer._scale / batch_size to the allreduced
        # gradients; batch_size = scale / W turns them into the sum over ranks, unscaled
        batch_size = scaler.scale / world.size
        if config.clip_grad:
            effective = trainer._scale / batch_size
            mx.gluon.utils.clip_global_norm(grads, config.clip_grad / effective)
        trainer.set_learning_rate(lr)
        trainer.update(batch_size)
    pfc.step(lr * config.center_lr_scale)
    return float(loss.asscalar())


def save(work_dir: Path, state: TrainState, net, trainer, pfc: PartialFC, world: dist.World,
         config: Config, scaler: LossScaler, log: TrainingLog) -> None:
    state.loss_scale = scaler.scale
    start = time.time()
    path = checkpoint.save(work_dir, state, net, trainer, pfc, world, config.keep_checkpoints)
    if world.is_main:
        onnx_path = export_onnx(work_dir)
        log.info(f"saved checkpoint {path} and {onnx_path} in {time.time() - start:.1f} s")


def evaluate(net, validation: list, ctx: mx.Context, log: TrainingLog, step: int,
             work_dir: Path, best: dict) -> dict:
    """Log every set's accuracy; export the backbone as backbone-best-* whenever the
    mean accuracy over the sets beats the best so far (`best` keeps it)."""
    results = {}
    for dataset in validation:
        result = verify(mxnet_forward(net, ctx), dataset)
        results[dataset.name] = result
        log.info(f"[{dataset.name}][{step}]Accuracy-Flip: {result.accuracy:.5f}"
                 f"+-{result.std:.5f}")
        log.scalars(step, {f"verification/{dataset.name}": result.accuracy})
    mean = sum(r.accuracy for r in results.values()) / len(results)
    if step > 0 and mean > best.get("accuracy", -1.0):
        best.update(accuracy=mean, step=step)
        net.export(str(work_dir / "backbone-best"), epoch=0)
        log.info(f"best mean verification accuracy so far: {mean:.5f} at step {step}; "
                 f"saved {work_dir}/backbone-best-*")
    return results


def final_report(net, validation: list, ctx: mx.Context, log: TrainingLog, step: int,
                 dataset: RecordDataset | None, config: Config, work_dir: Path,
                 best: dict) -> None:
    results = evaluate(net, validation, ctx, log, step, work_dir, best)
    if not config.report_baseline or dataset is None:
        return
    sample = FaceLoader(dataset, min(len(dataset), 2000), mirror=False, seed=0)
    train_images = next(iter(sample.epoch(0))).images
    for pairs in validation:
        baseline = eigenfaces_accuracy(train_images, pairs)
        log.info(f"[{pairs.name}] model accuracy {results[pairs.name].accuracy:.4f} vs "
                 f"eigenfaces (PCA) baseline {baseline.accuracy:.4f} on the same pairs")
