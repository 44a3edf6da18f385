"""IResNet, insightface's face ResNet: residual units BN-Conv-BN-PReLU-Conv-BN, and an
output of BN-Dropout-FC-BN that turns the 7 x 7 map into the embedding. Layer for
layer arcface_torch's `get_model("r50")` (and r18 ... r200): one PReLU slope per channel,
the same parameter shapes (tests/test_backbones.py holds them to a recording of the
anchor's)."""

from __future__ import annotations

from mxnet.gluon import HybridBlock, nn

from .dropout import Dropout
from .segments import Segment, chain, sequence

BN_EPS = 1e-5


def prelu(channels: int) -> nn.PReLU:
    """A slope per channel, as insightface's networks have (checkpoints of the earlier
    layout, one slope per layer, load broadcast: backbones/layout.py)."""
    return nn.PReLU(in_channels=channels)


def conv3x3(channels: int, stride: int = 1) -> nn.Conv2D:
    return nn.Conv2D(channels, 3, stride, 1, use_bias=False)


class IBasicBlock(HybridBlock):
    def __init__(self, channels: int, stride: int, downsample: bool) -> None:
        super().__init__()
        self.body = nn.HybridSequential()
        self.body.add(nn.BatchNorm(epsilon=BN_EPS), conv3x3(channels),
                      nn.BatchNorm(epsilon=BN_EPS), prelu(channels), conv3x3(channels, stride),
                      nn.BatchNorm(epsilon=BN_EPS))
        self.downsample = None
        if downsample:
            self.downsample = nn.HybridSequential()
            self.downsample.add(nn.Conv2D(channels, 1, stride, use_bias=False),
                                nn.BatchNorm(epsilon=BN_EPS))

    def hybrid_forward(self, F, x):
        identity = x if self.downsample is None else self.downsample(x)
        return self.body(x) + identity


class EmbeddingHead(HybridBlock):
    """BN -> Dropout -> FC -> BN (the last BN without a learned scale, as insightface)."""

    def __init__(self, embedding_size: int, dropout: float) -> None:
        super().__init__()
        self.body = nn.HybridSequential()
        self.body.add(nn.BatchNorm(epsilon=BN_EPS), Dropout(dropout), nn.Flatten(),
                      nn.Dense(embedding_size), nn.BatchNorm(epsilon=BN_EPS, scale=False))

    def hybrid_forward(self, F, x):
        return self.body(x)


class IResNet(HybridBlock):
    def __init__(self, layers: tuple, widths: tuple = (64, 128, 256, 512), stem: int = 64,
                 stem_stride: int = 1, embedding_size: int = 512, dropout: float = 0.0) -> None:
        super().__init__()
        self.features = nn.HybridSequential()
        self.features.add(nn.Conv2D(stem, 3, stem_stride, 1, use_bias=False),
                          nn.BatchNorm(epsilon=BN_EPS), prelu(stem))
        for blocks, width in zip(layers, widths):  # each stage halves the map: first unit
            for i in range(blocks):                # has stride 2 and a projection shortcut
                self.features.add(IBasicBlock(width, 2 if i == 0 else 1, downsample=i == 0))
        self.head = EmbeddingHead(embedding_size, dropout)

    def hybrid_forward(self, F, x):
        return self.head(self.features(x))

    def segments(self) -> list[Segment]:
        """The stem (convolution, BatchNorm, PReLU), each residual unit, the head."""
        layers = [self.features[i] for i in range(len(self.features))]
        return chain([sequence(*layers[:3]), *layers[3:], self.head])


DEPTHS = {
    "r18": (2, 2, 2, 2),
    "r34": (3, 4, 6, 3),
    "r50": (3, 4, 14, 3),
    "r100": (3, 13, 30, 3),
    "r200": (6, 26, 60, 6),
}
