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
  - patch masking: 129 of the 144 tokens of each sample, drawn at random, are gathered
    into a shorter sequence that the blocks compute (arcface_torch keeps
    int(144 * 0.9); it calls its masking with the default ratio 0.1 whatever the
    network's nonzero `mask_ratio`, so "mask_005" masks 10% too); after the final
    LayerNorm a learned mask token fills the 15 places left, and the head reads all
    144 in their places.
So a masking network's training graph computes 129 tokens and its inference graph
144: in inference (outside autograd's training mode) the network runs its inference
graph (`forward`, and `modes.ByMode` for the graphs the trainer builds from it).
An earlier version kept all 144 tokens and hid the masked ones from the attention by
a bias on their keys' scores; its `broadcast_add` reduced the activation-sized
gradient onto the bias's shape in the backward, which nothing needs (0.65 s of a 4.7 s
vit_t step at batch 16, one thread), on top of 144/129 of the work.
Operators chosen by measurement (a vit_t step's profile, one thread, 2026-12-03): the
drop path as Dropout with one draw per sample (`axes`), not a product with a
per-sample factor, whose backward reduced the activation-sized gradient onto the
factor's shape (0.23 s of a 5.4 s step, and an extra activation kept: 21.9 GiB of
activations at the WebFace42M config's batch of 512, 23.6 before); ReLU6 as
`minimum(relu(x), 6)`: 0.17 s where `clip` took 0.45.
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
from .modes import graph_block
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


def dense(units: int, in_units: int, use_bias: bool = True) -> nn.Dense:
    return nn.Dense(units, use_bias=use_bias, flatten=False, in_units=in_units,
                    weight_initializer=mx.init.Normal(INIT_STD))


class Attention(HybridBlock):
    """Multi-head self-attention over sequences of `length` tokens."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.scale = (dim // HEADS) ** -0.5
        self.qkv = dense(3 * dim, dim, use_bias=False)
        self.proj = dense(dim, dim)

    def hybrid_forward(self, F, x, length: int = TOKENS):
        # float32 from here to the projection, as arcface_torch leaves autocast for the
        # scores, softmax and weighted sum: AMP would run batch_dot in its inputs' 16
        # bits (its lists offer no float32 rule for it); a no-op in a float32 graph
        qkv = F.cast(self.qkv(x), dtype="float32")
        qkv = F.transpose(F.reshape(qkv, (0, 0, 3, HEADS, -1)), (2, 0, 3, 1, 4))
        # explicit sizes, not MXNet's merge/split codes (-3, -4): ONNX has no such codes
        q, k, v = (F.reshape(part, (-1, length, self.dim // HEADS)) for part in
                   F.split(qkv, num_outputs=3, axis=0, squeeze_axis=True))  # (N heads) x L x d
        scores = F.batch_dot(q, k, transpose_b=True) * self.scale
        weights = F.softmax(scores, axis=-1)
        heads = F.reshape(F.batch_dot(weights, v), (-1, HEADS, length, self.dim // HEADS))
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

    def hybrid_forward(self, F, x, length: int = TOKENS, training_ops: bool = True):
        rate = self.drop_path_rate if training_ops else 0.0
        x = x + drop_path(F, self.attn(self.norm1(x), length), rate)
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
        self._graphs: dict = {}  # the inference graph's block, built by forward
        self.feature = nn.HybridSequential()
        self.feature.add(dense(embed, TOKENS * embed, use_bias=False),
                         nn.BatchNorm(epsilon=HEAD_BN_EPS, in_channels=embed),
                         dense(embedding_size, embed, use_bias=False),
                         nn.BatchNorm(epsilon=HEAD_BN_EPS, in_channels=embedding_size))

    def forward(self, x, *args):
        """In inference on arrays, a masking network's inference graph (its training
        graph computes the kept tokens only): computed imperatively where the network
        is (calibration.py's hooks read its layers), else a block of it; otherwise, and
        for a caller that says which graph (`training_ops`), HybridBlock's forward."""
        if (self.size.masks and isinstance(x, mx.nd.NDArray) and not args
                and not mx.autograd.is_training()):
            if not self._active:  # not hybridized
                return super().forward(x, False)
            if "inference" not in self._graphs:  # a dict: Gluon registers no child
                data = mx.sym.var("data", dtype="float32")
                self._graphs["inference"] = graph_block(self(data, False), ("data",), self)
            return self._graphs["inference"](x)
        return super().forward(x, *args)

    def hybridize(self, *args, **kwargs) -> None:
        self._graphs.clear()  # built again, with the new flags, by the next inference
        super().hybridize(*args, **kwargs)

    def cast(self, dtype) -> None:
        self._graphs.clear()
        super().cast(dtype)

    def hybrid_forward(self, F, x, training_ops: bool = True, *, pos_embed, mask_token):
        """`training_ops` False leaves masking and drop path out of the graph: only
        when called on a symbol (graph_of); a hybridized call with arrays takes arrays
        only, and gets the training graph in training; outside it a masking network
        gets its inference graph (forward), another its training graph, whose
        dropout and drop path are then the identity."""
        masks = training_ops and self.size.masks
        tokens, places = self.embed(F, x, pos_embed, masks)
        length = KEPT_TOKENS if masks else TOKENS
        for block in self.blocks:
            tokens = block(tokens, length, training_ops)
        return self.head(F, tokens, places, mask_token, training_ops)

    def embed(self, F, x, pos_embed, masks: bool) -> tuple:
        """(tokens, places): the patches' tokens with their positions; with `masks`, only
        the KEPT_TOKENS tokens training keeps (a random choice and order per sample, as
        arcface_torch's random_masking), and `places` (N x 144): the index, in the kept
        tokens followed by the mask tokens, of each position's token for the head;
        else all the tokens and None."""
        with kept_in_float32():  # the anchor's patch convolution and head: float32.py
            patches = self.patch_embed(x)
        tokens = F.broadcast_add(F.transpose(F.reshape(patches, (0, 0, -1)), (0, 2, 1)),
                                 pos_embed)
        if not masks:
            return tokens, None
        like = F.cast(F.slice_axis(tokens, axis=2, begin=0, end=1), dtype="float32")
        noise = F.reshape(F.random.uniform_like(like), (0, -1))  # float32 in 16-bit graphs too
        order = F.argsort(noise, axis=1)  # a random order of the 144 positions per sample
        kept = F.slice_axis(order, axis=1, begin=0, end=KEPT_TOKENS)
        return take_tokens(F, tokens, kept, TOKENS, self.size.embed), F.argsort(order, axis=1)

    def head(self, F, tokens, places, mask_token, training_ops: bool):
        """The final LayerNorm; with `places` (training a masking network), the kept
        tokens and the mask token in the places embed chose; the feature head."""
        tokens = self.norm(tokens)
        if places is not None:
            fill = F.broadcast_like(mask_token, F.slice_axis(tokens, axis=1, begin=0,
                                                             end=TOKENS - KEPT_TOKENS))
            tokens = take_tokens(F, F.concat(tokens, fill, dim=1), places, TOKENS,
                                 self.size.embed)
        elif training_ops:  # a network that never masks keeps the mask token (a
            # parameter of the anchor's too) in its training graph, with no effect and
            # a zero gradient: Gluon's shape inference fails on a parameter no operator takes
            tokens = F.broadcast_add(tokens, F.zeros_like(mask_token))
        first, first_bn, second, second_bn = self.feature
        with kept_in_float32():
            features = column_batch_norm(F, first_bn, first(F.reshape(tokens, (0, -1))))
            return column_batch_norm(F, second_bn, second(features))

    def segments(self) -> list[Segment]:
        """The training graph as the stem (patches, positions, the masking), each block,
        and the head; the kept tokens' places are a constant."""
        pos_embed, mask_token = self.pos_embed.var(), self.mask_token.var()
        masks = self.size.masks
        places = ("places",) if masks else ()
        length = KEPT_TOKENS if masks else TOKENS

        def stem(x):
            tokens, where = self.embed(mx.sym, x, pos_embed, masks)
            return (tokens, where) if masks else tokens

        def computed(block: Block):
            return lambda tokens: block(tokens, length, True)

        def tail(tokens, where=None):
            return self.head(mx.sym, tokens, where, mask_token, True)

        return [Segment((DATA,), ("tokens", *places), stem, constants=places),
                *(Segment(("tokens",), ("tokens",), computed(block)) for block in self.blocks),
                Segment(("tokens", *places), (EMBEDDINGS,), tail)]


def take_tokens(F, tokens, index, length: int, width: int):
    """N x M x width: each sample's tokens at its M positions `index` (N x M, float),
    from `tokens` (N x length x width); one gather over the batch's rows, whose
    backward adds each gradient into the row it came from."""
    offsets = F.reshape(F.contrib.arange_like(index, axis=0) * length, (-1, 1))
    return F.take(F.reshape(tokens, (-1, width)), F.broadcast_add(index, offsets), axis=0)
