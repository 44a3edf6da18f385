"""An arcface_torch backbone exported by arcface_torch's own torch2onnx.py, for checking
`import-backbone` against the real exporter (docs/importing.md). Runs in a torch
environment; torch and insightface are imported only here:

    python -m partial_fc_mx.tools.arcface_torch_onnx --dump-faces faces.npy   # our venv
    PYTHONPATH=. torch-venv/bin/python -m partial_fc_mx.tools.arcface_torch_onnx \\
        --arcface-torch insightface/recognition/arcface_torch --network r50 \\
        --faces faces.npy --output r50.onnx [--legacy-exporter]

No trained arcface_torch weights are reachable offline. The network starts from its
own initialisation; a ViT's LayerNorm scales and shifts and its Linear layers' biases
are then drawn at random (their initial 1 and 0 are the same in every layer: an
import that mixed two layers up would still agree); its BatchNorm statistics are
then set from real faces (the ORL faces, in training mode without gradients), as a
trained network's are: otherwise they would be the initial 0 and 1, which no export
folds into anything telling. The
state dict is saved as model.pt and handed to torch2onnx.py unmodified, run as its
`__main__`, with two adjustments outside it: numpy's `np.float`, which numpy 1.24
removed and torch2onnx.py still uses, is restored as `float`; and with
`--legacy-exporter` torch.onnx.export runs its TorchScript exporter (dynamo=False),
which torch2onnx.py was written against (torch 2.9 made the dynamo exporter the
default).
"""

from __future__ import annotations

import argparse
import functools
import runpy
import sys
from pathlib import Path

import numpy as np

from .anchor_shapes import anchor_get_model

BATCHES, BATCH = 20, 32


def face_statistics(net, faces: np.ndarray, torch, seed: int = 0) -> None:
    """Set the BatchNorms' running statistics from faces, normalized as arcface_torch
    normalizes its input ((x - 127.5) / 127.5), mirrored at random."""
    rng = np.random.default_rng(seed)
    for module in net.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.reset_running_stats()
            module.momentum = None  # a cumulative average over all batches
    net.train()
    with torch.no_grad():
        for _ in range(BATCHES):
            picked = faces[rng.choice(len(faces), BATCH, replace=False)].astype(np.float32)
            flip = rng.random(BATCH) < 0.5
            picked[flip] = picked[flip, :, ::-1]
            x = (picked.transpose(0, 3, 1, 2) - 127.5) / 127.5
            net(torch.from_numpy(np.ascontiguousarray(x)))
    net.eval()


def distinct_token_layers(net, torch, seed: int = 0) -> None:
    """Every LayerNorm's scale in 0.5..1.5 and shift, and every Linear layer's bias,
    drawn at random (a ViT's; an IResNet has no LayerNorm and is left as it is)."""
    norms = [m for m in net.modules() if isinstance(m, torch.nn.LayerNorm)]
    if not norms:
        return
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for norm in norms:
            norm.weight.copy_(0.5 + torch.rand(norm.weight.shape, generator=generator))
            norm.bias.copy_(0.1 * torch.randn(norm.bias.shape, generator=generator))
        for linear in net.modules():
            if isinstance(linear, torch.nn.Linear) and linear.bias is not None:
                linear.bias.copy_(0.1 * torch.randn(linear.bias.shape, generator=generator))


def export(arcface_torch: Path, network: str, faces: np.ndarray, output: Path,
           legacy: bool) -> None:
    import torch

    torch.manual_seed(0)
    net = anchor_get_model(arcface_torch)(network, dropout=0.0, fp16=False, num_features=512)
    distinct_token_layers(net, torch)
    face_statistics(net, faces, torch)
    weights = output.with_suffix(".pt")
    torch.save(net.state_dict(), weights)
    np.float = float  # removed in numpy 1.24; torch2onnx.py still casts with it
    if legacy:
        torch.onnx.export = functools.partial(torch.onnx.export, dynamo=False)
    sys.argv = ["torch2onnx.py", str(weights), "--output", str(output), "--network", network]
    runpy.run_path(str(arcface_torch / "torch2onnx.py"), run_name="__main__")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m partial_fc_mx.tools.arcface_torch_onnx")
    parser.add_argument("--dump-faces", type=Path, help="(our venv) write the ORL faces as "
                                                        "an N x 112 x 112 x 3 uint8 .npy")
    parser.add_argument("--arcface-torch", type=Path)
    parser.add_argument("--network", default="r50")
    parser.add_argument("--faces", type=Path)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--legacy-exporter", action="store_true")
    args = parser.parse_args(argv)
    if args.dump_faces:
        from ..imports.calibration import faces

        images, _ = faces(None, count=400)
        np.save(args.dump_faces, images)
        print(f"wrote {args.dump_faces}: {len(images)} faces")
        return
    export(args.arcface_torch, args.network, np.load(args.faces), args.output,
           args.legacy_exporter)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
