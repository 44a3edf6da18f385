"""Checkpoints that survive crashes and changes of world size.

    work_dir/checkpoints/step_000120/
        meta.json                      step, epoch, world size, class count, shard ranges
        backbone.params                backbone weights and BatchNorm statistics
        trainer.states                 the backbone optimizer's momentum
        rank_{r}_softmax_weight.npy    rank r's class centers (rows start..stop of C x D)
        rank_{r}_softmax_weight_mom.npy  and their momentum
        rank_{r}_sampler.json          rank r's negative-sampling generator state
    work_dir/backbone-symbol.json, backbone-0000.params   the backbone for inference

Every rank writes its files into `.step_000120.partial/`; after a barrier rank 0
writes meta.json and renames the directory. A crash at any point leaves either no
new checkpoint or a complete one, and never touches the previous ones. Resuming on
another number of processes cuts each new rank's rows out of the old shards
(memory-mapped, so no rank loads the whole matrix).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import mxnet as mx
import numpy as np

from . import dist
from .partial_fc import PartialFC, shard_of

CHECKPOINTS = "checkpoints"


@dataclass
class TrainState:
    step: int = 0
    """Optimizer steps done; the next step to run."""
    epoch: int = 0
    step_in_epoch: int = 0
    loss_scale: float = 1.0


class CheckpointError(ValueError):
    """A checkpoint that cannot be used for this run; the message says why."""


def save(work_dir: Path, state: TrainState, net, trainer, pfc: PartialFC,
         world: dist.World, keep: int) -> Path:
    root = Path(work_dir) / CHECKPOINTS
    name = f"step_{state.step:06d}"
    partial = root / f".{name}.partial"
    if world.is_main:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier("checkpoint.start")
    prefix = partial / f"rank_{world.rank}_softmax_weight"
    np.save(f"{prefix}.npy", pfc.weight.asnumpy())
    np.save(f"{prefix}_mom.npy", pfc.momentum.asnumpy())
    (partial / f"rank_{world.rank}_sampler.json").write_text(
        json.dumps(pfc.rng.bit_generator.state))
    if world.is_main:
        net.save_parameters(str(partial / "backbone.params"))
        trainer.save_states(str(partial / "trainer.states"))
    dist.barrier("checkpoint.written")
    final = root / name
    if world.is_main:
        meta = {**asdict(state), "world_size": world.size, "num_classes": pfc.num_classes,
                "embedding_size": pfc.embedding_size,
                "shards": [list(asdict(shard_of(pfc.num_classes, r, world.size)).values())
                           for r in range(world.size)]}
        (partial / "meta.json").write_text(json.dumps(meta, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        for old in sorted(root.glob("step_*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        net.export(str(Path(work_dir) / "backbone"), epoch=0)
    dist.barrier("checkpoint.done")
    return final


def latest(path: Path) -> Path:
    """`path` itself if it is a checkpoint, else the newest one in path/checkpoints."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    found = sorted((path / CHECKPOINTS).glob("step_*"))
    found = [p for p in found if (p / "meta.json").is_file()]
    if not found:
        raise CheckpointError(f"no checkpoint in {path} (looked for {path}/meta.json and "
                              f"{path}/{CHECKPOINTS}/step_*/meta.json)")
    return found[-1]


def read_meta(checkpoint: Path, pfc: PartialFC) -> dict:
    meta = json.loads((checkpoint / "meta.json").read_text())
    if (meta["num_classes"], meta["embedding_size"]) != (pfc.num_classes, pfc.embedding_size):
        raise CheckpointError(
            f"{checkpoint} holds {meta['num_classes']} x {meta['embedding_size']} class centers "
            f"but this run has num_classes={pfc.num_classes}, "
            f"embedding_size={pfc.embedding_size}")
    return meta


def load_centers(checkpoint: Path, meta: dict, pfc: PartialFC,
                 with_momentum: bool) -> None:
    """This rank's rows of the centers (and momentum), cut from the saved shards."""
    parts = {"weight": [], "mom": []}
    mine = pfc.shard
    for rank, (start, count) in enumerate(meta["shards"]):
        low, high = max(start, mine.start), min(start + count, mine.stop)
        if low >= high:
            continue
        rows = slice(low - start, high - start)
        prefix = checkpoint / f"rank_{rank}_softmax_weight"
        parts["weight"].append(np.load(f"{prefix}.npy", mmap_mode="r")[rows])
        if with_momentum:
            parts["mom"].append(np.load(f"{prefix}_mom.npy", mmap_mode="r")[rows])
    weight = np.concatenate(parts["weight"])
    momentum = np.concatenate(parts["mom"]) if with_momentum else np.zeros_like(weight)
    pfc.load_shard(weight, momentum)


def resume(checkpoint: Path, net, trainer, pfc: PartialFC, world: dist.World,
           ctx: mx.Context) -> TrainState:
    """Everything back as it was saved; the sampler continues its stream when the world
    size is unchanged, else each rank starts a fresh stream from (seed, rank, step)."""
    meta = read_meta(checkpoint, pfc)
    net.load_parameters(str(checkpoint / "backbone.params"), ctx=ctx)
    trainer.load_states(str(checkpoint / "trainer.states"))
    load_centers(checkpoint, meta, pfc, with_momentum=True)
    state = TrainState(meta["step"], meta["epoch"], meta["step_in_epoch"], meta["loss_scale"])
    sampler = checkpoint / f"rank_{world.rank}_sampler.json"
    if meta["world_size"] == world.size:
        pfc.rng.bit_generator.state = json.loads(sampler.read_text())
    else:
        pfc.rng = np.random.default_rng([pfc.seed, world.rank, state.step])
    return state


def load_weights(checkpoint: Path, net, pfc: PartialFC, ctx: mx.Context) -> None:
    """--load-from: backbone and centers only; optimizer state and step start afresh."""
    meta = read_meta(checkpoint, pfc)
    net.load_parameters(str(checkpoint / "backbone.params"), ctx=ctx)
    load_centers(checkpoint, meta, pfc, with_momentum=False)
