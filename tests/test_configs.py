"""Every configuration in configs/ runs as written on 2 processes, scaled down only by
overrides (a small synthetic dataset, few classes, a batch of 2, 3 steps): it trains 2
steps and saves, resumes for 1 more step, exports backbone.onnx (the ONNX checker runs
in the export) matching the MXNet backbone in onnxruntime, and `eval` scores it on a
small .bin. A new config file is covered without editing this test. Configurations
with fp16 = True run on this CPU through bfloat16 (precision.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import REPO, mpirun, python_module, run

from partial_fc_mx.config import read_config_file
from partial_fc_mx.data.synthetic import prepare_synthetic
from partial_fc_mx.export import parity

CONFIGS = sorted((REPO / "configs").glob("*.py"))
CLASSES = 60


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> Path:
    """60 synthetic identities x 4 images, and a .bin of 10 genuine and 10 impostor
    pairs of 10 other identities."""
    directory = tmp_path_factory.mktemp("matrix") / "syn"
    prepare_synthetic(str(directory), CLASSES, per_class=4, heldout=10, pairs=10, seed=3)
    return directory


def scaled_down(data: Path, steps: int) -> list[str]:
    """Only what makes a run small; everything else stays as the file says."""
    return [f"rec={data}", f"num_classes={CLASSES}", "num_image=0", "batch_size=2",
            f"max_steps={steps}", f"val_targets=['{data / 'synthetic_heldout.bin'}']",
            "num_workers=1", "frequent=1", "stall_timeout=600"]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: path.stem)
def test_config_trains_saves_resumes_exports_and_evaluates(config, tmp_path, small_data):
    work = tmp_path / "work"
    written = read_config_file(config)
    first = mpirun(2, python_module("train", str(config), *scaled_down(small_data, 2),
                                    "--work-dir", str(work)), timeout=900)
    assert first.returncode == 0, first.stdout[-4000:]
    saved = work / "checkpoints" / "step_000002"
    assert json.loads((saved / "meta.json").read_text())["step"] == 2
    resumed = mpirun(2, python_module("train", str(config), *scaled_down(small_data, 3),
                                      "--work-dir", str(work), "--resume-from", str(work)),
                     timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    text = (work / "training.log").read_text()
    assert f"resuming from {saved}" in text
    assert (work / "checkpoints" / "step_000003" / "meta.json").is_file()
    network = written.get("network", "r50")
    precision = "bfloat16" if written.get("fp16") else "float32"
    assert f"training {network} on {small_data}" in text and f"backbone in {precision}" in text
    assert "could not export" not in text
    assert parity(work) <= 1e-4
    evaluated = run(python_module("eval", "--model", str(work),
                                  "--bin", str(small_data / "synthetic_heldout.bin")))
    assert evaluated.returncode == 0, evaluated.stdout[-2000:]
    assert re.search(r"synthetic_heldout.bin: accuracy [\d.]+ \+-", evaluated.stdout)
