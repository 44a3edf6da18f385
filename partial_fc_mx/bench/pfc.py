"""One Partial FC step: time, its phases, GEMM speed against numpy's, memory against
the theory, and step time at several class counts with the same number of sampled
centers.

    horovodrun -np 2 -H localhost:2 python -m partial_fc_mx.bench pfc \\
        --classes 1000000 --sample-rate 0.1 --batch-size 128 --embedding-size 512
    horovodrun -np 2 -H localhost:2 python -m partial_fc_mx.bench pfc \\
        --classes 100000 2000000 --num-sample 25000
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import mxnet as mx
import numpy as np
import psutil

from .. import dist
from ..centers import estimate_memory, shard_of
from ..partial_fc import PartialFC
from .timing import MiB, PeakRSS, PhaseTimer, give_back_freed_memory, synchronized_seconds


def add_command(commands) -> None:
    pfc = commands.add_parser("pfc", help="one Partial FC step: time, GEMM speed, memory")
    pfc.set_defaults(func=run)
    pfc.add_argument("--classes", type=int, nargs="+", default=[1_000_000])
    pfc.add_argument("--sample-rate", type=float, default=0.1)
    pfc.add_argument("--num-sample", type=int, default=0,
                     help="sampled centers per rank, overriding --sample-rate (to compare "
                          "class counts at the same sample)")
    pfc.add_argument("--batch-size", type=int, default=128, help="per rank")
    pfc.add_argument("--embedding-size", type=int, default=512)
    pfc.add_argument("--steps", type=int, default=5)
    pfc.add_argument("--warmup", type=int, default=2)
    pfc.add_argument("--fp16-centers", action="store_true",
                     help="float16 centers (twice the classes in the same memory)")


def run(args: argparse.Namespace) -> None:
    world = dist.init()
    ctx = dist.training_device(world)
    results = []
    for num_classes in sorted(args.classes):
        results.append(bench_config(world, ctx, num_classes, args))
        give_back_freed_memory()  # RSS above the baseline is this configuration's own
    alone = world.local_rank == 0
    peak = numpy_sgemm_gflops(args.batch_size * world.size, results[-1]["sampled"],
                              args.embedding_size, alone)
    bandwidth = memory_bandwidth_gbs(alone)
    everyone = dist.allgather_object((results, peak, world.local_size, bandwidth),
                                     name="bench.results")
    if world.is_main:
        print_report(args, world, everyone)


def numpy_sgemm_gflops(rows: int, cols: int, depth: int, alone: bool) -> float:
    """The host's float32 GEMM speed on the forward GEMM's shape (numpy, all cores)."""
    a = b = None
    if alone:
        a = np.random.default_rng(0).standard_normal((rows, depth), dtype=np.float32)
        b = np.random.default_rng(1).standard_normal((cols, depth), dtype=np.float32)
    seconds = host_median_seconds(alone, lambda: a @ b.T)
    return 2 * rows * cols * depth / seconds / 1e9 if alone else 0.0


def memory_bandwidth_gbs(alone: bool, megabytes: int = 512) -> float:
    """The host's memory bandwidth (GB/s read + written) copying a large float32 array
    with numpy."""
    source = target = None
    if alone:
        source = np.ones(megabytes * 2**20 // 4, np.float32)
        target = np.empty_like(source)
    seconds = host_median_seconds(alone, lambda: np.copyto(target, source))
    return 2 * megabytes * 2**20 / seconds / 1e9 if alone else 0.0


def host_median_seconds(alone: bool, work: Callable[[], object], repeats: int = 5) -> float:
    """Median seconds of `work`, timed by the first rank of each host only (`alone`)
    while the others wait, so the figure is the whole host's, to compare with the sum
    over its ranks. Every rank reaches the barrier, even when the timing fails."""
    times = []
    try:
        for _ in range(repeats if alone else 0):
            start = time.perf_counter()
            work()
            times.append(time.perf_counter() - start)
    finally:
        dist.barrier("bench")
    return statistics.median(times) if alone else 0.0


def minimal_traffic(pfc: PartialFC, global_batch: int) -> int:
    """Bytes one rank's step must move at least once: the N x n logits written and
    read (their gradient can take their buffer), and each sampled row with every
    optimizer state read and written, its float32 gradient written and read."""
    n = len(pfc.sampled_classes)
    return 2 * (global_batch * n * 4 + n * (row_bytes(pfc) + 4 * pfc.embedding_size))


def row_bytes(pfc: PartialFC) -> int:
    """One center's row with its optimizer states, in their stored dtypes."""
    return sum(np.dtype(array.dtype).itemsize * array.shape[1]
               for array in pfc.centers.arrays().values())


