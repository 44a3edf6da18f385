"""Benchmarks that print figures: `python -m partial_fc_mx.bench pfc ...`.

Launch under horovodrun or mpirun like training. Every comparison is measured in
the same run (ratios), because the machines these run on are shared and noisy:
GEMM speed against numpy's sgemm on the same shapes, memory against the theory,
step time at several class counts with the same number of sampled centers.

    horovodrun -np 2 -H localhost:2 python -m partial_fc_mx.bench pfc \\
        --classes 1000000 --sample-rate 0.1 --batch-size 128 --embedding-size 512
    horovodrun -np 2 -H localhost:2 python -m partial_fc_mx.bench pfc \\
        --classes 100000 2000000 --num-sample 25000
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import mxnet as mx
import numpy as np
import psutil

from . import dist, durable
from .centers import estimate_memory, shard_of
from .config import load_config
from .data.loader import FaceLoader, WaitTimer
from .data.recordio import RecordDataset
from .data.synthetic import prepare_synthetic
from .data.transforms import FACE_SIZE
from .partial_fc import PartialFC

MiB = 1024**2

REPO = Path(__file__).resolve().parents[1]


class PhaseTimer:
    """Wall time per phase of a step; synchronizes MXNet at every boundary."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def phase(self, name: str):
        mx.nd.waitall()
        start = time.perf_counter()
        yield
        mx.nd.waitall()
        self.seconds[name] += time.perf_counter() - start


class PeakRSS:
    """The largest resident set size seen while it runs (sampled every 2 ms)."""

    def __enter__(self) -> PeakRSS:
        self.peak = psutil.Process().memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        process = psutil.Process()
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, process.memory_info().rss)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def numpy_sgemm_gflops(rows: int, cols: int, depth: int, alone: bool, repeats: int = 5) -> float:
    """The host's float32 GEMM speed on the forward GEMM's shape (numpy, all cores).

    Only the first rank of each host measures (`alone`); the others wait, so the
    figure is the whole host's peak, to compare with the sum over its ranks.
    """
    times = []
    if alone:
        a = np.random.default_rng(0).standard_normal((rows, depth), dtype=np.float32)
        b = np.random.default_rng(1).standard_normal((cols, depth), dtype=np.float32)
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b.T
            times.append(time.perf_counter() - start)
    dist.barrier("bench")
    return 2 * rows * cols * depth / statistics.median(times) / 1e9 if alone else 0.0


def bench_pfc_config(world: dist.World, ctx: mx.Context, num_classes: int, args) -> dict:
    """Median step time, phase split and memory for one class count."""
    sample_rate = args.sample_rate
    shard_rows = shard_of(num_classes, world.rank, world.size).count
    if args.num_sample:
        sample_rate = min(1.0, (args.num_sample + 0.5) / shard_rows)
    rss_before = psutil.Process().memory_info().rss
    timer = PhaseTimer()
    with PeakRSS() as rss:
        pfc = PartialFC(num_classes, args.embedding_size, rank=world.rank,
                        world_size=world.size, ctx=ctx, sample_rate=sample_rate,
                        margin=(1.0, 0.5, 0.0), scale=64.0)
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
                             sample_rate, global_batch)
    seconds = {k: v / args.steps for k, v in timer.seconds.items()}
    return {
        "classes": num_classes, "sampled": n, "step_ms": 1e3 * statistics.median(plain),
        "phases_ms": {k: 1e3 * v for k, v in sorted(seconds.items())},
        "gemm_gflops": 3 * 2 * global_batch * n * args.embedding_size / seconds["gemm"] / 1e9,
        "rss_mib": (rss.peak - rss_before) / MiB, "theory_mib": theory.total / MiB,
        "baseline_mib": rss_before / MiB,
    }


def run_steps(pfc: PartialFC, x: mx.nd.NDArray, labels: np.ndarray, count: int) -> list:
    """Seconds per full step (forward, backward, center update), all ranks in step."""
    times = []
    for _ in range(count):
        dist.barrier("bench")
        start = time.perf_counter()
        pfc.forward_backward(x, labels)
        pfc.step(0.1)
        mx.nd.waitall()
        times.append(time.perf_counter() - start)
    return times


