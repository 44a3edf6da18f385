"""One rank of the gradient accumulation test; launched alone, by horovodrun or mpirun.

Two replicas of the same run, on every rank: the trainer's own train_step with each
rank's batch of 2 B in 2 accumulated micro-batches of B, and with the 2 B at once,
each through the graph the CPU trains (with the project's PReLU kernel).
After three steps, the backbone (SGD with momentum, or AdamW), the class centers and
their states must agree to float32 rounding, and every step's loss. The backbone is
two fully connected layers with a PReLU between: no BatchNorm, whose statistics of a
micro-batch are not the whole batch's by definition (docs/training.md). Usage:

    python tests/accumulation_worker.py OPTIMIZER   (sgd or adamw)
"""

from __future__ import annotations

import sys
from dataclasses import replace
from types import SimpleNamespace

import mxnet as mx
import numpy as np
from mxnet.gluon import nn

from partial_fc_mx import dist, train
from partial_fc_mx.config import Config
from partial_fc_mx.data.loader import Batch
from partial_fc_mx.run.precision import LossScaler, training_model

INPUT, EMBEDDING, CLASSES, BATCH, STEPS = 48, 16, 400, 6, 3
TOLERANCE = 1e-5


def replica(config: Config, world: dist.World, micro_batches: int) -> SimpleNamespace:
    mx.random.seed(0)  # the same initial backbone in both replicas, on every rank
    net = nn.HybridSequential()
    net.add(nn.Dense(32, in_units=INPUT), nn.PReLU(in_channels=32),
            nn.Dense(EMBEDDING, in_units=32))
    net.initialize(mx.init.Xavier())
    net.hybridize(static_alloc=True, static_shape=True)  # as build_backbone does
    config = replace(config, gradient_accumulation=micro_batches)
    model = training_model(net, mx.cpu(), "float32")  # with the CPU's PReLU kernel
    assert "pfc_prelu" in model._cached_graph[1].tojson()
    return SimpleNamespace(config=config, world=world, ctx=mx.cpu(), net=net, model=model,
                           trainer=train.make_trainer(config, net),
                           pfc=train.build_classifier(config, world, mx.cpu()),
                           scaler=LossScaler.resumed(False, None))


def rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main(optimizer: str) -> None:
    world = dist.init()
    config = Config(num_classes=CLASSES, embedding_size=EMBEDDING, batch_size=BATCH,
                    sample_rate=0.2, optimizer=optimizer, center_update="exact",
                    lr=0.01 if optimizer == "adamw" else 0.1, margin_list=(1.0, 0.5, 0.0),
                    scale=30.0, seed=3)
    accumulated, whole = replica(config, world, 2), replica(config, world, 1)
    errors = {"loss": 0.0}
    for step in range(STEPS):
        rng = np.random.default_rng([step, world.rank])
        batch = Batch(mx.nd.array(rng.normal(size=(2 * BATCH, INPUT))),
                      rng.integers(0, CLASSES, 2 * BATCH))
        losses = [train.train_step(run, batch, 0.1 * (step + 1)) for run in (accumulated, whole)]
        errors["loss"] = max(errors["loss"], rel(*losses))
    ours = accumulated.net._collect_params_with_prefix()  # structural names: 0.weight
    for name, parameter in whole.net._collect_params_with_prefix().items():
        errors[f"backbone {name}"] = rel(ours[name].data().asnumpy(), parameter.data().asnumpy())
    centers = whole.pfc.centers.state_dict()
    for name, value in accumulated.pfc.centers.state_dict().items():
        if isinstance(value, np.ndarray):  # rows and their states
            errors[f"centers {name}"] = rel(value, centers[name])
        else:  # the sampling generator's state, the update's step counts
            assert value == centers[name], f"the centers' {name} differ"
    report = " ".join(f"{name}={error:.1e}" for name, error in errors.items())
    if max(errors.values()) > TOLERANCE:
        print(f"FAIL rank {world.rank}/{world.size} {optimizer}: {report}", flush=True)
        sys.exit(1)
    print(f"PASS rank {world.rank}/{world.size} {optimizer}: {report}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