def bench_config(world: dist.World, ctx: mx.Context, num_classes: int, args) -> dict:
    """Median step time, phase split and memory for one class count."""
    sample_rate = args.sample_rate
    shard_rows = shard_of(num_classes, world.rank, world.size).count
    if args.num_sample:
        sample_rate = min(1.0, (args.num_sample + 0.5) / shard_rows)
    rss_before = psutil.Process().memory_info().rss
    timer = PhaseTimer()
    with PeakRSS() as rss:
        start = time.perf_counter()
        pfc = PartialFC(num_classes, args.embedding_size, rank=world.rank,
                        world_size=world.size, ctx=ctx, sample_rate=sample_rate,
                        margin=(1.0, 0.5, 0.0), scale=64.0, fp16_centers=args.fp16_centers)
        mx.nd.waitall()
        startup_seconds = time.perf_counter() - start
        rng = np.random.default_rng(world.rank)
        x = mx.nd.array(rng.standard_normal((args.batch_size, args.embedding_size)), ctx=ctx)
        labels = rng.integers(0, num_classes, args.batch_size)
        run_steps(pfc, x, labels, args.warmup)
        plain = run_steps(pfc, x, labels, args.steps)
        pfc.timer = timer
        run_steps(pfc, x, labels, args.steps)
    global_batch = args.batch_size * world.size
    n = len(pfc.sampled_classes)
    theory = estimate_memory(num_classes, args.embedding_size, world.size, world.rank,
                             sample_rate, global_batch, args.fp16_centers)
    seconds = {k: v / args.steps for k, v in timer.seconds.items()}
    return {
        "classes": num_classes, "sampled": n, "step_ms": 1e3 * statistics.median(plain),
        "phases_ms": {k: 1e3 * v for k, v in sorted(seconds.items())},
        "gemm_gflops": 3 * 2 * global_batch * n * args.embedding_size / seconds["gemm"] / 1e9,
        "rss_mib": (rss.peak - rss_before) / MiB, "theory_mib": theory.total / MiB,
        "baseline_mib": rss_before / MiB, "traffic_bytes": minimal_traffic(pfc, global_batch),
        "startup_s": startup_seconds, "shard_gib": shard_bytes(pfc) / 2**30,
    }


def shard_bytes(pfc: PartialFC) -> int:
    """The rows and optimizer states this rank keeps for the whole run."""
    return pfc.shard.count * row_bytes(pfc)


def run_steps(pfc: PartialFC, x: mx.nd.NDArray, labels: np.ndarray, count: int) -> list:
    """Seconds per full step (forward, backward, center update), all ranks in step."""
    def step() -> None:
        pfc.forward_backward(x, labels)
        pfc.step(0.1)

    return [synchronized_seconds(step) for _ in range(count)]


def print_report(args, world: dist.World, everyone: list) -> None:
    centers = "float16" if args.fp16_centers else "float32"
    print(f"Partial FC step: {world.size} ranks, batch {args.batch_size}/rank, "
          f"D={args.embedding_size}, {centers} centers, device {dist.device(0)}, "
          f"MXNet {mx.__version__}")
    print("step = median wall ms of forward + backward + center update; the split comes "
          "from separate steps synchronized at every phase")
    bandwidth, local_size = everyone[0][3], everyone[0][2]
    for rank, (results, *_host) in enumerate(everyone):
        for r in results:
            phases = r["phases_ms"]
            compute = ", ".join(f"{k} {v:.1f}" for k, v in phases.items() if k != "communication")
            print(f"rank {rank}  C={r['classes']:>9,}  sampled {r['sampled']:>7,}  "
                  f"step {r['step_ms']:7.1f} ms  = compute ({compute}) + communication "
                  f"{phases['communication']:.1f}")
            floor_ms = 1e3 * r["traffic_bytes"] / (bandwidth * 1e9 / local_size)
            print(f"        step = {r['step_ms'] / phases['gemm']:.2f}x its GEMM phase "
                  f"({phases['gemm']:.1f} ms); memory-traffic floor {floor_ms:.2f} ms "
                  f"({r['traffic_bytes'] / 1e6:,.1f} MB at {bandwidth / local_size:.1f} GB/s, "
                  f"host 0's copy bandwidth {bandwidth:.1f} GB/s shared by {local_size} ranks)")
            print(f"        RSS +{r['rss_mib']:,.0f} MiB = {r['rss_mib'] / r['theory_mib']:.2f}x "
                  f"theory {r['theory_mib']:,.0f} MiB (above the {r['baseline_mib']:,.0f} MiB "
                  "of a process with MXNet and Horovod loaded)")
            print(f"        start-up {r['startup_s']:.1f} s for a {r['shard_gib']:.2f} GiB shard "
                  f"(rows and states) = {r['startup_s'] / r['shard_gib']:.1f} s/GiB")
        if len(results) > 1:
            print(f"rank {rank}  step time C={results[-1]['classes']:,} / "
                  f"C={results[0]['classes']:,} at the same sample size: "
                  f"{results[-1]['step_ms'] / results[0]['step_ms']:.3f}")
    # ranks of one host run their GEMMs at the same time: compare their sum to the host
    peak = everyone[0][1]
    for i, r in enumerate(everyone[0][0]):
        host_rate = sum(everyone[k][0][i]["gemm_gflops"] for k in range(local_size))
        print(f"GEMMs C={r['classes']:,}: {host_rate:.1f} GFLOP/s summed over the "
              f"{local_size} ranks of host 0 = {100 * host_rate / peak:.0f}% of numpy "
              f"sgemm {peak:.1f} GFLOP/s measured alone on that host")