def run_pfc(args) -> None:
    world = dist.init()
    ctx = dist.device(world.local_rank)
    results = []
    for num_classes in sorted(args.classes):
        results.append(bench_pfc_config(world, ctx, num_classes, args))
        mx.nd.waitall()
    peak = numpy_sgemm_gflops(args.batch_size * world.size, results[-1]["sampled"],
                              args.embedding_size, alone=world.local_rank == 0)
    everyone = dist.allgather_object((results, peak, world.local_size), name="bench.results")
    if world.is_main:
        print_pfc_report(args, world, everyone)


def print_pfc_report(args, world: dist.World, everyone: list) -> None:
    print(f"Partial FC step: {world.size} ranks, batch {args.batch_size}/rank, "
          f"D={args.embedding_size}, device {dist.device(0)}, MXNet {mx.__version__}")
    print("step = median wall ms of forward + backward + center update; the split comes "
          "from separate steps synchronized at every phase")
    for rank, (results, _peak, _local) in enumerate(everyone):
        for r in results:
            phases = r["phases_ms"]
            compute = ", ".join(f"{k} {v:.1f}" for k, v in phases.items() if k != "communication")
            print(f"rank {rank}  C={r['classes']:>9,}  sampled {r['sampled']:>7,}  "
                  f"step {r['step_ms']:7.1f} ms  = compute ({compute}) + communication "
                  f"{phases['communication']:.1f}")
            print(f"        RSS +{r['rss_mib']:,.0f} MiB = {r['rss_mib'] / r['theory_mib']:.2f}x "
                  f"theory {r['theory_mib']:,.0f} MiB (above the {r['baseline_mib']:,.0f} MiB "
                  "of a process with MXNet and Horovod loaded)")
        if len(results) > 1:
            print(f"rank {rank}  step time C={results[-1]['classes']:,} / "
                  f"C={results[0]['classes']:,} at the same sample size: "
                  f"{results[-1]['step_ms'] / results[0]['step_ms']:.3f}")
    # ranks of one host run their GEMMs at the same time: compare their sum to the host
    peak, local_size = everyone[0][1], everyone[0][2]
    for i, r in enumerate(everyone[0][0]):
        host_rate = sum(everyone[k][0][i]["gemm_gflops"] for k in range(local_size))
        print(f"GEMMs C={r['classes']:,}: {host_rate:.1f} GFLOP/s summed over the "
              f"{local_size} ranks of host 0 = {100 * host_rate / peak:.0f}% of numpy "
              f"sgemm {peak:.1f} GFLOP/s measured alone on that host")


def median_ms(run, repeats: int = 5) -> float:
    """Median wall time of `run()` including all the MXNet work it queued."""
    run()
    mx.nd.waitall()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        mx.nd.waitall()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def run_ops(args) -> None:
    """The operator choices inside PartialFC, each next to its alternatives."""
    n_rows, n_cols, depth = args.batch_size, args.num_sample, args.embedding_size
    rng = np.random.default_rng(0)
    x = mx.nd.array(rng.standard_normal((n_rows, depth)))
    w = mx.nd.array(rng.standard_normal((n_cols, depth)))
    g = mx.nd.array(rng.standard_normal((n_rows, n_cols)))
    ones_cols, ones_rows = mx.nd.ones((1, n_cols)), mx.nd.ones((1, n_rows))

    def recorded_fc():
        x.attach_grad()
        w.attach_grad()
        with mx.autograd.record():
            out = mx.nd.FullyConnected(x, w, num_hidden=n_cols, no_bias=True)
        out.backward(g)

    gemm_flop = 2 * n_rows * n_cols * depth
    choices = {
        "three GEMMs (forward, d x, d w)": {
            "FullyConnected recorded + backward (used)": (recorded_fc, 3 * gemm_flop),
            "FullyConnected + nd.dot(g, w) + nd.dot(g, x, transpose_a)": (
                lambda: (mx.nd.FullyConnected(x, w, num_hidden=n_cols, no_bias=True),
                         mx.nd.dot(g, w), mx.nd.dot(g, x, transpose_a=True)), 3 * gemm_flop),
            "nd.dot(x, w, transpose_b) + the two nd.dot": (
                lambda: (mx.nd.dot(x, w, transpose_b=True), mx.nd.dot(g, w),
                         mx.nd.dot(g, x, transpose_a=True)), 3 * gemm_flop),
            "numpy x @ w.T, g @ w, g.T @ x": (
                lambda: (x.asnumpy() @ w.asnumpy().T, g.asnumpy() @ w.asnumpy(),
                         g.asnumpy().T @ x.asnumpy()), 3 * gemm_flop),
        },
        "row sums of the B x n logits": {
            "FullyConnected(m, ones) (used)": (
                lambda: mx.nd.FullyConnected(g, ones_cols, num_hidden=1, no_bias=True), 0),
            "sum(axis=1)": (lambda: g.sum(axis=1), 0),
        },
        "column sums of the B x n logits": {
            "dot(ones, m) (used)": (lambda: mx.nd.dot(ones_rows, g), 0),
            "sum(axis=0)": (lambda: g.sum(axis=0), 0),
        },
        "norms of the n x D sampled centers": {
            "sqrt(FullyConnected(square(w), ones)) (used)": (
                lambda: mx.nd.sqrt(mx.nd.FullyConnected(
                    mx.nd.square(w), mx.nd.ones((1, depth)), num_hidden=1, no_bias=True)), 0),
            "norm(axis=1)": (lambda: mx.nd.norm(w, axis=1), 0),
        },
    }
    print(f"operators at B={n_rows}, n={n_cols}, D={depth}, one process, MXNet {mx.__version__}")
    for task, options in choices.items():
        print(task)
        for name, (run, flop) in options.items():
            ms = median_ms(run)
            rate = f"  {flop / ms / 1e6:6.1f} GFLOP/s" if flop else ""
            print(f"  {ms:8.1f} ms{rate}  {name}")


