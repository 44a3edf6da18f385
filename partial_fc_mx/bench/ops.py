"""The operator choices inside PartialFC, each next to its alternatives (one process)."""

from __future__ import annotations

import argparse
from pathlib import Path

import mxnet as mx
import numpy as np

from ..pfc import kernels
from ..pfc.buffers import Buffers
from ..pfc.center_optimizers.sgd import SGD
from ..pfc.centers import SPARE_CENTERS, CenterBlock, Shard
from ..pfc.gemm import (
    ISA_BFLOAT16,
    GemmChoiceError,
    effective_isa,
    fully_connected_backward,
    onednn_library,
)
from ..pfc.rows import ComposedRows, FusedRows
from ..pfc.threads import rank_threads
from .timing import median_ms


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=256, help="rows of the gathered batch")
    parser.add_argument("--num-sample", type=int, default=50000)
    parser.add_argument("--embedding-size", type=int, default=512)


FAST_PATH = 1.2
"""A GEMM more than this many times slower than FullyConnected's forward at the same
flop count is off the fast path (issue 28: OpenBLAS where oneDNN would run)."""


def run(args: argparse.Namespace) -> None:
    n_rows, n_cols, depth = args.batch_size, args.num_sample, args.embedding_size
    rng = np.random.default_rng(0)
    x = mx.nd.array(rng.standard_normal((n_rows, depth)))
    w = mx.nd.array(rng.standard_normal((n_cols, depth)))
    g = mx.nd.array(rng.standard_normal((n_rows, n_cols)))
    grad_x, grad_w = mx.nd.zeros((n_rows, depth)), mx.nd.zeros((n_cols, depth))
    ones_depth = mx.nd.ones((1, depth))
    print(f"operators at B={n_rows}, n={n_cols}, D={depth}, one process, MXNet {mx.__version__}")
    print_gemm_rates(x, w, g, grad_x, grad_w)
    choices = {
        "row sums of an n x D product (the centers' gradient projection)": {
            "FullyConnected(m, ones) (used by ComposedRows, a GPU's)": (
                lambda: mx.nd.FullyConnected(w, ones_depth, num_hidden=1, no_bias=True), 0),
            "sum(axis=1)": (lambda: w.sum(axis=1), 0),
        },
        "norms of the n x D sampled centers": {
            "sqrt(FullyConnected(square(w), ones)) (used by ComposedRows)": (
                lambda: mx.nd.sqrt(mx.nd.FullyConnected(
                    mx.nd.square(w), ones_depth, num_hidden=1, no_bias=True)), 0),
            "norm(axis=1)": (lambda: mx.nd.norm(w, axis=1), 0),
        },
    }
    for task, options in choices.items():
        print(task)
        for name, (run, flop) in options.items():
            ms = median_ms(run)
            rate = f"  {flop / ms / 1e6:6.1f} GFLOP/s" if flop else ""
            print(f"  {ms:8.1f} ms{rate}  {name}")
    print_row_passes(rng, n_rows, n_cols, depth)


def print_row_passes(rng, n_rows: int, n_cols: int, depth: int) -> None:
    """The step's passes outside the GEMMs (rows.py, and SGD on the sampled rows): the
    CPU's fused kernels beside the MXNet operators a GPU runs, on the same arrays."""
    logits = mx.nd.array(rng.standard_normal((n_rows, n_cols + SPARE_CENTERS)) * 3)
    w = mx.nd.array(rng.standard_normal((n_cols, depth)))
    grad, v = mx.nd.array(rng.standard_normal((n_cols, depth))), mx.nd.zeros((n_cols, depth))
    norms = mx.nd.array(rng.uniform(0.5, 2, n_cols))
    shard = 10 * n_cols  # sampled at 0.1
    block = CenterBlock(Shard(0, shard), depth, SGD(), ctx=mx.cpu(), dtype="float32", lazy=True)
    index = mx.nd.array(np.sort(rng.choice(shard, n_cols, replace=False)), dtype="int64")
    sampled = block.sampled_weights(index)  # gathered in the step's forward, for the GEMMs
    print(f"the row passes: {n_rows} x {n_cols + SPARE_CENTERS} logits, {n_cols} x {depth} "
          f"centers of a {shard:,}-row shard")
    for name, rows, sgd in (
            ("fused C++ kernels (CPU; used)", FusedRows(rank_threads()), SGD()),
            ("MXNet operators (a GPU's path)", ComposedRows(Buffers(mx.cpu())),
             SGD(fused=False))):
        times = {
            "v = w s / |w|": median_ms(lambda rows=rows: rows.scale(w, 64.0, out=v)),
            "softmax with the spare column": median_ms(
                lambda rows=rows: rows.softmax_with_spare(logits)),
            "gradient projection": median_ms(
                lambda rows=rows: rows.project(grad, w, norms, norms)),
            "SGD on the sampled rows": median_ms(
                lambda sgd=sgd: sgd.update(block, index, sampled, grad, 1e-9)),
        }
        print(f"  {sum(times.values()):8.1f} ms  {name}: " +
              ", ".join(f"{task} {ms:.1f}" for task, ms in times.items()))


