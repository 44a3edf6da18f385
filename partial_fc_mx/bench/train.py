"""The whole training step on random images: img/s and where the time goes, with
Partial FC and with a plain data-parallel FC of the same class count in its place.

    horovodrun -np 2 -H localhost:2 --gloo python -m partial_fc_mx.bench train \\
        --networks r18 r50 --classes 100000 1000000 4000000 --batch-size 64
    python -m partial_fc_mx.bench train --networks r50 r100 --classes 1000 \\
        --batch-size 8 32 --heads pfc         # memory: the estimate against RSS

The step is the trainer's own (train.train_step on a run set up by train.start with
rec="random"); the phase split comes from separate steps synchronized at every phase.
A data-parallel FC keeps all C centers on every rank, scores its rank's batch against
all of them and allreduces their gradient like a backbone weight: what Partial FC
replaces. It runs only where its estimated memory fits the host.

Each Partial FC configuration also prints its memory: the preflight's estimate for the
whole process (memory.py) beside the growth of the process's resident memory from
before train.start to the peak of its steps.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from pathlib import Path

import horovod.mxnet as hvd
import mxnet as mx

from .. import dist, train
from ..config import CPU_PRECISIONS, Config
from ..data.device import on_device
from ..pfc.centers import tensor_size_problem
from ..pfc.margins.combined import CombinedMargin
from ..sizing.memory import GiB, estimate_run_memory
from ..sizing.preflight import free_memory
from .timing import PeakRSS, PhaseTimer, give_back_freed_memory, synchronized_seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--networks", nargs="+", default=["r18", "r50"])
    parser.add_argument("--classes", type=int, nargs="+", default=[100_000, 1_000_000, 4_000_000])
    parser.add_argument("--batch-size", type=int, nargs="+", default=[64], help="per rank")
    parser.add_argument("--embedding-size", type=int, default=512)
    parser.add_argument("--sample-rate", type=float, default=0.1)
    parser.add_argument("--heads", nargs="+", choices=["pfc", "fc"], default=["pfc", "fc"],
                        help="pfc: Partial FC; fc: data-parallel FC (where it fits)")
    parser.add_argument("--fp16-centers", action="store_true",
                        help="Partial FC's centers and momentum in float16")
    parser.add_argument("--fp16", action="store_true",
                        help="the backbone in 16 bits, as config fp16 (on a CPU: what "
                             "--cpu-precision says)")
    parser.add_argument("--cpu-precision", choices=CPU_PRECISIONS, default="auto",
                        help="config cpu_precision: what --fp16 means on a CPU")
    parser.add_argument("--gradient-accumulation", type=int, default=1, metavar="K",
                        help="micro-batches of --batch-size per step (pfc head only)")
    parser.add_argument("--recompute", nargs="+", choices=["off", "on"], default=["off"],
                        help="config recompute_activations; 'off on' measures both "
                             "(pfc head only) and prints their ratios")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--output", default=str(Path(tempfile.gettempdir()) /
                                                "partial_fc_mx-bench-train"),
                        help="work directory of the runs (shared by all hosts)")


class DataParallelFC:
    """All C centers on every rank; the rank's own batch scored against all of them with
    the ArcFace margin; the centers' gradient allreduced (averaged) and applied by SGD
    with momentum. The interface of PartialFC that train_step uses."""

    def __init__(self, num_classes: int, embedding_size: int, ctx: mx.Context) -> None:
        self.weight = mx.gluon.Parameter("fc_weight", shape=(num_classes, embedding_size),
                                         init=mx.init.Normal(0.01))
        self.weight.initialize(ctx=ctx)  # differs across ranks until broadcast
        self.trainer = hvd.DistributedTrainer({"fc_weight": self.weight}, "sgd",
                                              {"momentum": 0.9, "wd": 5e-4}, prefix="fc.")
        self.margin = CombinedMargin(1.0, 0.5, 0.0, scale=64.0)
        self.ctx = ctx

    def forward_backward(self, embeddings: mx.nd.NDArray, labels, grad_scale: float = 1.0):
        x = embeddings.detach()
        x.attach_grad()
        labels = mx.nd.array(labels, ctx=self.ctx)
        with mx.autograd.record():
            cos = mx.nd.FullyConnected(mx.nd.L2Normalization(x),
                                       mx.nd.L2Normalization(self.weight.data()),
                                       num_hidden=self.weight.shape[0], no_bias=True)
            target_cos = mx.nd.pick(cos, labels, axis=1)
            target_logit, _ = self.margin(target_cos)
            logits = self.margin.scale * cos + mx.nd.one_hot(labels, cos.shape[1]) * (
                target_logit - self.margin.scale * target_cos).reshape((-1, 1))
            # not softmax_cross_entropy: it clips probabilities at 1e-8 (losses at 18.4)
            loss = -mx.nd.pick(mx.nd.log_softmax(logits), labels, axis=1).mean()
        loss.backward()
        # the mean over this rank's batch; train_step wants the global batch's mean
        return loss, x.grad * (grad_scale / hvd.size())

    def step(self, lr: float) -> None:
        self.trainer.set_learning_rate(lr)
        self.trainer.step(1)


def data_parallel_bytes(num_classes: int, embedding_size: int, batch: int) -> int:
    """Per rank: the centers, their gradient and momentum, and the normalized centers
    with their gradient (autograd keeps both); about eight batch x C matrices (cosines,
    one-hot, logits, log-softmax and their gradients)."""
    return 4 * num_classes * (5 * embedding_size + 8 * batch)


def data_parallel_problem(num_classes: int, embedding_size: int, batch: int,
                          world: dist.World, ctx: mx.Context) -> str | None:
    """Why a data-parallel FC cannot run here (the same answer on every rank), or None."""
    problem = tensor_size_problem(num_classes, 1, embedding_size)
    need = data_parallel_bytes(num_classes, embedding_size, batch)
    room, unreadable = free_memory(ctx, world.local_size)  # the preflight's figure
    problem = problem or (unreadable[0] if unreadable else None)
    if problem is None and need > 0.8 * room:
        problem = (f"needs {need / GiB:.1f} GiB per rank, {room / GiB:.1f} GiB available "
                   "per rank")
    if dist.any_rank(problem is not None, name="bench.fits"):
        return problem or "does not fit on another rank"
    return None


def run(args: argparse.Namespace) -> None:
    """Each configuration's line as soon as it is measured: a later one killed for
    memory leaves the earlier figures on the screen."""
    world = dist.init()
    if world.is_main:
        print_header(args, world)
    results = []
    for network, batch, num_classes, head, recompute in itertools.product(
            args.networks, args.batch_size, args.classes, args.heads, args.recompute):
        results.append(bench_config(world, network, batch, num_classes, head, args,
                                    recompute == "on"))
        if world.is_main:
            print_result(results[-1])
    if world.is_main:
        print_ratios(results)


def bench_config(world: dist.World, network: str, batch: int, num_classes: int, head: str,
                 args, recompute: bool = False) -> dict:
    """img/s (median over steps without the phase timer), the phase split and the memory
    of one configuration, its memory given back before the next one allocates."""
    try:
        with PeakRSS() as memory:
            result = measure_config(world, network, batch, num_classes, head, args, recompute)
        if estimated := result.pop("estimate_of", None):  # outside the window: the
            # estimate's planner binds an executor (memory.planned_bytes)
            config, dtype, device = estimated
            result["estimate"] = estimate_run_memory(config, world.size, world.rank, dtype,
                                                     device).total
            result["rss_growth"] = memory.peak - memory.start
        return result
    finally:
        give_back_freed_memory()


def measure_config(world: dist.World, network: str, batch: int, num_classes: int, head: str,
                   args, recompute: bool = False) -> dict:
    result = {"network": network, "batch": batch, "classes": num_classes, "head": head,
              "recompute": recompute}
    ctx = dist.training_device(world)
    if head == "fc" and args.gradient_accumulation > 1:
        return {**result, "skipped": "gradient accumulation is Partial FC's (PartialFC.accumulate)"}
    if head == "fc" and recompute:
        return {**result, "skipped": "recomputation is measured with the pfc head"}
    if head == "fc" and (problem := data_parallel_problem(num_classes, args.embedding_size,
                                                          batch, world, ctx)):
        return {**result, "skipped": problem}
    config = Config(rec="random", num_classes=num_classes, num_image=10**6, network=network,
                    embedding_size=args.embedding_size, batch_size=batch,
                    sample_rate=args.sample_rate, fp16_centers=args.fp16_centers,
                    fp16=args.fp16, cpu_precision=args.cpu_precision,
                    gradient_accumulation=args.gradient_accumulation,
                    recompute_activations=recompute,
                    output=str(Path(args.output) / f"{network}-{batch}-{num_classes}-{head}"
                                                   f"{'-recomputed' if recompute else ''}"),
                    frequent=10**6)
    config.validate()
    start = time.perf_counter()
    job = train.start(config, None, None)
    if head == "fc":
        job.pfc = None  # free the shard first
        job.pfc = dist.run_agreed(
            lambda: DataParallelFC(num_classes, config.embedding_size, job.ctx), "bench.fc",
            (), RuntimeError, "cannot build the data-parallel FC")
        dist.broadcast_parameters({"fc_weight": job.pfc.weight})  # every rank alike
    mx.nd.waitall()
    startup = time.perf_counter() - start
    if head == "pfc":  # for the backbone's precision, which start-up chose
        result["estimate_of"] = (config, job.precision.dtype, job.ctx.device_type)
    batches = on_device(job.loader.epoch(0), job.ctx)
    seconds = [synchronized_seconds(lambda: train.train_step(job, next(batches), 0.01))
               for _ in range(args.warmup + args.steps)][args.warmup:]
    timer = PhaseTimer()
    for _ in range(args.steps):
        train.train_step(job, next(batches), 0.01, timer)
    phases = {name: 1e3 * total / args.steps for name, total in timer.seconds.items()}
    job.log.close()
    global_batch = config.images_per_step() * world.size
    return {**result, "img_s": global_batch / statistics.median(seconds),
            "step_ms": 1e3 * statistics.median(seconds), "phases_ms": phases,
            "startup_s": startup}


def print_header(args, world: dist.World) -> None:
    bits = f"16 bits (cpu_precision {args.cpu_precision})" if args.fp16 else "float32"
    print(f"Whole training step: {world.size} ranks, random 112x112 images, backbone in "
          f"{bits}, device {dist.device(0)}, "
          f"MXNet {mx.__version__}; Partial FC "
          f"sample_rate {args.sample_rate}, "
          f"{'float16' if args.fp16_centers else 'float32'} centers; fc = data-parallel FC "
          f"over all classes; {args.gradient_accumulation} micro-batch(es) of the batch "
          "per step")
    print("img/s = global batch / median step; phases (rank 0, ms) from separate steps "
          "synchronized at every phase; Partial FC's collectives are in 'classifier', the "
          "data-parallel FC's gradient allreduce in 'classifier update'; start-up = "
          "train.start (backbone, loader, the classifier) and the fc head", flush=True)


def print_result(r: dict) -> None:
    name = (f"{r['network']:>5}  B={r['batch']:>4}  C={r['classes']:>9,}  {r['head']:>3}"
            f"{'  recomputed' if r['recompute'] else ''}")
    if "skipped" in r:
        print(f"{name}  cannot run: {r['skipped']}", flush=True)
        return
    phases = ", ".join(f"{k} {v:.0f}" for k, v in r["phases_ms"].items())
    memory = ""
    if "rss_growth" in r:
        memory = (f"  memory: estimate {r['estimate'] / GiB:.2f} GiB, RSS growth "
                  f"{r['rss_growth'] / GiB:.2f} GiB (x{r['rss_growth'] / r['estimate']:.2f})")
    print(f"{name}  {r['img_s']:7.1f} img/s  step {r['step_ms']:7.0f} ms  ({phases})  "
          f"start-up {r['startup_s']:.1f} s{memory}", flush=True)


def print_ratios(results: list) -> None:
    by_config = {(r["network"], r["batch"], r["classes"], r["head"], r["recompute"]): r
                 for r in results}
    for (network, batch, classes, head, recompute), r in by_config.items():
        name = f"{network:>5}  B={batch:>4}  C={classes:>9,}"
        other = by_config.get((network, batch, classes, "fc", False))
        if head == "pfc" and not recompute and other and "img_s" in other and "img_s" in r:
            print(f"{name}  Partial FC / data-parallel FC img/s: "
                  f"{r['img_s'] / other['img_s']:.2f}")
        plain = by_config.get((network, batch, classes, head, False))
        if recompute and plain and "img_s" in plain and "img_s" in r:
            memory = (f", RSS growth {r['rss_growth'] / plain['rss_growth']:.2f}, estimate "
                      f"{r['estimate'] / plain['estimate']:.2f}" if "rss_growth" in r else "")
            print(f"{name}  recomputed / not: step {r['step_ms'] / plain['step_ms']:.2f}"
                  f"{memory}")
