"""Partial FC's three GEMMs (the logits x_hat @ v^T, then prob @ v and prob^T @ x_hat),
most of a step's time, and the precision of their inputs (config `pfc_gemm`).

- FullyConnectedGemm, float32 on any device: MXNet's FullyConnected and its backward
  operator (oneDNN 2's inner product on the CPU, cuBLAS on a GPU).
- OneDNNGemm, on the CPU, through oneDNN 3 (the PyPI package onednn-cpu-gomp, loaded
  beside MXNet's own oneDNN 2 by kernels/gemm.cc): the inputs rounded to bfloat16 (to
  nearest even), float32 accumulation and output (`dnnl_gemm_bf16bf16f32`). On a CPU
  with AVX512_BF16 the three GEMMs took 0.42-0.53x FullyConnected's time, rounding
  included (docs/benchmarks.md). The logits are written in float32 and the margin,
  softmax, loss and every update stay float32: only the inputs lose bits, 16 of
  float32's 24, which bounds a cosine's error by 2 * 2^-8 (each product's two
  roundings; |x_hat| = |w_hat| = 1), the band the exactness tests hold it to.

`pfc_gemm = "auto"` takes bfloat16 where oneDNN 3 says the CPU computes it natively
(its effective ISA, so DNNL_MAX_CPU_ISA caps it), float32 elsewhere, and says why
(`choose`). oneDNN 3's float32 GEMM was no faster than FullyConnected here (0.83-1.14x
inside MXNet, 2 threads, AVX-512): float32 stays FullyConnected's. float16 on a GPU
(MXNet's FullyConnected there writes float16, which 64 x cos cannot afford) is not
built: a GPU trains the classifier in float32, as arcface_torch ships it.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path

import mxnet as mx
from mxnet.ndarray import register

from ..errors import UserError
from . import kernels
from .threads import rank_threads

ONEDNN_PACKAGE = "onednn-cpu-gomp"
"""oneDNN 3 on PyPI, built for GNU OpenMP (the runtime MXNet and the kernels use)."""
ISA_BFLOAT16 = 0x80
"""The bit of oneDNN's dnnl_cpu_isa_t that its ISAs with bfloat16 arithmetic carry
(avx512_core_bf16 0xe7, avx512_core_fp16 0x1ef, avx512_core_amx 0xfef)."""


class GemmChoiceError(UserError, RuntimeError):
    """pfc_gemm asks for what this host cannot do; says what to set instead."""


@dataclass(frozen=True)
class GemmChoice:
    """The classifier GEMMs' input type on one host (or agreed by all), and why."""

    dtype: str
    """"bfloat16" or "float32"."""
    reason: str


class FullyConnectedGemm:
    """float32, MXNet's own operators."""

    dtype = "float32"

    def logits(self, x_hat: mx.nd.NDArray, v: mx.nd.NDArray, out: mx.nd.NDArray) -> None:
        """out = x_hat @ v^T."""
        mx.nd.FullyConnected(x_hat, v, num_hidden=v.shape[0], no_bias=True, out=out)

    def backward(self, prob: mx.nd.NDArray, data: mx.nd.NDArray, v: mx.nd.NDArray,
                 grad_data: mx.nd.NDArray, grad_v: mx.nd.NDArray) -> None:
        """grad_data = prob @ v and grad_v = prob^T @ data."""
        fully_connected_backward(prob, data, v, grad_data, grad_v)


class OneDNNGemm:
    """bfloat16 inputs, float32 accumulation and output, by oneDNN 3 (kernels/gemm.cc)."""

    dtype = "bfloat16"

    def __init__(self, library: Path, threads: int) -> None:
        kernels.load()
        self.library, self.threads = str(library), threads

    def logits(self, x_hat: mx.nd.NDArray, v: mx.nd.NDArray, out: mx.nd.NDArray) -> None:
        mx.nd.pfc_gemm(x_hat, v, library=self.library, bfloat16=1, threads=self.threads,
                       out=out)

    def backward(self, prob: mx.nd.NDArray, data: mx.nd.NDArray, v: mx.nd.NDArray,
                 grad_data: mx.nd.NDArray, grad_v: mx.nd.NDArray) -> None:
        mx.nd.pfc_gemm_backward(prob, data, v, library=self.library, bfloat16=1,
                                threads=self.threads, out=[grad_data, grad_v])


def classifier_gemm(dtype: str) -> FullyConnectedGemm | OneDNNGemm:
    """The GEMMs of a choice's dtype (`choose`'s, agreed by every rank), on the threads
    MXNet's own operators use in this process."""
    if dtype == "bfloat16":
        return OneDNNGemm(onednn_library(), rank_threads())
    return FullyConnectedGemm()


