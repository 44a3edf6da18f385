"""Dropout whose mask follows `mx.random.seed` on every device.

Gluon's nn.Dropout lets a GPU use cuDNN's dropout, whose random state is seeded once
when it is created: reseeding MXNet's generator at every step (train.seed_step, what
makes a resumed run draw the masks the uninterrupted one drew) would not reach it.
This one asks for MXNet's own generator on every device (cudnn_off=True), the one
`mx.random.seed` resets.
"""

from __future__ import annotations

from mxnet.gluon import HybridBlock


class Dropout(HybridBlock):
    def __init__(self, rate: float) -> None:
        super().__init__()
        self.rate = rate

    def hybrid_forward(self, F, x):
        if self.rate <= 0:
            return F.identity(x)
        return F.Dropout(x, p=self.rate, name="fwd", cudnn_off=True)
