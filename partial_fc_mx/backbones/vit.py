"""Vision Transformers as arcface_torch defines them (`backbones/vit.py`, its
`get_model("vit_t")` ... `("vit_h")`): 9 x 9 patches of the 112 x 112 face (144
tokens, the last 4 rows and columns unused), a learned position embedding, pre-norm
blocks (LayerNorm -> 8-head attention without a qkv bias -> drop path; LayerNorm ->
MLP with ReLU6 -> drop path), a final LayerNorm, and a feature head over all tokens
(Linear(144 E -> E) -> BN -> Linear(E -> 512) -> BN). Parameter for parameter the
anchor's shapes (tests/test_backbones.py) and initialisation (tests/test_vit.py).

Training only, as in the anchor:
  - drop path: each block's branch is dropped per sample with a rate growing linearly
    from 0 (first block) to `drop_path` (last), the kept ones scaled by 1 / keep;
  - patch masking: 15 of the 144 tokens of each sample (arcface_torch keeps
    int(144 * 0.9); it calls its masking with the default ratio 0.1 whatever the
    network's nonzero `mask_ratio`, so "mask_005" masks 10% too) are left out of the
    attention of every block and, after the final LayerNorm, replaced by a learned
    mask token.
arcface_torch gathers the kept tokens into a shorter sequence; one MXNet graph serves
training and inference here, so the masked tokens stay in place and no query attends
to them (their keys' scores get -1e9 before the softmax: weight 0, gradient 0), and
their outputs are replaced: the same numbers, for 144/129 of the per-token layers'
work and (144/129)^2 of the attention's two batch_dots.
Operators chosen by measurement (a vit_t step's profile, one thread, 2026-12-03): the
drop path as Dropout with one draw per sample (`axes`), not a product with a
per-sample factor, whose backward reduced the activation-sized gradient onto the
factor's shape (0.23 s of a 5.4 s step, and an extra activation kept: 21.9 GiB of
activations at the WebFace42M config's batch of 512, 23.6 before); ReLU6 as
`minimum(relu(x), 6)`: 0.17 s where `clip` took 0.45. The masks' `broadcast_add` has
the same costly reduction (0.65 s) but stays: `where` avoided it and kept a full-size
condition for the backward (vit_t's activations 30.8 GiB at that batch, against 23.6).
Both draw from MXNet's generator (Dropout with cudnn_off, uniform noise), which
train.py seeds per step: a resumed run draws the masks the uninterrupted one drew.
The inference graph (`net(data, False)`: backbone-symbol.json, ONNX) has neither.
"""

from __future__ import annotations

from dataclasses import dataclass

import mxnet as mx
from mxnet.gluon import HybridBlock, nn

from .float32 import kept_in_float32
from .mobilefacenet import column_batch_norm
from .segments import DATA, EMBEDDINGS, Segment

