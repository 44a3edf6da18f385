"""The step's shapes, as `bench pfc` and `bench anchor` take them: the same options
give both the same global batch, classes and sampled centers per rank."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--classes", type=int, nargs="+", default=[1_000_000])
    parser.add_argument("--sample-rate", type=float, default=0.1)
    parser.add_argument("--num-sample", type=int, default=0,
                        help="sampled centers per rank, overriding --sample-rate (to compare "
                             "class counts at the same sample)")
    parser.add_argument("--batch-size", type=int, default=128, help="per rank")
    parser.add_argument("--embedding-size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)


def sample_rate(args: argparse.Namespace, shard_rows: int) -> float:
    """The sample rate that gives a shard of `shard_rows` rows --num-sample sampled
    centers (when given; truncated to an int, as both implementations do)."""
    if not args.num_sample:
        return args.sample_rate
    return min(1.0, (args.num_sample + 0.5) / shard_rows)
