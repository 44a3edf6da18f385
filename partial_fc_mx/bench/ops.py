"""The operator choices inside PartialFC, each next to its alternatives (one process)."""

from __future__ import annotations

import argparse

import mxnet as mx
import numpy as np

from .timing import median_ms


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=256, help="rows of the gathered batch")
    parser.add_argument("--num-sample", type=int, default=50000)
    parser.add_argument("--embedding-size", type=int, default=512)


def run(args: argparse.Namespace) -> None:
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
