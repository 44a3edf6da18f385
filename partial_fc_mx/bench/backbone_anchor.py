"""arcface_torch's own backbones (its `get_model`), forward and backward on random
images: the anchor `bench train`'s backbone phases are measured against (issue 70).
One process in an environment with torch (CPU) and no MXNet, insightface's files
from a checkout the user names:

    OMP_NUM_THREADS=1 PYTHONPATH=. torch-venv/bin/python -m partial_fc_mx.bench \\
        backbone_anchor --arcface-torch insightface/recognition/arcface_torch \\
        --networks vit_t vit_s --batch-size 32

Beside it, ours with the same threads: `OMP_NUM_THREADS=1 python -m partial_fc_mx.bench
train --networks vit_t vit_s --batch-size 32 --heads pfc --classes 1000` (its
"backbone forward" and "backbone backward" phases). One step here is what
arcface_torch's train_v2.py does to the backbone: the network in training mode (its
drop path and patch masking on), forward, the backward of a loss on the embeddings
(a fixed random projection: the classifier's gradient stands in), zero_grad; no
optimizer step (`bench train` times ours apart, "backbone update"). `--bfloat16`
runs it under CPU autocast in bfloat16, where the CPU computes it. torch and
insightface are imported only here.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from ..tools.anchor_shapes import anchor_get_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arcface-torch", type=Path, required=True,
                        help="the recognition/arcface_torch folder of an insightface checkout")
    parser.add_argument("--networks", nargs="+", default=["vit_t", "vit_s"])
    parser.add_argument("--batch-size", type=int, nargs="+", default=[32])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--bfloat16", action="store_true",
                        help="under torch.autocast('cpu', dtype=torch.bfloat16)")


def run(args: argparse.Namespace) -> None:
    import torch

    get_model = anchor_get_model(args.arcface_torch)
    precision = "bfloat16 (CPU autocast)" if args.bfloat16 else "float32"
    print(f"arcface_torch backbones, {precision}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; step = median wall ms of forward + backward "
          "+ zero_grad in training mode")
    for network in args.networks:
        for batch in args.batch_size:
            ms = step_ms(torch, get_model(network, dropout=0.0, fp16=False, num_features=512),
                         batch, args)
            print(f"{network:>8}  batch {batch:>4}  step {ms:9.1f} ms  "
                  f"{ms / batch:7.2f} ms/image", flush=True)


def step_ms(torch, net, batch: int, args: argparse.Namespace) -> float:
    torch.manual_seed(0)
    net.train()
    images = torch.randn(batch, 3, 112, 112)
    projection = torch.randn(batch, 512)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bfloat16):
            embeddings = net(images)
        (embeddings.float() * projection).sum().backward()
        net.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)