def choose(setting: str, on_gpu: bool) -> GemmChoice:
    """This host's classifier GEMMs for config pfc_gemm, and why."""
    if setting == "float32":
        return GemmChoice("float32", "pfc_gemm='float32'")
    if on_gpu:
        if setting == "bfloat16":
            raise GemmChoiceError("pfc_gemm='bfloat16' is a CPU setting (oneDNN 3): on a GPU "
                                  "set pfc_gemm='auto' or 'float32'")
        return GemmChoice("float32", "a GPU: 16-bit classifier GEMMs are built for CPUs only")
    try:
        library = onednn_library()
    except GemmChoiceError as missing:
        if setting == "bfloat16":
            raise
        return GemmChoice("float32", f"no bfloat16 GEMMs: {missing}")
    isa = effective_isa(library)
    if not isa & ISA_BFLOAT16:
        why = (f"oneDNN 3 uses {isa_name(library, isa)} on this CPU, without bfloat16 "
               "arithmetic (AVX512_BF16 or AMX)")
        if setting == "bfloat16":
            raise GemmChoiceError(f"pfc_gemm='bfloat16': {why}; set pfc_gemm='auto' (float32 "
                                  "here) or 'float32'")
        return GemmChoice("float32", f"pfc_gemm='auto': {why}")
    return GemmChoice("bfloat16", f"pfc_gemm={setting!r}: oneDNN 3 uses "
                                  f"{isa_name(library, isa)} (bfloat16 inputs, float32 output)")


def onednn_library() -> Path:
    """libdnnl.so.3 of the installed onednn-cpu-gomp package, or why there is none."""
    try:
        files = importlib.metadata.distribution(ONEDNN_PACKAGE).files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name == "libdnnl.so.3":
            path = Path(file.locate()).resolve()
            if path.is_file():
                return path
    raise GemmChoiceError(f"{ONEDNN_PACKAGE} (oneDNN 3) is not installed in this Python: "
                          f"pip install {ONEDNN_PACKAGE}==2023.2.0, as setup-utils/install.sh "
                          "does, or set pfc_gemm='float32'")


@functools.cache
def opened(library: Path) -> ctypes.CDLL:
    """oneDNN 3, opened as kernels/gemm.cc opens it: its symbols its own, never global."""
    return ctypes.CDLL(str(library), mode=os.RTLD_LAZY | os.RTLD_LOCAL | os.RTLD_DEEPBIND)


def effective_isa(library: Path) -> int:
    """oneDNN 3's dnnl_cpu_isa_t for this CPU, capped by DNNL_MAX_CPU_ISA."""
    return int(opened(library).dnnl_get_effective_cpu_isa())


def isa_name(library: Path, isa: int) -> str:
    """oneDNN's own description of an ISA, e.g. "Intel AVX2"."""
    describe = opened(library).dnnl_cpu_isa2str
    describe.restype, describe.argtypes = ctypes.c_char_p, [ctypes.c_int]
    name = describe(isa)
    return name.decode().removeprefix("cpu_isa_") if name else f"ISA {isa:#x}"


def fully_connected_backward(grad_out: mx.nd.NDArray, data: mx.nd.NDArray,
                             weight: mx.nd.NDArray, grad_data: mx.nd.NDArray,
                             grad_weight: mx.nd.NDArray) -> None:
    """grad_data = grad_out @ weight and grad_weight = grad_out^T @ data (float32, with
    autograd paused by the caller), by FullyConnected's own backward operator: on the
    CPU oneDNN's inner-product primitives, as fast as the forward (`bench ops`), where
    `dot` and `linalg.gemm` run on the wheel's OpenBLAS, up to 5x slower on some CPUs;
    cuBLAS on a GPU. Invoked the way MXNet's generated operators are (looked up at each
    call, so that a wrapper such as tests/context_guard.py sees it too)."""
    register._imperative_invoke(fully_connected_backward_op(), [grad_out, data, weight],
                                ["num_hidden", "no_bias"], [str(weight.shape[0]), "True"],
                                [grad_data, grad_weight], False, True)


@functools.cache
def fully_connected_backward_op() -> int:
    handle = mx.base.OpHandle()
    mx.base.check_call(mx.base._LIB.NNGetOpHandle(mx.base.c_str("_backward_FullyConnected"),
                                                  ctypes.byref(handle)))
    return handle.value