def images_per_second(batches, count: int, batch_size: int) -> float:
    """Throughput of pulling `count` batches from an iterator (after one warm-up batch)."""
    next(batches)
    start = time.perf_counter()
    for _ in range(count):
        next(batches)
    return count * batch_size / (time.perf_counter() - start)


def without_header(source: Path, target: Path) -> Path:
    """The same JPEG records as an im2rec-style file (keys 0.., no header record),
    which is what mx.io.ImageRecordIter expects."""
    dataset = RecordDataset(source)
    target.mkdir(parents=True, exist_ok=True)
    writer = mx.recordio.MXIndexedRecordIO(str(target / "train.idx"),
                                           str(target / "train.rec"), "w")
    for key, record_id in enumerate(dataset.image_ids):
        writer.write_idx(key, dataset.records.read_bytes(int(record_id)))
    writer.close()
    return target


def run_data(args) -> None:
    """Decode + augment throughput, ours against mx.io.ImageRecordIter, same file."""
    with tempfile.TemporaryDirectory() as tmp:
        ours_dir = Path(tmp) / "ours"
        prepare_synthetic(str(ours_dir), args.classes, args.per_class, heldout=2, pairs=1)
        theirs = without_header(ours_dir, Path(tmp) / "im2rec")
        dataset = RecordDataset(ours_dir)
        batches = len(dataset) // args.batch_size - 1
        print(f"decode + mirror + normalize of {len(dataset)} 112x112 JPEGs, batch "
              f"{args.batch_size}, {batches} batches per measurement, {os.cpu_count()} cores")
        for workers in sorted({1, args.workers}):
            loader = FaceLoader(dataset, args.batch_size, num_workers=workers, seed=0)
            ours = images_per_second(iter(loader.epoch(0)), batches, args.batch_size)
            record_iter = mx.io.ImageRecordIter(
                path_imgrec=str(theirs / "train.rec"), path_imgidx=str(theirs / "train.idx"),
                data_shape=(3, FACE_SIZE, FACE_SIZE), batch_size=args.batch_size, shuffle=True,
                rand_mirror=True, mean_r=127.5, mean_g=127.5, mean_b=127.5, scale=1 / 128,
                preprocess_threads=workers, prefetch_buffer=2)
            theirs_rate = images_per_second(iter(record_iter), batches, args.batch_size)
            print(f"  {workers} worker(s): ours {ours:7.0f} img/s ({ours / workers:6.0f} per "
                  f"worker)   mx.io.ImageRecordIter {theirs_rate:7.0f} img/s   ratio "
                  f"{ours / theirs_rate:.2f}")
        plain = FaceLoader(dataset, args.batch_size, num_workers=args.workers, seed=0)
        recipe = load_config(REPO / "configs" / "orl.py").augmentation()
        augmented = FaceLoader(dataset, args.batch_size, num_workers=args.workers, seed=0,
                               augment=recipe)
        rates = [images_per_second(iter(loader.epoch(0)), batches, args.batch_size)
                 for loader in (plain, augmented, plain)]  # plain twice: the noise between
        print(f"  {args.workers} worker(s), with crop, rotation, colour and blur (configs/"
              f"orl.py): {rates[1]:7.0f} img/s; without: {rates[0]:7.0f} and {rates[2]:7.0f} "
              f"img/s; ratio {2 * rates[1] / (rates[0] + rates[2]):.2f}")
        loader = FaceLoader(dataset, args.batch_size, num_workers=args.workers, seed=0)
        wait, start = WaitTimer(), time.perf_counter()
        for _ in zip(range(batches), wait.timed(loader.epoch(0))):
            time.sleep(args.step_ms / 1000)  # an accelerator busy with the step: CPU idle
        total = time.perf_counter() - start
        print(f"data wait with {args.workers} workers while a {args.step_ms:.0f} ms step runs "
              f"elsewhere (GPU-like: CPU free): {100 * wait.seconds / total:.1f}% of the time")


