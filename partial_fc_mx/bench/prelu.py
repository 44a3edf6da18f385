"""The backbones' CPU kernels (run/cpu_kernels.py): a backbone's forward and backward
on random images with MXNet's LeakyReLU and LayerNorm (the network's own graph) and
with the project's kernels (the graph the trainer trains on the CPU: for an IResNet or
MobileFaceNet its PReLU, for a ViT its LayerNorm), in turn in one process, so that
both see the same machine; their medians and ratio.

    python -m partial_fc_mx.bench prelu --networks mbf r18 --batch-size 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import mxnet as mx

from ..config import Config
from ..data.transforms import FACE_SIZE
from ..pfc.threads import rank_threads
from ..run.precision import build_backbone


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--networks", nargs="+", default=["mbf", "r18"])
    parser.add_argument("--batch-size", type=int, default=64, help="images per step")
    parser.add_argument("--rounds", type=int, default=5,
                        help="alternating rounds; one step of each graph per round")


def run(args: argparse.Namespace) -> None:
    print(f"forward and backward, batch {args.batch_size}, float32, {rank_threads()} "
          f"thread(s), MXNet {mx.__version__}")
    for name in args.networks:
        net, model = build_backbone(Config(network=name), mx.cpu())
        images = mx.nd.random.uniform(-1, 1, (args.batch_size, 3, FACE_SIZE, FACE_SIZE))
        graphs = {"LeakyReLU": net, "kernel": model}
        seconds: dict[str, list[float]] = {label: [] for label in graphs}
        for block in graphs.values():
            step_seconds(block, images)  # warm-up: the cached graph and oneDNN's primitives
        for _ in range(args.rounds):
            for label, block in graphs.items():
                seconds[label].append(step_seconds(block, images))
        mxnet, kernel = (statistics.median(seconds[label]) for label in graphs)
        print(f"{name}: LeakyReLU {mxnet:.3f} s, kernel {kernel:.3f} s "
              f"(medians of {args.rounds}); LeakyReLU / kernel = {mxnet / kernel:.2f}")


def step_seconds(block: mx.gluon.HybridBlock, images: mx.nd.NDArray) -> float:
    """Wall seconds of one training-mode forward and backward, all of it computed."""
    mx.nd.waitall()
    start = time.perf_counter()
    with mx.autograd.record():
        embeddings = block(images)
    embeddings.backward()
    mx.nd.waitall()
    return time.perf_counter() - start