def print_gemm_rates(x, w, g, grad_x, grad_w) -> None:
    """Each of the step's three GEMMs (2 B n D flop each) beside FullyConnected's
    forward, oneDNN's inner product, in the same process: a ratio above FAST_PATH
    marks a GEMM that runs on a slower library (the wheel's OpenBLAS for `dot` and
    `linalg.gemm` on some CPUs)."""
    n_rows, n_cols, depth = g.shape[0], g.shape[1], x.shape[1]
    flop = 2 * n_rows * n_cols * depth
    gram = mx.nd.zeros_like(g)  # every output in a buffer kept across calls, as in the step
    g_host, w_host, x_host = g.asnumpy(), w.asnumpy(), grad_x.asnumpy()
    gemms = {
        "G = x w^T: FullyConnected forward (used; the reference)": (
            lambda: mx.nd.FullyConnected(x, w, num_hidden=n_cols, no_bias=True, out=gram), 1),
        "dx and dw: FullyConnected's backward (oneDNN; used), per GEMM": (
            lambda: fully_connected_backward(g, x, w, grad_x, grad_w), 2),
        "dw = g^T x: linalg.gemm(transpose_a)": (
            lambda: mx.nd.linalg.gemm(g, x, grad_w, transpose_a=True, beta=1.0, out=grad_w), 1),
        "dx = g w: dot": (lambda: mx.nd.dot(g, w, out=grad_x), 1),
        "dx = g w: numpy matmul (reference; the step stays in MXNet)": (
            lambda: np.matmul(g_host, w_host, out=x_host), 1),
        **onednn_gemms(x, w, g, gram, grad_x, grad_w),
    }
    print(f"the three GEMMs of a step, {flop / 1e9:.2f} GFLOP each")
    forward_ms = None
    for name, (run, count) in gemms.items():
        ms = median_ms(run) / count
        forward_ms = forward_ms or ms
        ratio = round(ms / forward_ms, 2)  # the flag follows the printed figure
        flag = "  OFF THE FAST PATH" if ratio > FAST_PATH else ""
        print(f"  {ms:9.2f} ms  {flop / ms / 1e6:6.1f} GFLOP/s  {ratio:4.2f}x forward  "
              f"{name}{flag}")


def onednn_gemms(x, w, g, gram, grad_x, grad_w) -> dict:
    """oneDNN 3's GEMMs (kernels/gemm.cc): float32, and bfloat16 inputs with float32
    output (pfc_gemm = "bfloat16", the rounding inside the time) where the CPU computes
    them; says why where oneDNN 3 is missing or the CPU cannot."""
    try:
        library = str(onednn_library())
        bfloat16 = bool(effective_isa(Path(library)) & ISA_BFLOAT16)
    except GemmChoiceError as missing:
        print(f"oneDNN 3 not timed: {missing}")
        return {}
    kernels.load()
    threads = rank_threads()
    gemms = {}
    for name, rounded in (("float32", 0), ("bfloat16 inputs (pfc_gemm bfloat16)", 1)):
        if rounded and not bfloat16:
            print("oneDNN 3's bfloat16 GEMMs not timed: this CPU has no bfloat16 arithmetic")
            continue
        options = {"library": library, "bfloat16": rounded, "threads": threads}
        gemms[f"G = x w^T: oneDNN 3, {name}"] = (
            lambda options=options: mx.nd.pfc_gemm(x, w, out=gram, **options), 1)
        gemms[f"dx and dw: oneDNN 3, {name}, per GEMM"] = (
            lambda options=options: mx.nd.pfc_gemm_backward(g, x, w, out=[grad_x, grad_w],
                                                            **options), 2)
    return gemms