def run_save(args) -> None:
    """A checkpoint shard written as checkpoint.save writes it (CRC-32 while writing,
    fsync), next to a plain np.save that the page cache absorbs, in the same run."""
    shard = np.random.default_rng(0).standard_normal((args.rows, args.embedding_size),
                                                     np.float32)
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        path = Path(directory) / "shard.npy"

        def plain() -> None:
            np.save(path, shard)

        def plain_fsync() -> None:
            np.save(path, shard)
            durable.fsync_path(path)

        def durable_write() -> None:
            durable.write_file(path, lambda f: np.save(f, shard))

        def verify() -> None:
            durable.file_record(path)

        megabytes = shard.nbytes / 2**20
        timings = {name: median_ms(run, args.repeats) for name, run in
                   (("np.save", plain), ("np.save + fsync", plain_fsync),
                    ("checksummed + fsync", durable_write),
                    ("verify (read back + CRC-32)", verify))}
    print(f"one shard of {args.rows} x {args.embedding_size} float32 ({megabytes:.0f} MiB) "
          f"in {args.dir or tempfile.gettempdir()}:")
    for name, ms in timings.items():
        print(f"  {name:28s} {ms:8.1f} ms  {megabytes / ms * 1e3:7.0f} MiB/s  "
              f"{ms / timings['np.save']:.2f}x np.save")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m partial_fc_mx.bench")
    commands = parser.add_subparsers(dest="command", required=True)
    pfc = commands.add_parser("pfc", help="one Partial FC step: time, GEMM speed, memory")
    pfc.add_argument("--classes", type=int, nargs="+", default=[1_000_000])
    pfc.add_argument("--sample-rate", type=float, default=0.1)
    pfc.add_argument("--num-sample", type=int, default=0,
                     help="sampled centers per rank, overriding --sample-rate (to compare "
                          "class counts at the same sample)")
    pfc.add_argument("--batch-size", type=int, default=128, help="per rank")
    pfc.add_argument("--embedding-size", type=int, default=512)
    pfc.add_argument("--steps", type=int, default=5)
    pfc.add_argument("--warmup", type=int, default=2)
    ops = commands.add_parser("ops", help="the operators PartialFC chose, next to alternatives")
    ops.add_argument("--batch-size", type=int, default=256, help="rows of the gathered batch")
    ops.add_argument("--num-sample", type=int, default=50000)
    ops.add_argument("--embedding-size", type=int, default=512)
    data = commands.add_parser("data", help="decode throughput against mx.io.ImageRecordIter")
    data.add_argument("--workers", type=int, default=2)
    data.add_argument("--batch-size", type=int, default=64)
    data.add_argument("--classes", type=int, default=200)
    data.add_argument("--per-class", type=int, default=20)
    data.add_argument("--step-ms", type=float, default=100.0,
                      help="simulated step time for the data-wait figure")
    save = commands.add_parser("save", help="the cost of durable, checksummed checkpoint files")
    save.add_argument("--rows", type=int, default=250_000)
    save.add_argument("--embedding-size", type=int, default=512)
    save.add_argument("--repeats", type=int, default=3)
    save.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    args = parser.parse_args(argv)
    {"pfc": run_pfc, "ops": run_ops, "data": run_data, "save": run_save}[args.command](args)


if __name__ == "__main__":
    main()
