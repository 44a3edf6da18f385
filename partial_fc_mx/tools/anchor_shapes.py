"""The parameter shapes of arcface_torch's backbones, layer by layer, recorded from its
own `get_model` so that tests/test_backbones.py can hold ours to them without torch:

    python -m venv torch-venv && torch-venv/bin/pip install torch numpy
    PYTHONPATH=. torch-venv/bin/python -m partial_fc_mx.tools.anchor_shapes \\
        --arcface-torch insightface/recognition/arcface_torch > tests/anchor_shapes.json
    PYTHONPATH=. torch-venv/bin/python -m partial_fc_mx.tools.anchor_shapes \\
        --arcface-torch insightface/recognition/arcface_torch --init vit_t > tests/anchor_init.json

(the ViTs need timm, which their vit.py imports: `torch-venv/bin/pip install timm`).
With --init, each parameter's mean and standard deviation as the anchor initialises
it, so that the test can hold ours to the same initialisation.

torch and insightface are imported only here, in that environment.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

NAMES = ("r18", "r34", "r50", "r100", "r200", "mbf", "vit_t", "vit_t_dp005_mask0", "vit_s",
         "vit_s_dp005_mask_0", "vit_b", "vit_b_dp005_mask_005", "vit_l_dp005_mask_005", "vit_h")
"""The names both toolkits' get_model know."""


def shapes_of(model) -> list[list]:
    """[[name, shape], ...] of every parameter, in the order the modules register them
    (BatchNorm's running statistics are buffers, not parameters)."""
    return [[name, list(parameter.shape)] for name, parameter in model.named_parameters()]


def init_of(model) -> list[list]:
    """[[name, mean, std], ...] of every parameter as initialised."""
    return [[name, float(p.detach().mean()), float(p.detach().std())]
            for name, p in model.named_parameters()]


def anchor_get_model(arcface_torch: Path):
    """arcface_torch's own `backbones.get_model`, imported from its folder (the parity
    study's torch arm builds its backbones with it too)."""
    sys.path.insert(0, str(arcface_torch.resolve()))
    from backbones import get_model

    return get_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m partial_fc_mx.tools.anchor_shapes")
    parser.add_argument("--arcface-torch", type=Path, required=True,
                        help="the recognition/arcface_torch folder of an insightface checkout")
    parser.add_argument("--init", metavar="NAME",
                        help="record NAME's initialisation statistics instead of the shapes")
    args = parser.parse_args(argv)
    get_model = anchor_get_model(args.arcface_torch)
    if args.init:
        import torch

        torch.manual_seed(0)
        recorded = {args.init: init_of(get_model(args.init, num_features=512))}
    else:
        recorded = {name: shapes_of(get_model(name, num_features=512)) for name in NAMES}
    networks = [f"{json.dumps(name)}: [\n" + ",\n".join(json.dumps(layer) for layer in layers)
                + "\n]" for name, layers in recorded.items()]
    sys.stdout.write("{\n" + ",\n".join(networks) + "\n}\n")  # one layer per line


if __name__ == "__main__":
    main()
