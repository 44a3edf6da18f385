"""Every configuration in configs/ runs as written on 2 processes, scaled down only by
overrides (a small synthetic dataset, few classes, a batch of 2 with the learning rate
scaled to it, 3 steps): it trains 2 steps and saves, resumes on 3 processes for the
rest, exports backbone.onnx (the ONNX checker runs in the export; its opset is export.OPSET,
the one the converters write LayerNorm's ReduceMean for) matching the MXNet backbone in onnxruntime,
and `eval` scores it on a small .bin. A new config file is covered
without editing this test.

Each runs twice: on this CPU as it is, and with oneDNN capped at AVX2 (how an AMD Zen
2/3 or a pre-Ice Lake Intel CPU runs). Configurations with fp16 = True train in
bfloat16 where the CPU computes it natively and in float32 elsewhere (cpu_precision.py),
and the log must say which.

CI takes a shorter path: each network family (every IResNet depth is one, built by one
function; test_backbones.py checks each depth's layers against arcface_torch's) and
precision runs at full size once, in the config with the smallest network of them (then
by file name: IResNet-50 stands for IResNet-100); the other configs with the same family
and precision train `tiny` in its place, everything else as written (margin, sampling,
classes, schedule, fp16). Under the AVX2 cap each precision runs at full size once for
the configs with fp16 = True and once for the others, chosen the same way, and the
configs that would train `tiny` in its place do not run again (matrix()). The full matrix, every
config at its own network under both:

    PFC_FULL_MATRIX=1 .venv/bin/python -m pytest tests/test_configs.py --durations=0
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import onnx
import pytest
from conftest import (
    ISA_CAPS,
    REPO,
    bfloat16_native,
    bfloat16_runs,
    isa_env,
    mpirun,
    python_module,
    run,
)

from partial_fc_mx.backbones.iresnet import DEPTHS
from partial_fc_mx.backbones.vit import VIT_SIZES
from partial_fc_mx.config import Config, load_config
from partial_fc_mx.prep.synthetic import prepare_synthetic
from partial_fc_mx.run.export import OPSET, parity

CONFIGS = sorted((REPO / "configs").glob("*.py"))
BY_SIZE = ("tiny", "mobilefacenet", "mbf", "vit_t", "vit_t_dp005_mask0", "r18", "r34", "r50",
           "vit_s", "vit_s_dp005_mask_0", "r100", "vit_b", "vit_b_dp005_mask_005", "r200",
           "vit_l_dp005_mask_005", "vit_h")
"""Our networks from the cheapest to train to the dearest."""
CLASSES = 60
FULL_MATRIX = os.environ.get("PFC_FULL_MATRIX") == "1"


def backbone_dtype(config: Config, env: dict) -> str:
    """What the backbone computes in on this CPU under `env`, from the CPU's flags."""
    return "bfloat16" if config.fp16 and bfloat16_native(env) else "float32"


def family(network: str) -> str:
    """IResNet-18 to -200 are one family: one builder, depth its only parameter; the
    ViTs another (one builder, its sizes the parameters)."""
    if network in VIT_SIZES:
        return "vit"
    return "iresnet" if network.replace("iresnet", "r") in DEPTHS else network


def full_size_key(config: Config, env: dict):
    """What a config must differ in from every earlier one to run its own network in
    CI's shorter path: its network family and precision; under the cap, its precision
    and whether it asks for 16 bits (the cap reaches oneDNN's kernels, which every
    IResNet depth shares, and turns a 16-bit config's bfloat16 into float32)."""
    dtype = backbone_dtype(config, env)
    return (config.fp16, dtype) if env else (family(config.network), dtype)


def order(config: Path) -> tuple:
    """Which config comes first: the one with the smaller network, then by file name (the
    cheapest runs what all of them would show)."""
    return (BY_SIZE.index(load_config(config).network.replace("iresnet", "r")), config.name)


def network_in_this_run(config: Path, env: dict) -> str:
    """The config's network, or in the shorter path `tiny` when an earlier config
    already runs at full size what this one would (full_size_key)."""
    written = load_config(config)
    earlier = [load_config(other) for other in CONFIGS if order(other) < order(config)]
    mine = full_size_key(written, env)
    if FULL_MATRIX or all(full_size_key(other, env) != mine for other in earlier):
        return written.network
    return "tiny"


