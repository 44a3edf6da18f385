"""The classifier's GEMMs (pfc/gemm.py, kernels/gemm.cc): oneDNN 3's, loaded beside
MXNet's own oneDNN, with bfloat16 inputs and float32 accumulation and output, against
float64; and the host decision of pfc_gemm. On a CPU without bfloat16 arithmetic the
bfloat16 tests assert its refusal instead (pfc_worker.bfloat16_gemms_refused): no
test is skipped on any CPU. PartialFC with these GEMMs on 1-3 ranks: test_partial_fc's
gemm16 cases."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest
from conftest import REPO
from pfc_worker import bfloat16_gemms_refused

from partial_fc_mx.config import Config, ConfigError
from partial_fc_mx.pfc import gemm, kernels
from partial_fc_mx.pfc.centers import sampled_per_step
from partial_fc_mx.sizing.pfc_memory import estimate_memory


def rounded_to_bfloat16(x: np.ndarray) -> np.ndarray:
    """x rounded to bfloat16 (to nearest, ties to even), as float64."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    kept = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return kept.astype(np.uint32).view(np.float32).astype(np.float64)


def products(a, b, g, bfloat16: bool) -> tuple:
    """pfc_gemm(a, b) and pfc_gemm_backward(g, a, b) as float64 arrays."""
    kernels.load()
    options = {"library": str(gemm.onednn_library()), "bfloat16": int(bfloat16), "threads": 2}
    # each read before the next is pushed: a failing one raises here, not at exit
    logits = mx.nd.pfc_gemm(mx.nd.array(a), mx.nd.array(b), **options).asnumpy()
    grads = mx.nd.pfc_gemm_backward(mx.nd.array(g), mx.nd.array(a), mx.nd.array(b), **options)
    return tuple(x.astype(np.float64) for x in (logits, *(grad.asnumpy() for grad in grads)))


def relative(got, want) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("shape", [(5, 3, 7), (37, 21, 53), (130, 512, 1001)])
@pytest.mark.parametrize("bfloat16", [False, True], ids=["float32", "bfloat16"])
def test_the_gemms_equal_float64_products_of_their_rounded_inputs(shape, bfloat16):
    rows, width, cols = shape
    rng = np.random.default_rng(rows)
    a, b = (rng.standard_normal(s).astype(np.float32) for s in ((rows, width), (cols, width)))
    g = rng.random((rows, cols)).astype(np.float32)
    if bfloat16 and (refused := bfloat16_gemms_refused()):
        with pytest.raises(mx.base.MXNetError, match="returned status 3"):
            products(a, b, g, bfloat16=True)  # unimplemented here, and said so
        assert "without bfloat16 arithmetic" in refused
        return
    got = products(a, b, g, bfloat16)
    r = rounded_to_bfloat16 if bfloat16 else (lambda x: x.astype(np.float64))
    wanted = (r(a) @ r(b).T, r(g) @ r(b), r(g).T @ r(a))
    for name, have, want in zip(("a b^T", "g b", "g^T a"), got, wanted):
        assert relative(have, want) < 1e-5, name  # float32 accumulation of exact products
    if bfloat16:  # and the inputs were rounded: unrounded products are farther off
        exact = a.astype(np.float64) @ b.T.astype(np.float64)
        assert relative(got[0], exact) > 1e-4


def test_bfloat16_rounds_to_nearest_with_ties_to_even_and_keeps_nan():
    if refused := bfloat16_gemms_refused():  # nothing rounds here: the refusal is the test
        assert "without bfloat16 arithmetic" in refused
        return
    # 1 + 2^-8 lies halfway between bfloat16's 1 and 1 + 2^-7: to 1 (even); 1 + 3 * 2^-8
    # between 1 + 2^-7 and 1 + 2^-6: to 1 + 2^-6 (even); 1 + 2^-8 + 2^-20 past halfway: up
    a = np.array([[1 + 2**-8], [1 + 3 * 2**-8], [1 + 2**-8 + 2**-20], [np.nan]], np.float32)
    logits = products(a, np.ones((1, 1), np.float32), np.ones((4, 1), np.float32), True)[0]
    assert logits[:3, 0].tolist() == [1.0, 1 + 2**-6, 1 + 2**-7]
    assert np.isnan(logits[3, 0])


