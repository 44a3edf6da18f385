"""Mixed precision (config `fp16`): the backbone computes in 16 bits, with dynamic loss
scaling; its parameters, their gradients and the optimizer stay float32.

The backbone's graph is converted with MXNet's AMP (`amp.convert_symbol`: a cast
before every input of a convolution, dense layer and PReLU), rather than
`amp.init()`, which patches every MXNet operator process-wide and would turn Partial
FC's logits and softmax to 16 bits too; those stay float32. The converted graph
shares the float32 network's parameters (`training_model`), so:
  - checkpoints, --load-from and --resume-from are the same files in either
    precision (the float32 network's structure names: `features.0.weight`);
  - backbone-*.params and backbone.onnx are exported from the float32 network,
    with no cast node and no 16-bit parameter;
  - every parameter's gradient is float32 (the casts' backward converts them).

On a GPU the 16 bits are float16. MXNet 1.9.1 has no float16 convolution on the CPU
('FP16 gemm on cpu not implemented'), so a CPU host that computes bfloat16 natively runs
the same conversion in bfloat16, and other CPUs train in float32 (cpu_precision.py): a
user's GPU config runs unchanged on any CPU host, and the conversion, the scaler and
the checkpoints are exercised by real training where no GPU exists.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import mxnet as mx
import numpy as np

from ..backbones import get_model, graph_of, infers_with_another_graph
from ..backbones.float32 import float32_operators
from ..backbones.modes import ByMode, graph_block
from ..data.transforms import FACE_SIZE
from ..errors import UserError
from ..pfc.centers import HOST_CHUNK_ELEMENTS
from ..pfc.threads import rank_threads
from .cpu_kernels import with_cpu_kernels

if TYPE_CHECKING:
    from ..config import Config

MULTI_ALL_FINITE_MAX = 200
"""multi_all_finite's kernel holds 200 arrays and does not check the count: 201 crash
MXNet 1.9.1 (its own loss scaler calls it in chunks of 200)."""


class PrecisionError(UserError, ValueError):
    """A backbone whose conversion to 16 bits would leave a parameter in 16 bits."""


def all_finite(arrays: list) -> bool:
    """No NaN or Inf in any of `arrays`: those in host memory checked by numpy, the
    others by MXNet's fused kernel (fused_all_finite). On the host numpy is about 15x
    faster: 0.04 s against 0.6 s for 47 M float32 values here, which r50's parameters
    are; a save checks every weight it writes."""
    on_host = [array for array in arrays if array.context.device_type.startswith("cpu")]
    on_device = [array for array in arrays if not array.context.device_type.startswith("cpu")]
    return all(map(host_all_finite, on_host)) and fused_all_finite(on_device)


def host_all_finite(array: mx.nd.NDArray) -> bool:
    """No NaN or Inf in a host array, copied out a part at a time (a block of class
    centers can be larger than the host's free memory)."""
    rows = max(1, HOST_CHUNK_ELEMENTS // (array.size // array.shape[0]))
    return all(np.isfinite(array[low:low + rows].asnumpy()).all()
               for low in range(0, array.shape[0], rows))


def fused_all_finite(arrays: list) -> bool:
    """No NaN or Inf in any of `arrays` (a GPU's: one kernel per chunk, no copy to the
    host): one fused check per dtype (multi_all_finite needs its inputs alike: float16
    centers beside float32 states) and per 200 arrays (its limit; r50 has 396
    parameters)."""
    by_dtype: dict = {}
    for array in arrays:
        by_dtype.setdefault(array.dtype, []).append(array)
    chunks = [group[i:i + MULTI_ALL_FINITE_MAX] for group in by_dtype.values()
              for i in range(0, len(group), MULTI_ALL_FINITE_MAX)]
    flags = [mx.nd.multi_all_finite(*chunk, num_arrays=len(chunk)) for chunk in chunks]
    return all(bool(flag.asscalar()) for flag in flags)


def build_backbone(config: Config, ctx: mx.Context, dtype: str = "float32") -> tuple:
    """(net, model): the float32 network, and what computes the embeddings: net itself
    in float32, else its mixed-precision graph in `dtype` over the same parameters
    (cpu_precision.py chooses the type).

    Parameters get their shapes by shape inference, not by a forward pass: an
    inference-mode forward lets oneDNN reorder the weights in place into its blocked
    layout, and the raw-byte writes of the parameter broadcast and load_parameters
    into such arrays corrupted them (crashes, MPI_ERR_TRUNCATE, hangs)."""
    net = get_model(config.network, config.embedding_size, config.dropout)
    net.initialize(mx.init.Xavier(rnd_type="gaussian", factor_type="out", magnitude=2),
                   ctx=ctx)
    net.infer_shape(mx.nd.zeros((1, 3, FACE_SIZE, FACE_SIZE), ctx=ctx))
    for param in net.collect_params().values():
        param._finish_deferred_init()
    net.hybridize(static_alloc=True, static_shape=True)
    return net, training_model(net, ctx, dtype)


def training_model(net: mx.gluon.HybridBlock, ctx: mx.Context,
                   dtype: str) -> mx.gluon.HybridBlock | ByMode:
    """What computes the embeddings, in training and in evaluation: `net` itself in
    float32 on a GPU; otherwise `net`'s graph as training_graph makes it, as a block
    whose parameters are `net`'s own float32 Parameter objects: an update of either is
    an update of both (with its inference graph beside it, made the same way, where
    the training graph cannot infer: modes.py). Built from the symbols alone: nothing
    is computed, so it can be built and checked on any device."""
    cpu_kernels = uses_cpu_kernels(net, ctx, dtype)
    if dtype == "float32" and not cpu_kernels:
        return net  # a masking ViT infers through its inference graph itself (vit.py)

    def block(training: bool) -> mx.gluon.SymbolBlock:
        graph = training_graph(graph_of(net, training), dtype, cpu_kernels)
        return graph_block(graph, ("data",), net)

    return ByMode(block(True), block(False)) if infers_with_another_graph(net) else block(True)


def uses_cpu_kernels(net: mx.gluon.HybridBlock, ctx: mx.Context, dtype: str) -> bool:
    """Whether `net` trains with the project's PReLU and LayerNorm kernels
    (cpu_kernels.py): on the CPU, in float32 or bfloat16 (float16 is a GPU's), and not
    where a parameter accumulates its gradient (grad_req "add": they write it)."""
    return (ctx.device_type == "cpu" and dtype != "float16"
            and all(p.grad_req != "add" for p in net.collect_params().values()))


def training_graph(graph: mx.sym.Symbol, dtype: str, cpu_kernels: bool,
                   inputs: tuple[str, ...] = ("data",)) -> mx.sym.Symbol:
    """`graph` (over float32 `inputs`) as it trains: in `dtype` (mixed_precision_graph)
    and with the CPU's kernels where `cpu_kernels`."""
    if dtype != "float32":
        graph = mixed_precision_graph(graph, dtype, inputs)
    if cpu_kernels:  # after AMP: its float32 casts for LeakyReLU and LayerNorm serve them
        graph = with_cpu_kernels(graph, rank_threads())
    return graph


def mixed_precision_graph(graph: mx.sym.Symbol, dtype: str,
                          inputs: tuple[str, ...] = ("data",)) -> mx.sym.Symbol:
    """`graph` (over float32 `inputs`) with AMP's casts: convolutions and dense layers (and, in
    float16, PReLU) compute in `dtype`, except those the backbone keeps in float32
    (backbones/float32.py); every parameter stays a float32 input."""
    from mxnet.contrib import amp
    from mxnet.contrib.amp import lists

    ops = lists.symbol_fp16 if dtype == "float16" else lists.symbol_bf16
    # PReLU (LeakyReLU) is in no AMP list, so it ran in its input's 16 bits and type
    # inference made its slope a 16-bit parameter. Listed, its slope gets a cast like
    # every weight: in float16 it computes in 16 bits; oneDNN has no bfloat16 PReLU.
    # (AMP's float32 rule for LeakyReLU's elu and selu goes with it: no backbone here
    # uses them.)
    conditional = [c for c in ops.CONDITIONAL_FP32_FUNCS if c[0] != "LeakyReLU"]
    target = [*(ops.FP16_FUNCS if dtype == "float16" else ops.BF16_FUNCS)]
    fp32 = [*ops.FP32_FUNCS]
    (target if dtype == "float16" else fp32).append("LeakyReLU")
    converted = amp.convert_symbol(graph, dtype, target_dtype_ops=target, fp32_ops=fp32,
                                   conditional_fp32_ops=conditional, data_names=list(inputs),
                                   excluded_sym_names=float32_operators(graph))
    if problem := low_precision_parameters(converted, inputs):
        raise PrecisionError(problem)
    return converted


def low_precision_parameters(graph: mx.sym.Symbol,
                             inputs: tuple[str, ...] = ("data",)) -> str | None:
    """Why `graph` cannot share float32 parameters (some argument other than its
    float32 `inputs` would be typed 16-bit), or None."""
    arg_types, _, aux_types = graph.infer_type(**dict.fromkeys(inputs, "float32"))
    names = graph.list_arguments() + graph.list_auxiliary_states()
    wrong = [name for name, kind in zip(names, arg_types + aux_types)
             if kind is not None and np.dtype(kind) != np.float32]
    if not wrong:
        return None
    return (f"the mixed-precision backbone would hold {len(wrong)} parameter(s) in 16 bits "
            f"({', '.join(wrong[:4])}): an operator outside AMP's lists takes them; add it "
            "to precision.mixed_precision_graph's lists")


def clip_global_norm(arrays: list, max_norm: float, unit: float = 1.0) -> float:
    """Scale `arrays` in place so that the L2 norm of all of them together, times
    `unit`, is at most `max_norm`; returns that norm before clipping. Any mix of
    float16 and float32 arrays (Gluon's clip_global_norm adds their norms with add_n,
    which refuses mixed types); every norm is taken in float32 of the array times
    `unit`, so loss-scaled gradients (unit = 1 / scale) do not overflow in the squares."""
    squares = [mx.nd.square(mx.nd.norm(a.astype("float32", copy=False) * unit))
               for a in arrays]
    total = math.sqrt(float(mx.nd.add_n(*squares).asscalar()))
    if total > max_norm:
        for array in arrays:
            array *= max_norm / total
    return total


FIRST_SCALE = 2.0**16


class LossScaler:
    """Multiply the loss (here: its gradient) by `scale` so float16 gradients do not
    underflow; halve it after an overflow (the step is skipped), double it after
    `growth_interval` clean steps. With dynamic=False it stays 1 and checks nothing."""

    def __init__(self, dynamic: bool, scale: float = FIRST_SCALE, growth_interval: int = 2000):
        self.dynamic = dynamic
        self.scale = scale if dynamic else 1.0
        self.growth_interval = growth_interval
        self._clean_steps = 0

    @classmethod
    def resumed(cls, dynamic: bool, saved: float | None) -> LossScaler:
        """The scaler of a run resumed from a checkpoint that saved `saved` (None: a
        fresh run). A 16-bit run continues its own scale; a float32 run saves 1 (no
        scaling), and a 16-bit run resumed from it starts at 2^16 as a fresh one does:
        at 1, growing x2 per 2000 steps, its float16 gradients would underflow for
        32,000 steps. (A 16-bit scale that fell to 1 also restarts at 2^16.)"""
        return cls(dynamic, saved if saved is not None and saved > 1.0 else FIRST_SCALE)

    def gradients_finite(self, grads: list) -> bool:
        """Identical on every rank: the gradients were allreduced before this check."""
        if not self.dynamic:
            return True
        return all_finite(grads)

    def update(self, finite: bool) -> None:
        if not self.dynamic:
            return
        if not finite:
            self.scale, self._clean_steps = max(self.scale / 2, 1.0), 0
            return
        self._clean_steps += 1
        if self._clean_steps == self.growth_interval:
            self.scale, self._clean_steps = self.scale * 2, 0
