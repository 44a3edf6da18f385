"""A long run stays fast: the trainer itself (train.train: saves, background exports,
heartbeats, evaluation-free) over thousands of steps at a realistic Partial FC size,
with every rank's resident memory sampled beside it.

    mpirun -np 2 -H localhost:2 --oversubscribe python -m partial_fc_mx.bench soak \\
        --classes 1000000 --sample-rate 0.1 --steps 2000 --save-every 250

It prints the step time of the first and the last 10% of the steps after the warm-up
(from metrics.jsonl's records, one every `--frequent` steps), their ratio, and each
rank's resident memory at the start of that window and at the end, and how many
collectives Horovod's response cache did not answer after the warm-up. That count
comes from rank 0's Horovod timeline (written to the work dir): Horovod's coordinator
records a rank's readiness for a collective (an "X" event named by the rank) only while
it negotiates one the cache missed; a cache hit goes without. Every collective of a
step has the same name and shape at every step, and a step runs fewer of them than
the cache holds (dist.RESPONSE_CACHE), so none should be negotiated after the first
step but for collectives whose shape changes (an object allgather, by its pickle).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import psutil

from .. import dist, train
from ..config import Config
from ..run.metrics import METRICS, read_metrics, read_records

RSS_EVERY = 10.0
"""Seconds between two samples of a rank's resident memory."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--classes", type=int, default=1_000_000)
    parser.add_argument("--sample-rate", type=float, default=0.1)
    parser.add_argument("--network", default="tiny")
    parser.add_argument("--batch-size", type=int, default=128, help="per rank")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--save-every", type=int, default=250)
    parser.add_argument("--frequent", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=50, help="steps left out of the figures")
    parser.add_argument("--output", default=str(Path(tempfile.gettempdir()) /
                                                "partial_fc_mx-bench-soak"),
                        help="work directory of the run (shared by all hosts)")


TIMELINE = "horovod-timeline.json"
OPERATIONS = {"ALLREDUCE", "ALLGATHER", "BROADCAST", "ALLTOALL", "REDUCESCATTER", "ADASUM",
              "BARRIER", "JOIN"}
"""The names of a collective's top-level event in Horovod's timeline (its response
type); negotiations and activities (MPI_ALLREDUCE, ...) have others."""


def run(args: argparse.Namespace) -> None:
    Path(args.output).mkdir(parents=True, exist_ok=True)  # Horovod opens it at init
    os.environ.setdefault("HOROVOD_TIMELINE", str(Path(args.output) / TIMELINE))
    world = dist.init()
    config = Config(rec="random", num_classes=args.classes, sample_rate=args.sample_rate,
                    network=args.network, embedding_size=512, batch_size=args.batch_size,
                    num_image=args.batch_size * world.size * (args.steps + 1),
                    max_steps=args.steps, save_every=args.save_every,
                    frequent=args.frequent, verbose=10**9, val_targets=[],
                    output=args.output)
    config.validate()
    memory = Path(args.output) / f"soak-rss-rank{world.rank}.jsonl"
    memory.parent.mkdir(parents=True, exist_ok=True)
    memory.unlink(missing_ok=True)
    with RssSampler(memory):
        train.train(config)
    dist.barrier("bench.soak")
    dist.stop_timeline()
    if world.is_main:
        print_report(Path(args.output), world.size, args)


class RssSampler:
    """Appends {"time", "rss_mib"} of this process to a file every RSS_EVERY seconds."""

    def __init__(self, path: Path) -> None:
        self.path, self._stop = path, threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-rss", daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        process = psutil.Process()
        with open(self.path, "a") as out:
            while True:
                out.write(json.dumps({"time": time.time(),
                                      "rss_mib": process.memory_info().rss / 2**20}) + "\n")
                out.flush()
                if self._stop.wait(RSS_EVERY):
                    return


def print_report(work_dir: Path, ranks: int, args) -> None:
    metrics = read_metrics(work_dir)
    steps = [r for r in zip(metrics["step"], metrics["speed"]) if r[0] > args.warmup]
    tenth = max(1, len(steps) // 10)
    # each step record carries the speed of the `frequent` steps before it (images/s)
    seconds = [args.batch_size * ranks / speed for _, speed in steps]
    first, last = statistics.median(seconds[:tenth]), statistics.median(seconds[-tenth:])
    print(f"soak: {len(metrics['step'])} logged steps to step {metrics['step'][-1]}, C = "
          f"{args.classes}, r = {args.sample_rate}, {args.network}, {ranks} ranks x "
          f"{args.batch_size}, a save every {args.save_every} steps")
    print(f"step time: first 10% after step {args.warmup} (steps {steps[0][0]}-"
          f"{steps[tenth - 1][0]}) {first:.3f} s, last 10% (steps {steps[-tenth][0]}-"
          f"{steps[-1][0]}) {last:.3f} s, last / first = {last / first:.3f}")
    begin = time_of_step(work_dir, steps[0][0])
    for rank in range(ranks):
        samples = [json.loads(line) for line in
                   (work_dir / f"soak-rss-rank{rank}.jsonl").read_text().splitlines()]
        after = [s for s in samples if s["time"] >= begin] or samples
        print(f"rank {rank} resident memory: {after[0]['rss_mib']:.0f} MiB at step "
              f"{steps[0][0]}, {after[-1]['rss_mib']:.0f} MiB at the end, largest "
              f"{max(s['rss_mib'] for s in after):.0f} MiB")
    timeline = Path(os.environ["HOROVOD_TIMELINE"])
    if not timeline.is_file():
        print(f"no Horovod timeline at {timeline}: the response cache was not observed")
        return
    window = (begin, time_of_step(work_dir, steps[-1][0]))
    before, negotiated, run = negotiations(timeline, *window)
    names = ", ".join(f"{name} x{count}" for name, count in negotiated.most_common(6))
    print(f"Horovod's response cache (rank 0's timeline {timeline}): between steps "
          f"{steps[0][0]} and {steps[-1][0]}, {sum(negotiated.values())} of {run} "
          f"collectives were negotiated{': ' + names if names else ''}; {before} before "
          "(each collective's first time)")


def negotiations(timeline: Path, begin: float, end: float) -> tuple[int, Counter, int]:
    """From a Horovod timeline: (negotiations before `begin`, {tensor: negotiations}
    between `begin` and `end`, collectives run between them). A negotiation shows as
    each rank's readiness event, written only for a request the response cache did not
    answer: rank 0's is counted, once per negotiation."""
    events = json.loads(timeline.read_text())
    start = next(e["args"]["start_time_since_epoch_in_micros"] for e in events
                 if "start_time_since_epoch_in_micros" in e.get("args", {}))
    low, high = begin * 1e6 - start, end * 1e6 - start  # microseconds since its start
    tensors = {e["pid"]: e["args"]["name"] for e in events
               if e["ph"] == "M" and e.get("name") == "process_name" and "name" in e["args"]}
    ready = [e for e in events if e["ph"] == "X" and e.get("name") == "0"]
    negotiated = Counter(tensors.get(e["pid"], "?") for e in ready if low <= e["ts"] <= high)
    run = sum(1 for e in events if e["ph"] == "B" and e.get("name") in OPERATIONS
              and low <= e["ts"] <= high)
    return sum(1 for e in ready if e["ts"] < low), negotiated, run


def time_of_step(work_dir: Path, step: int) -> float:
    """When metrics.jsonl recorded `step`."""
    return next((record["time"] for record in read_records(work_dir / METRICS)
                 if record and record["kind"] == "step" and record["step"] == step), 0.0)
