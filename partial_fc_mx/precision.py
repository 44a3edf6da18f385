"""Mixed precision: a float16 backbone on GPUs, with dynamic loss scaling.

The backbone graph is converted with MXNet's AMP (`convert_hybrid_block`: float16
convolutions and dense layers, float32 master weights in the optimizer), rather
than `amp.init()`, which patches every MXNet operator process-wide and would turn
Partial FC's logits and softmax to float16 too; those stay float32.
"""

from __future__ import annotations

import mxnet as mx

from .errors import UserError


class PrecisionError(UserError, ValueError):
    """A precision the device cannot run (fp16 on a CPU)."""


def all_finite(arrays: list) -> bool:
    """No NaN or Inf in any of `arrays`, one fused check per dtype (multi_all_finite
    needs its inputs alike: float16 centers beside float32 states or backbone)."""
    by_dtype = {}
    for array in arrays:
        by_dtype.setdefault(array.dtype, []).append(array)
    return all(bool(mx.nd.multi_all_finite(*group, num_arrays=len(group)).asscalar())
               for group in by_dtype.values())


def to_float16(net, ctx: mx.Context):
    if ctx.device_type != "gpu":
        raise PrecisionError(
            "fp16=True needs a GPU: MXNet 1.9.1 has no float16 convolution or dense kernels "
            "on the CPU ('FP16 gemm on cpu not implemented'). Set fp16=False for CPU runs")
    from mxnet.contrib import amp

    return amp.convert_hybrid_block(net, target_dtype="float16", ctx=ctx)


class LossScaler:
    """Multiply the loss (here: its gradient) by `scale` so float16 gradients do not
    underflow; halve it after an overflow (the step is skipped), double it after
    `growth_interval` clean steps. With dynamic=False it stays 1 and checks nothing."""

    def __init__(self, dynamic: bool, scale: float = 2.0**16, growth_interval: int = 2000):
        self.dynamic = dynamic
        self.scale = scale if dynamic else 1.0
        self.growth_interval = growth_interval
        self._clean_steps = 0

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
