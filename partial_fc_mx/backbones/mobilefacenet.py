"""MobileFaceNet as arcface_torch defines it: depthwise-separable residual blocks and a
global depthwise convolution (GDC) in place of pooling before the embedding, one PReLU
slope per channel and a BatchNorm with a learned scale on the embedding. `scale`
multiplies the trunk's widths: 1 is the original MobileFaceNet ("mobilefacenet"), 2
is arcface_torch's `get_model("mbf")` ("mbf")."""

from __future__ import annotations

import mxnet as mx
from mxnet.gluon import HybridBlock, nn

from .dropout import Dropout
from .iresnet import BN_EPS, prelu
from .segments import Segment, chain


def conv_bn(channels: int, kernel: int, stride: int = 1, groups: int = 1,
            linear: bool = False, padding: int | None = None) -> nn.HybridSequential:
    block = nn.HybridSequential()
    padding = kernel // 2 if padding is None else padding
    block.add(nn.Conv2D(channels, kernel, stride, padding, groups=groups, use_bias=False),
              nn.BatchNorm(epsilon=BN_EPS))
    if not linear:
        block.add(prelu(channels))
    return block


class DepthWise(HybridBlock):
    """1x1 expand -> 3x3 depthwise -> 1x1 linear projection (+ identity if residual)."""

    def __init__(self, channels: int, groups: int, stride: int = 1,
                 residual: bool = False) -> None:
        super().__init__()
        self.residual = residual
        self.body = nn.HybridSequential()
        self.body.add(conv_bn(groups, 1), conv_bn(groups, 3, stride, groups=groups),
                      conv_bn(channels, 1, linear=True))

    def hybrid_forward(self, F, x):
        return x + self.body(x) if self.residual else self.body(x)


class MobileFaceNet(HybridBlock):
    """The embedding's BatchNorm normalizes an N x E x 1 x 1 view of the embedding, not
    the N x E matrix itself (the same numbers: one mean and variance per column). On
    the matrix, MXNet 1.9.1's oneDNN BatchNorm crashed (segmentation fault, at any
    batch size, in training and inference) when E is 512, the default, on an AVX-512
    CPU: E equal to the channels of the GDC's BatchNorm before it (E = 128, 256, 1024
    ran, as did DNNL_MAX_CPU_ISA=AVX2), whose cached oneDNN primitive is the likely
    culprit. The 4-d view runs on both ISAs; the parameters keep their names and
    shapes, so checkpoints load as before."""

    def __init__(self, embedding_size: int = 512, dropout: float = 0.0, scale: int = 1) -> None:
        super().__init__()
        narrow, wide = 64 * scale, 128 * scale
        self.features = nn.HybridSequential()
        # the second convolution has 64 groups at any scale (depthwise at scale 1)
        self.features.add(conv_bn(narrow, 3, 2), conv_bn(narrow, 3, groups=64),
                          DepthWise(narrow, 128, stride=2))
        for _ in range(4):
            self.features.add(DepthWise(narrow, 128, residual=True))
        self.features.add(DepthWise(wide, 256, stride=2))
        for _ in range(6):
            self.features.add(DepthWise(wide, 256, residual=True))
        self.features.add(DepthWise(wide, 512, stride=2))
        for _ in range(2):
            self.features.add(DepthWise(wide, 256, residual=True))
        gdc = conv_bn(512, 7, groups=512, linear=True, padding=0)  # 7x7 -> 1x1
        self.features.add(conv_bn(512, 1), gdc)
        self.head = nn.HybridSequential()
        self.head.add(nn.Flatten(), Dropout(dropout), nn.Dense(embedding_size, use_bias=False),
                      nn.BatchNorm(epsilon=BN_EPS))

    def hybrid_forward(self, F, x):
        return self.embedding(F, self.features(x))

    def embedding(self, F, features):
        """The head: the GDC's features to the embedding."""
        flatten, dropout, dense, batch_norm = self.head
        return column_batch_norm(F, batch_norm, dense(dropout(flatten(features))))

    def segments(self) -> list[Segment]:
        """Each layer of the trunk, then the head."""
        layers = [self.features[i] for i in range(len(self.features))]
        return chain([*layers, lambda x: self.embedding(mx.sym, x)])


def column_batch_norm(F, batch_norm: nn.BatchNorm, matrix):
    """`batch_norm` of an N x E matrix, through its N x E x 1 x 1 view (MobileFaceNet's
    docstring: the oneDNN crash on the matrix itself); the ViTs' head uses it too."""
    return F.flatten(batch_norm(F.reshape(matrix, (0, -1, 1, 1))))
