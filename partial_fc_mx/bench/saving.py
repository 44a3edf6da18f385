"""What a save costs the run: the checkpoint alone, the checkpoint with backbone.onnx
exported inline on rank 0 (as every save did before the export moved to its own
process), and with the export in the background (train.save today).

    horovodrun -np 2 -H localhost:2 --gloo python -m partial_fc_mx.bench saving \\
        --networks r50 r100

A rank's cost of a save is the time from the save's start (all ranks together) to the
end of its next step, less a normal step: a rank that waits for rank 0's export in
the next step's collectives pays for it there. With the export in the background,
the steps that run beside it are timed too: on a host whose cores the ranks use
(2 cores here) the export competes with them, niced.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import mxnet as mx

from .. import dist, train
from ..config import Config
from ..data.device import on_device
from ..run import checkpoint
from ..run.background_export import BackgroundExport
from ..run.export import export_onnx
from .timing import synchronized_seconds

WAYS = ("checkpoint only", "checkpoint + export inline", "checkpoint + export in background")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--networks", nargs="+", default=["r50", "r100"])
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=5, help="normal steps timed")
    parser.add_argument("--output", default=str(Path(tempfile.gettempdir()) /
                                                "partial_fc_mx-bench-saving"),
                        help="work directory of the runs (shared by all hosts)")


def run(args: argparse.Namespace) -> None:
    world = dist.init()
    for network in args.networks:
        result = measure(world, network, args)
        if world.is_main:
            print_result(network, world, args, result)


def measure(world: dist.World, network: str, args) -> dict:
    config = Config(rec="random", num_classes=args.classes, num_image=10**6, network=network,
                    batch_size=args.batch_size, output=str(Path(args.output) / network),
                    frequent=10**6, keep_checkpoints=1)
    config.validate()
    job = train.start(config, None, None)
    job.exports = BackgroundExport(job.work_dir, world.is_main, lambda line: None)
    batches = on_device(job.loader.epoch(0), job.ctx)

    def step() -> None:
        train.train_step(job, next(batches), 0.01)
        job.state.step += 1

    for _ in range(2):  # warm-up: the first steps allocate and tune
        step()
    normal = statistics.median(synchronized_seconds(step) for _ in range(args.steps))
    costs = {way: save_cost(job, way, step, normal) for way in WAYS}
    beside = steps_beside_the_export(job, step)
    job.log.close()
    return {"step": normal, "costs": costs, **beside}


def save_cost(job: train.Run, way: str, step, normal: float) -> list[float]:
    """Every rank's cost of one save done `way`: save start -> end of the next step,
    less a normal step."""
    dist.barrier("bench.save")
    start = time.perf_counter()
    if way == "checkpoint + export inline":
        checkpoint.save(job.work_dir, job.state, job.net, job.trainer, job.pfc, job.validator,
                        job.world, job.config.keep_checkpoints)
        if job.world.is_main:
            export_onnx(job.work_dir)
    else:
        train.save(job, export=way == "checkpoint + export in background")
    step()
    mx.nd.waitall()
    cost = time.perf_counter() - start - normal
    if way == "checkpoint + export in background":
        job.exports.wait()  # measured separately, by steps_beside_the_export
    return dist.allgather_object(cost, name=f"bench.save.{way}")


def steps_beside_the_export(job: train.Run, step) -> dict:
    """Steps run while rank 0's export runs (every rank steps until it is done)."""
    train.save(job, export=True)
    start = time.perf_counter()
    seconds = []
    while dist.any_rank(job.exports.process is not None, name="bench.exporting"):
        seconds.append(synchronized_seconds(step))
        job.exports.poll()
    return {"export": time.perf_counter() - start, "beside": seconds}


def print_result(network: str, world: dist.World, args, result: dict) -> None:
    normal, costs = result["step"], result["costs"]
    print(f"{network}: {world.size} ranks, batch {args.batch_size} per rank, "
          f"{args.classes} classes, float32 on {dist.device(0)}; a normal step "
          f"{normal:.2f} s (median of {args.steps})")
    alone = max(costs["checkpoint only"])
    for way, per_rank in costs.items():
        ranks = ", ".join(f"rank {rank} {cost:.1f} s" for rank, cost in enumerate(per_rank))
        print(f"  {way:<34} costs the run {max(per_rank):5.1f} s ({ranks}); "
              f"{max(per_rank) / alone:.2f}x the checkpoint alone")
    beside = result["beside"]
    if beside:
        print(f"  the background export took {result['export']:.1f} s; {len(beside)} steps "
              f"ran beside it, median {statistics.median(beside):.2f} s "
              f"({statistics.median(beside) / normal:.2f}x a normal step)")
    else:
        print(f"  the background export took {result['export']:.1f} s; no step ran beside it")
    print(flush=True)