def test_a_missing_onednn_is_float32_under_auto_and_refused_by_name_when_asked(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    choice = gemm.choose("auto", on_gpu=False)
    assert choice.dtype == "float32" and "onednn-cpu-gomp" in choice.reason
    with pytest.raises(gemm.GemmChoiceError, match=r"pip install onednn-cpu-gomp==2023\.2\.0"):
        gemm.choose("bfloat16", on_gpu=False)


def test_a_gpu_keeps_float32_gemms_and_refuses_the_cpus_bfloat16():
    assert gemm.choose("auto", on_gpu=True).dtype == "float32"
    with pytest.raises(gemm.GemmChoiceError, match="a CPU setting"):
        gemm.choose("bfloat16", on_gpu=True)


CHOICE = """
from partial_fc_mx.pfc import gemm
library = gemm.onednn_library()
native = bool(gemm.effective_isa(library) & gemm.ISA_BFLOAT16)
choice = gemm.choose("auto", on_gpu=False)
print(native, choice.dtype, choice.reason)
"""


@pytest.mark.parametrize("cap", [None, "AVX2"])
def test_auto_takes_bfloat16_exactly_where_onednn_says_the_cpu_computes_it(cap):
    """What oneDNN 3 reports decides, with DNNL_MAX_CPU_ISA honoured (a new process:
    oneDNN reads the cap once); under the AVX2 cap every CPU takes float32."""
    env = {key: value for key, value in os.environ.items() if key != "DNNL_MAX_CPU_ISA"}
    if cap:
        env["DNNL_MAX_CPU_ISA"] = cap
    said = subprocess.run([sys.executable, "-c", CHOICE], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert said.returncode == 0, said.stderr[-2000:]
    native, dtype, reason = said.stdout.strip().splitlines()[-1].split(" ", 2)
    assert dtype == ("bfloat16" if native == "True" else "float32"), reason
    if cap:
        assert native == "False" and "avx2" in reason and "without bfloat16" in reason


TWO_ONEDNNS = """
import ctypes
import mxnet as mx, numpy as np
from partial_fc_mx.config import Config, ConfigError
from partial_fc_mx.pfc import gemm, kernels
from partial_fc_mx.pfc.centers import sampled_per_step
from partial_fc_mx.sizing.pfc_memory import estimate_memory
rng = np.random.default_rng(0)
x = rng.standard_normal((8, 3, 12, 12)).astype(np.float32)
w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
conv = lambda: mx.nd.Convolution(mx.nd.array(x), mx.nd.array(w), kernel=(3, 3), num_filter=4,
                                 no_bias=True).asnumpy()
before = conv()
library = gemm.onednn_library()
version = gemm.opened(library).dnnl_version
version.restype = ctypes.POINTER(ctypes.c_int * 3)
kernels.load()
a = rng.standard_normal((6, 5)).astype(np.float32)
both = mx.nd.pfc_gemm(mx.nd.array(a), mx.nd.array(a), library=str(library), bfloat16=0,
                      threads=1).asnumpy()
assert np.allclose(both, a @ a.T, atol=1e-5)
assert np.array_equal(conv(), before), "MXNet's oneDNN computes otherwise after oneDNN 3 loaded"
print("oneDNN", version().contents[0], "beside MXNet's")
"""


def test_onednn_3_loads_beside_mxnets_own_onednn_and_neither_calls_the_other():
    said = subprocess.run([sys.executable, "-c", TWO_ONEDNNS], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert said.returncode == 0, said.stderr[-2000:]
    assert "oneDNN 3 beside MXNet's" in said.stdout


def test_the_memory_estimate_counts_the_rounded_copies_of_the_gemms_inputs():
    args = (1_000_000, 512, 2, 0, 0.1, 1024)
    plain, rounded = (estimate_memory(*args, gemm_dtype=dtype) for dtype in ("float32", "bfloat16"))
    n, batch, width = sampled_per_step(500_000, 0.1, 1024), 1024, 512
    assert rounded.centers == plain.centers  # the stored rows are as they were
    assert rounded.working - plain.working == 2 * (n * width + batch * width + batch * n)


@pytest.mark.parametrize("setting", ["float16", "bf16", ""])
def test_a_pfc_gemm_setting_that_does_not_exist_is_refused_with_the_ones_that_do(setting):
    with pytest.raises(ConfigError, match=r"pfc_gemm=.* must be one of 'auto', 'float32', "
                                          r"'bfloat16'"):
        Config(pfc_gemm=setting).validate()