def matrix() -> list:
    """(config, cap) pairs: every config on the CPU as it is, and under the AVX2 cap.
    In the shorter path the capped arm runs only the configs that run their own
    network there (the others' tiny stand-in computes what `orl` does under the cap: a
    config's margin, sampling and schedule never reach oneDNN), and not at all on a CPU
    whose oneDNN runs at most AVX2 already, where the two arms are the same run."""
    capped_differs = bfloat16_runs()  # this CPU's oneDNN uses AVX-512
    return [pytest.param(config, cap, id=f"{config.stem}-{cap or 'native'}")
            for cap in ISA_CAPS for config in CONFIGS
            if cap is None or FULL_MATRIX or (
                capped_differs and network_in_this_run(config, isa_env(cap))
                == load_config(config).network)]


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> Path:
    """60 synthetic identities x 4 images, and a .bin of 5 genuine and 5 impostor pairs
    of 10 other identities (the fewest the 10-fold protocol takes)."""
    directory = tmp_path_factory.mktemp("matrix") / "syn"
    prepare_synthetic(str(directory), CLASSES, per_class=4, heldout=10, pairs=5, seed=3)
    return directory


def scaled_down(written: Config, network: str, data: Path, steps: int) -> list[str]:
    """Only what makes a run small; everything else stays as the file says (`network`:
    the config's, or `tiny` in CI's shorter path). The
    learning rate follows the batch (the linear scaling rule): the configs' rates are
    for 128 images per GPU, and 3 steps of that rate on 2 images leave a 100-layer
    network whose BatchNorm statistics lag its weights (its float32 inference
    overflows: no parity to measure). Verification runs after training, by `eval`."""
    return [f"rec={data}", f"num_classes={CLASSES}", "num_image=0", "batch_size=2",
            f"network={network}",
            f"lr={written.lr * 2 / written.batch_size}", f"max_steps={steps}",
            "val_targets=[]", "num_workers=1", "frequent=1", "stall_timeout=600"]


@pytest.mark.parametrize("config, cap", matrix())
def test_config_trains_saves_resumes_exports_and_evaluates(config, cap, tmp_path, small_data):
    work, env = tmp_path / "work", isa_env(cap)
    written, network = load_config(config), network_in_this_run(config, env)
    first = mpirun(2, python_module("train", str(config),
                                    *scaled_down(written, network, small_data, 2),
                                    "--work-dir", str(work)), timeout=900, env=env)
    assert first.returncode == 0, first.stdout[-4000:]
    saved = work / "checkpoints" / "step_000002"
    assert json.loads((saved / "meta.json").read_text())["step"] == 2
    resumed = mpirun(3, python_module("train", str(config),
                                      *scaled_down(written, network, small_data, 3),
                                      "--work-dir", str(work), "--resume-from", str(work)),
                     timeout=900, env=env)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    text = (work / "training.log").read_text()
    assert f"resuming from {saved}" in text
    assert (work / "checkpoints" / "step_000003" / "meta.json").is_file()
    assert f"training {network} on {small_data}" in text
    assert f"backbone in {backbone_dtype(written, env)}" in text
    assert "could not export" not in text
    assert f"wrote {work / 'backbone.onnx'} (step 3) in " in text  # the last save's
    for said in (first.stdout, resumed.stdout):  # MXNet's exporter is quiet
        assert "Exported ONNX file" not in said and ".partial" not in said
    assert parity(work) <= 1e-4
    declared = {o.domain: o.version for o in onnx.load(str(work / "backbone.onnx")).opset_import}
    assert declared[""] == OPSET
    evaluated = run(python_module("eval", "--model", str(work),
                                  "--bin", str(small_data / "synthetic_heldout.bin")), env=env)
    assert evaluated.returncode == 0, evaluated.stdout[-2000:]
    assert re.search(r"synthetic_heldout.bin: accuracy [\d.]+ \+-", evaluated.stdout)