PATCH = 9
IMAGE = 112
TOKENS = (IMAGE // PATCH) ** 2
HEADS = 8
MLP_RATIO = 4
MASK_RATIO = 0.1
"""What arcface_torch's random_masking uses whenever a network masks at all."""
KEPT_TOKENS = int(TOKENS * (1 - MASK_RATIO))
LN_EPS = 1e-5
HEAD_BN_EPS = 2e-5
INIT_STD = 0.02
"""timm's trunc_normal_(std=0.02) cuts at +-2 (absolute), 100 standard deviations:
the plain normal draws the same distribution."""
HIDDEN_SCORE = -1e9
"""Added to a masked key's score: exp of it is exactly 0 in float32."""


@dataclass(frozen=True)
class ViTSize:
    embed: int
    depth: int
    drop_path: float
    masks: bool


VIT_SIZES = {
    "vit_t": ViTSize(256, 12, 0.1, True),
    "vit_t_dp005_mask0": ViTSize(256, 12, 0.05, False),
    "vit_s": ViTSize(512, 12, 0.1, True),
    "vit_s_dp005_mask_0": ViTSize(512, 12, 0.05, False),
    "vit_b": ViTSize(512, 24, 0.1, True),
    "vit_b_dp005_mask_005": ViTSize(512, 24, 0.05, True),
    "vit_l_dp005_mask_005": ViTSize(768, 24, 0.05, True),
    "vit_h": ViTSize(1024, 48, 0.1, False),
}
"""arcface_torch's get_model names: embedding width, depth, the last block's drop
path rate, whether training masks patches (the `_dp005_mask*` ones are its WebFace42M
recipes)."""


def training_indicator(F, like):
    """1 in training, 0 in inference, shape (1, 1, 1): a graph cannot branch on the
    mode, but Dropout can: at p = 0.5 it returns 0 or 2 in training and its input, 1,
    in inference, so (dropout(1) - 1)^2 is exactly 1 or 0."""
    one = F.ones_like(F.slice(like, begin=(0, 0, 0), end=(1, 1, 1)))
    return F.square(F.Dropout(one, p=0.5, cudnn_off=True) - 1)


def dense(units: int, in_units: int, use_bias: bool = True) -> nn.Dense:
    return nn.Dense(units, use_bias=use_bias, flatten=False, in_units=in_units,
                    weight_initializer=mx.init.Normal(INIT_STD))


class Attention(HybridBlock):
    """Multi-head self-attention; `key_bias` (N x 1 x 1 x L, or None: every token
    visible) is 0 for a visible token and HIDDEN_SCORE for a masked one."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.scale = (dim // HEADS) ** -0.5
        self.qkv = dense(3 * dim, dim, use_bias=False)
        self.proj = dense(dim, dim)

    def hybrid_forward(self, F, x, key_bias=None):
        # float32 from here to the projection, as arcface_torch leaves autocast for the
        # scores, softmax and weighted sum: AMP would run batch_dot in its inputs' 16
        # bits (its lists offer no float32 rule for it); a no-op in a float32 graph
        qkv = F.cast(self.qkv(x), dtype="float32")
        qkv = F.transpose(F.reshape(qkv, (0, 0, 3, HEADS, -1)), (2, 0, 3, 1, 4))
        # explicit sizes, not MXNet's merge/split codes (-3, -4): ONNX has no such codes
        q, k, v = (F.reshape(part, (-1, TOKENS, self.dim // HEADS)) for part in
                   F.split(qkv, num_outputs=3, axis=0, squeeze_axis=True))  # (N heads) x L x d
        scores = F.batch_dot(q, k, transpose_b=True) * self.scale
        if key_bias is not None:
            scores = F.broadcast_add(F.reshape(scores, (-1, HEADS, TOKENS, TOKENS)), key_bias)
        weights = F.reshape(F.softmax(scores, axis=-1), (-1, TOKENS, TOKENS))
        heads = F.reshape(F.batch_dot(weights, v), (-1, HEADS, TOKENS, self.dim // HEADS))
        return self.proj(F.reshape(F.transpose(heads, (0, 2, 1, 3)), (0, 0, self.dim)))


class Mlp(HybridBlock):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = dense(MLP_RATIO * dim, dim)
        self.fc2 = dense(dim, MLP_RATIO * dim)

    def hybrid_forward(self, F, x):
        return self.fc2(F.minimum(F.relu(self.fc1(x)), 6))  # ReLU6


def drop_path(F, branch, rate: float):
    """`branch` zeroed for a random share `rate` of the samples in training, the rest
    divided by 1 - rate; unchanged in inference (Dropout with one draw per sample)."""
    if rate <= 0:
        return branch
    return F.Dropout(branch, p=rate, axes=(1, 2), cudnn_off=True)


class Block(HybridBlock):
    compute_order = ("norm1", "attn", "norm2", "mlp")
    """The order the forward uses the children, which they are not registered in (as
    arcface_torch registers them: its parameters' order, tests/anchor_*.json); what
    import-backbone lays another framework's layers onto (imports/mapping.py)."""

    def __init__(self, dim: int, drop_path_rate: float) -> None:
        super().__init__()
        self.drop_path_rate = drop_path_rate
        self.norm1 = nn.LayerNorm(epsilon=LN_EPS, in_channels=dim)
        self.norm2 = nn.LayerNorm(epsilon=LN_EPS, in_channels=dim)
        self.attn = Attention(dim)
        self.mlp = Mlp(dim)

    def hybrid_forward(self, F, x, key_bias=None, training_ops: bool = True):
        rate = self.drop_path_rate if training_ops else 0.0
        x = x + drop_path(F, self.attn(self.norm1(x), key_bias), rate)
        return x + drop_path(F, self.mlp(self.norm2(x)), rate)


class VisionTransformer(HybridBlock):
    def __init__(self, size: ViTSize, embedding_size: int = 512) -> None:
        super().__init__()
        self.size = size
        embed = size.embed
        fan_in = 3 * PATCH * PATCH  # torch's default Conv2d initialisation
        self.pos_embed = self.params.get("pos_embed", shape=(1, TOKENS, embed),
                                         init=mx.init.Normal(INIT_STD))
        self.mask_token = self.params.get("mask_token", shape=(1, 1, embed),
                                          init=mx.init.Normal(INIT_STD))
        self.patch_embed = nn.Conv2D(embed, PATCH, PATCH, in_channels=3,
                                     weight_initializer=mx.init.Uniform(fan_in ** -0.5),
                                     bias_initializer=mx.init.Uniform(fan_in ** -0.5))
        self.blocks = nn.HybridSequential()
        for i in range(size.depth):
            self.blocks.add(Block(embed, size.drop_path * i / max(size.depth - 1, 1)))
        self.norm = nn.LayerNorm(epsilon=LN_EPS, in_channels=embed)
        self.feature = nn.HybridSequential()
        self.feature.add(dense(embed, TOKENS * embed, use_bias=False),
                         nn.BatchNorm(epsilon=HEAD_BN_EPS, in_channels=embed),
                         dense(embedding_size, embed, use_bias=False),
                         nn.BatchNorm(epsilon=HEAD_BN_EPS, in_channels=embedding_size))

    @staticmethod
    def masked_tokens(F, x):
        """N x L x 1: 1 for the tokens this sample's training hides, 0 elsewhere (all 0
        in inference)."""
        like = F.cast(F.slice_axis(x, axis=2, begin=0, end=1), dtype="float32")  # any
        noise = F.random.uniform_like(like)  # dtype x has in a 16-bit graph: float32 here
        rank = F.argsort(F.argsort(noise, axis=1), axis=1)  # a random order per sample
        return F.broadcast_mul(rank >= KEPT_TOKENS, training_indicator(F, like))

    def hybrid_forward(self, F, x, training_ops: bool = True, *, pos_embed, mask_token):
        """`training_ops` False leaves masking and drop path out of the graph: only
        when called on a symbol (graph_of); a hybridized call with arrays takes arrays
        only, and gets the training graph, whose operators follow the mode."""
        tokens, hidden, key_bias = self.embed(F, x, pos_embed, training_ops and self.size.masks)
        for block in self.blocks:
            tokens = block(tokens, key_bias, training_ops)
        return self.head(F, tokens, hidden, mask_token, training_ops)

    def embed(self, F, x, pos_embed, masks: bool) -> tuple:
        """(tokens, hidden, key_bias): the patches' tokens with their positions and, with
        `masks`, which tokens training hides (masked_tokens) and their keys' bias in the
        attention (N x 1 x 1 x L); else None for both."""
        with kept_in_float32():  # the anchor's patch convolution and head: float32.py
            patches = self.patch_embed(x)
        tokens = F.broadcast_add(F.transpose(F.reshape(patches, (0, 0, -1)), (0, 2, 1)),
                                 pos_embed)
        if not masks:
            return tokens, None, None
        hidden = self.masked_tokens(F, tokens)
        return tokens, hidden, F.reshape(hidden * HIDDEN_SCORE, (0, 1, 1, -1))

    def head(self, F, tokens, hidden, mask_token, training_ops: bool):
        """The final LayerNorm, the mask token in the hidden tokens' place (training),
        and the feature head."""
        tokens = self.norm(tokens)
        if training_ops:  # a network that never masks hides nothing, but its training
            # graph keeps the mask token (a parameter of the anchor's too): Gluon's
            # shape inference fails on a parameter no operator takes
            if hidden is None:
                hidden = F.zeros_like(F.slice_axis(tokens, axis=2, begin=0, end=1))
            tokens = F.broadcast_mul(tokens, 1 - hidden) + F.broadcast_mul(hidden, mask_token)
        first, first_bn, second, second_bn = self.feature
        with kept_in_float32():
            features = column_batch_norm(F, first_bn, first(F.reshape(tokens, (0, -1))))
            return column_batch_norm(F, second_bn, second(features))

    def segments(self) -> list[Segment]:
        """The training graph as the stem (patches, positions, the mask), each block,
        and the head; the mask and its attention bias are constants."""
        pos_embed, mask_token = self.pos_embed.var(), self.mask_token.var()
        masks = self.size.masks
        hidden, key_bias = (("hidden",), ("key_bias",)) if masks else ((), ())

        def stem(x):
            tokens, *mask = self.embed(mx.sym, x, pos_embed, masks)
            return (tokens, *mask) if masks else tokens

        def tail(tokens, hidden=None):
            return self.head(mx.sym, tokens, hidden, mask_token, True)

        return [Segment((DATA,), ("tokens", *hidden, *key_bias), stem,
                        constants=(*hidden, *key_bias)),
                *(Segment(("tokens", *key_bias), ("tokens",), block) for block in self.blocks),
                Segment(("tokens", *hidden), (EMBEDDINGS,), tail)]
