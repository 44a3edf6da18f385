"""One Partial FC step: time, its phases, GEMM speed against numpy's, memory against
the theory, and step time at several class counts with the same number of sampled
centers.

    horovodrun -np 2 -H localhost:2 python -m partial_fc_mx.bench pfc \\
        --classes 1000000 --sample-rate 0.1 --batch-size 128 --embedding-size 512
    horovodrun -np 2 -H localhost:2 python -m partial_fc_mx.bench pfc \\
        --classes 100000 2000000 --num-sample 25000
    horovodrun -np 2 -H localhost:2 python -m partial_fc_mx.bench pfc \\
        --classes 1000000 --batch-size 512 --variants plain filter sub3

--variants times the step with the noisy-label options in the same run, each against
the first: "filter" (inter-class filtering at 0.4), "sub3" (3 sub-centers per class),
"gemm16" (the GEMMs' inputs in bfloat16, pfc_gemm; a name given again times it again,
so that `--variants plain gemm16 plain gemm16 ...` alternates the two).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import socket
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mxnet as mx
import numpy as np
import psutil

from .. import dist
from ..errors import UserError
from ..pfc import kernels
from ..pfc.centers import shard_of
from ..pfc.gemm import choose as choose_gemm
from ..pfc.gemm import classifier_gemm
from ..pfc.idle_rows import CENTER_UPDATES
from ..pfc.partial_fc import PartialFC
from ..pfc.threads import rank_threads
from ..sizing.pfc_memory import estimate_memory
from . import shapes
from .timing import MiB, PeakRSS, PhaseTimer, give_back_freed_memory, synchronized_seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    shapes.add_arguments(parser)
    parser.add_argument("--fp16-centers", action="store_true",
                        help="float16 centers (twice the classes in the same memory)")
    parser.add_argument("--center-update", choices=CENTER_UPDATES, default="lazy",
                        help="how the rows not sampled take a step (config center_update; "
                        "the trainer's default for SGD is exact since 2026-11-25, this "
                        "benchmark's figures were recorded with lazy)")
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=["plain"],
                        help="steps to time one after the other in this run, each compared "
                             "with the first (default: plain)")


VARIANTS = {"plain": {}, "filter": {"interclass_filtering_threshold": 0.4},
            "sub3": {"num_subcenters": 3}, "sub3-filter": {"num_subcenters": 3,
                                                           "interclass_filtering_threshold": 0.4},
            "gemm16": {"gemm": "bfloat16"}}
"""PartialFC's noisy-label settings and its GEMMs' input type (config pfc_gemm, as
"gemm") by the names --variants takes."""


def run(args: argparse.Namespace) -> None:
    world = dist.init()
    ctx = dist.training_device(world)
    if ctx.device_type == "cpu":  # built here, not in the start-up timed below, and a
        # failure on one host stops every rank instead of leaving them in a collective
        dist.run_agreed(kernels.load, "bench.kernels", (UserError,), UserError,
                        "partial_fc_mx's CPU kernels")
    if any("gemm" in VARIANTS[name] for name in args.variants):  # where the CPU cannot:
        dist.run_agreed(lambda: choose_gemm("bfloat16", ctx.device_type == "gpu"),  # why
                        "bench.gemm", (UserError,), UserError, "bfloat16 classifier GEMMs")
    results = []
    for num_classes in sorted(args.classes):
        for variant in args.variants:
            results.append({"variant": variant,
                            **bench_config(world, ctx, num_classes, args, VARIANTS[variant])})
            give_back_freed_memory()  # RSS above the baseline is this configuration's own
    threads = rank_threads()
    first = [r for r in results if r["variant"] == args.variants[0]][-1]
    numpy_rate = numpy_sgemm_gflops(args.batch_size * world.size, first["sampled"],
                                    args.embedding_size, threads)
    mine = {"results": results, "host": socket.gethostname(), "threads": threads,
            "numpy_gflops": numpy_rate, "bandwidth_gbs": memory_bandwidth_gbs(threads)}
    everyone = dist.allgather_object(mine, name="bench.results")
    if world.is_main:
        print_report(args, world, everyone)


def numpy_blas_threads(count: int | None = None) -> int | None:
    """The threads of numpy's own OpenBLAS (not MXNet's), set to `count` first when
    given; None where it cannot be found (a numpy on another BLAS). Left alone, OpenBLAS
    picks its count at load time (OPENBLAS_NUM_THREADS, else the cores the process may
    run on), which need not be a rank's: a comparison with numpy then compares thread
    counts, not GEMM code. (What threadpoolctl does, without the dependency.)"""
    for library in numpy_openblas_paths():
        blas = ctypes.CDLL(library)
        for suffix in ("64_", "", "_64"):
            for prefix in ("openblas", "scipy_openblas"):
                getter = getattr(blas, f"{prefix}_get_num_threads{suffix}", None)
                setter = getattr(blas, f"{prefix}_set_num_threads{suffix}", None)
                if getter is not None and setter is not None:
                    if count is not None:
                        setter(ctypes.c_int(count))
                    return int(getter())
    return None


def numpy_openblas_paths() -> list[str]:
    """Loaded OpenBLAS libraries that came with numpy (numpy.libs/ in its wheels)."""
    home = str(Path(np.__file__).resolve().parent)  # a prefix of numpy/ and numpy.libs/
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "openblas" in line}
        return sorted(path for path in paths if path.startswith(home))
    return []


def numpy_sgemm_gflops(rows: int, cols: int, depth: int, threads: int) -> float | None:
    """numpy's float32 GEMM speed on the forward GEMM's shape with one rank's thread
    count, every rank at once (as their GEMMs run in a step): the reference the
    rank's own GEMMs are compared with. None where numpy's threads cannot be set (every
    rank still takes part in the timing's barriers)."""
    before = numpy_blas_threads()
    usable = before is not None and numpy_blas_threads(threads) == threads
    a = b = None
    if usable:
        a = np.random.default_rng(0).standard_normal((rows, depth), dtype=np.float32)
        b = np.random.default_rng(1).standard_normal((cols, depth), dtype=np.float32)
    try:
        seconds = all_ranks_median_seconds(lambda: a @ b.T if usable else None)
    finally:
        if before is not None:
            numpy_blas_threads(before)
    return 2 * rows * cols * depth / seconds / 1e9 if usable else None


def memory_bandwidth_gbs(threads: int, megabytes: int = 256) -> float:
    """This rank's memory bandwidth (GB/s read + written) while every rank of the job
    copies at once, each with its own thread count (numpy releases the GIL): its
    share of its host's bandwidth, as in a step where every rank streams its logits
    and rows at the same time."""
    source = np.ones(megabytes * 2**20 // 4, np.float32)
    target = np.empty_like(source)
    parts = [(target[part], source[part]) for part in
             (slice(i * len(source) // threads, (i + 1) * len(source) // threads)
              for i in range(threads))]
    with ThreadPoolExecutor(threads) as pool:
        seconds = all_ranks_median_seconds(
            lambda: list(pool.map(lambda part: np.copyto(*part), parts)))
    return 2 * megabytes * 2**20 / seconds / 1e9


def all_ranks_median_seconds(work: Callable[[], object], repeats: int = 5) -> float:
    """Median seconds of `work`, every rank starting each repeat together."""
    times = []
    for _ in range(repeats):
        dist.barrier("bench")
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def minimal_traffic(pfc: PartialFC, global_batch: int) -> int:
    """Bytes one rank's step must move at least once: the N x n logits written and
    read (their gradient can take their buffer), and each sampled row with every
    optimizer state read and written, its float32 gradient written and read."""
    n = len(pfc.sampled_classes) * pfc.subcenters
    return 2 * (global_batch * n * 4 + n * (row_bytes(pfc) + 4 * pfc.embedding_size))


def row_bytes(pfc: PartialFC) -> int:
    """One center's row with its optimizer states, in their stored dtypes."""
    return sum(np.dtype(blocks[0].dtype).itemsize * blocks[0].shape[1]
               for blocks in pfc.centers.arrays().values())


def bench_config(world: dist.World, ctx: mx.Context, num_classes: int, args,
                 variant: dict) -> dict:
    """Median step time, phase split and memory for one class count; `variant`: the
    PartialFC settings that make it (VARIANTS)."""
    sample_rate = shapes.sample_rate(args, shard_of(num_classes, world.rank, world.size).count)
    rss_before = psutil.Process().memory_info().rss
    timer = PhaseTimer()
    with PeakRSS() as rss:
        start = time.perf_counter()
        pfc = PartialFC(num_classes, args.embedding_size, rank=world.rank,
                        world_size=world.size, ctx=ctx, sample_rate=sample_rate,
                        margin=(1.0, 0.5, 0.0), scale=64.0, fp16_centers=args.fp16_centers,
                        center_update=args.center_update,
                        **{**variant, "gemm": classifier_gemm(variant.get("gemm", "float32"))})
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
    n = len(pfc.sampled_classes) * pfc.subcenters  # sampled rows
    theory = estimate_memory(num_classes, args.embedding_size, world.size, world.rank,
                             sample_rate, global_batch, args.fp16_centers,
                             center_update=args.center_update, subcenters=pfc.subcenters,
                             filtering=pfc.filter_threshold > 0, gemm_dtype=pfc.gemm.dtype)
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
    return pfc.centers.shard.count * row_bytes(pfc)


def run_steps(pfc: PartialFC, x: mx.nd.NDArray, labels: np.ndarray, count: int) -> list:
    """Seconds per full step (forward, backward, center update), all ranks in step."""
    def step() -> None:
        pfc.forward_backward(x, labels)
        pfc.step(0.1)

    return [synchronized_seconds(step) for _ in range(count)]


def print_report(args, world: dist.World, everyone: list[dict]) -> None:
    """Per rank: its step, its floor at its own bandwidth, its memory and its GEMM speed
    against numpy's under the same conditions; then per host, the sums."""
    centers = "float16" if args.fp16_centers else "float32"
    print(f"Partial FC step: {world.size} ranks, batch {args.batch_size}/rank, "
          f"D={args.embedding_size}, {centers} centers, device {dist.device(0)}, "
          f"MXNet {mx.__version__}")
    print("step = median wall ms of forward + backward + center update; the split comes "
          "from separate steps synchronized at every phase. Bandwidth and numpy's sgemm are "
          "measured on every rank at once, each with its own MXNet thread count (T)")
    last = [r for r in everyone[0]["results"] if r["variant"] == args.variants[0]][-1]
    shape = (f"{args.batch_size * world.size} x {args.embedding_size} by "
             f"{last['sampled']:,} x {args.embedding_size}")
    for rank, mine in enumerate(everyone):
        results, bandwidth, numpy_rate = (mine["results"], mine["bandwidth_gbs"],
                                          mine["numpy_gflops"])
        for r in results:
            phases = r["phases_ms"]
            compute = ", ".join(f"{k} {v:.1f}" for k, v in phases.items() if k != "communication")
            print(f"rank {rank}  {r['variant']}  C={r['classes']:>9,}  sampled rows "
                  f"{r['sampled']:>7,}  "
                  f"step {r['step_ms']:7.1f} ms  = compute ({compute}) + communication "
                  f"{phases['communication']:.1f}")
            floor_ms = 1e3 * r["traffic_bytes"] / (bandwidth * 1e9)
            print(f"        step = {r['step_ms'] / phases['gemm']:.2f}x its GEMM phase "
                  f"({phases['gemm']:.1f} ms); memory-traffic floor {floor_ms:.2f} ms "
                  f"({r['traffic_bytes'] / 1e6:,.1f} MB at {bandwidth:.1f} GB/s, this rank's "
                  f"copy bandwidth with T={mine['threads']} while every rank copied)")
            gemm = f"        GEMMs {r['gemm_gflops']:.1f} GFLOP/s"
            if numpy_rate:
                gemm += (f" = {100 * r['gemm_gflops'] / numpy_rate:.0f}% of numpy sgemm "
                         f"{numpy_rate:.1f} GFLOP/s ({shape}, T={mine['threads']})")
            print(gemm)
            print(f"        RSS +{r['rss_mib']:,.0f} MiB = {r['rss_mib'] / r['theory_mib']:.2f}x "
                  f"theory {r['theory_mib']:,.0f} MiB (above the {r['baseline_mib']:,.0f} MiB "
                  "of a process with MXNet and Horovod loaded)")
            print(f"        start-up {r['startup_s']:.1f} s for a {r['shard_gib']:.2f} GiB shard "
                  f"(rows and states) = {r['startup_s'] / r['shard_gib']:.1f} s/GiB")
        plain = [r for r in results if r["variant"] == args.variants[0]]
        if plain[-1]["classes"] != plain[0]["classes"]:
            print(f"rank {rank}  step time C={plain[-1]['classes']:,} / "
                  f"C={plain[0]['classes']:,} at the same sample size: "
                  f"{plain[-1]['step_ms'] / plain[0]['step_ms']:.3f}")
        for base in plain:
            for r in results:
                if r["classes"] == base["classes"] and r["variant"] != base["variant"] \
                        and args.variants.count(r["variant"]) == 1:  # rounds: below
                    print(variant_line(rank, r, base))
        for line in alternation_lines(rank, results, args.variants):
            print(line)
    if any(mine["numpy_gflops"] is None for mine in everyone):
        print("numpy sgemm not compared: numpy's BLAS thread count cannot be set here (no "
              "OpenBLAS of numpy's own is loaded), so no measurement with a rank's threads")
    for host, ranks in ranks_by_host(everyone).items():
        threads = sorted({everyone[rank]["threads"] for rank in ranks})
        for i, r in enumerate(everyone[ranks[0]]["results"]):
            host_rate = sum(everyone[rank]["results"][i]["gemm_gflops"] for rank in ranks)
            line = (f"GEMMs {r['variant']} C={r['classes']:,}: {host_rate:.1f} GFLOP/s summed "
                    f"over the "
                    f"{len(ranks)} ranks of {host}")
            if all(everyone[rank]["numpy_gflops"] for rank in ranks):
                reference = sum(everyone[rank]["numpy_gflops"] for rank in ranks)
                line += (f" = {100 * host_rate / reference:.0f}% of numpy sgemm's "
                         f"{reference:.1f} GFLOP/s summed over the same ranks (T="
                         f"{'/'.join(map(str, threads))} each, all at once)")
            print(line)


def variant_line(rank: int, r: dict, base: dict) -> str:
    """A variant's step against the first one's at the same class count: its ratio, and
    the ratio its GEMMs alone would give (the first's step with the GEMM phase grown to
    the variant's sampled rows)."""
    gemm = base["phases_ms"]["gemm"]
    gemms_only = (base["step_ms"] + gemm * (r["sampled"] / base["sampled"] - 1)) / base["step_ms"]
    return (f"rank {rank}  C={r['classes']:,}: {r['variant']} step = "
            f"{r['step_ms'] / base['step_ms']:.3f}x {base['variant']}'s "
            f"({r['step_ms']:.1f} / {base['step_ms']:.1f} ms); its GEMMs' growth alone "
            f"({r['sampled'] / base['sampled']:.1f}x the rows) would make it "
            f"{gemms_only:.3f}x")


def alternation_lines(rank: int, results: list[dict], variants: list[str]) -> list[str]:
    """For variants timed in several rounds (--variants plain gemm16 plain gemm16 ...):
    each round's step and GEMM phase over the first variant's of the same round and
    class count, as median [min, max] over the rounds: the comparison a shared, noisy
    machine allows."""
    lines = []
    for classes in sorted({r["classes"] for r in results}):
        runs = {name: [r for r in results if r["variant"] == name and r["classes"] == classes]
                for name in dict.fromkeys(variants)}
        base = runs.pop(variants[0])
        for name, rounds in runs.items():
            if len(rounds) < 2 or len(rounds) != len(base):
                continue
            for what, of in (("step", lambda r: r["step_ms"]),
                             ("GEMM phase", lambda r: r["phases_ms"]["gemm"])):
                ratios = [of(r) / of(b) for r, b in zip(rounds, base)]
                lines.append(f"rank {rank}  C={classes:,}: {name} {what} / {variants[0]}'s "
                             f"over {len(ratios)} alternating rounds: median "
                             f"{statistics.median(ratios):.3f} [{min(ratios):.3f}, "
                             f"{max(ratios):.3f}]")
    return lines


def ranks_by_host(everyone: list[dict]) -> dict[str, list[int]]:
    """{host name: its ranks}, in the order of their first rank."""
    hosts: dict[str, list[int]] = {}
    for rank, mine in enumerate(everyone):
        hosts.setdefault(mine["host"], []).append(rank)
    return hosts
