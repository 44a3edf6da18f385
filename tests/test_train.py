"""The trainer with real processes: learning, resume, re-sharding, failures, signals."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import mxnet as mx
import numpy as np
import pytest
from conftest import (
    REPO,
    horovodrun_gloo,
    horovodrun_gloo_command,
    mpirun,
    mpirun_command,
    python_module,
    run,
)

from partial_fc_mx.backbones import get_model
from partial_fc_mx.backbones.summary import count_flops
from partial_fc_mx.data.synthetic import prepare_synthetic

CLASSES = 120


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("data") / "syn"
    prepare_synthetic(str(directory), CLASSES, per_class=6, heldout=40, pairs=200, seed=1)
    return directory


def config_file(tmp_path: Path, data: Path, **keys) -> Path:
    values = {"rec": str(data), "num_classes": CLASSES, "network": "tiny",
              "embedding_size": 64, "batch_size": 24, "lr": 0.1, "num_epoch": 4,
              "margin_list": (1.0, 0.0, 0.35), "scale": 32.0, "frequent": 1, "verbose": 1000,
              "num_workers": 1, "stall_timeout": 120, **keys}
    path = tmp_path / "config.py"
    path.write_text("".join(f"{k} = {v!r}\n" for k, v in values.items()))
    return path


def train_args(config: Path, work_dir: Path, *extra: str) -> list[str]:
    return python_module("train", str(config), "--work-dir", str(work_dir), *extra)


def logged(work_dir: Path) -> dict:
    """{step: loss} and [(step, accuracy)] from training.log."""
    text = (work_dir / "training.log").read_text()
    losses = {int(step): float(loss) for loss, step in
              re.findall(r"Loss ([\d.]+) .*Global Step: (\d+)", text)}
    accuracy = [(int(s), float(a)) for s, a in re.findall(r"\]\[(\d+)\]Accuracy-Flip: ([\d.]+)",
                                                           text)]
    return {"losses": losses, "accuracy": accuracy, "text": text}


def test_two_processes_learn_and_verify_better_on_unseen_identities(tmp_path, synthetic):
    config = config_file(tmp_path, synthetic, val_targets=["synthetic_heldout"], num_epoch=6)
    result = horovodrun_gloo(2, train_args(config, tmp_path / "work"), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:]
    log = logged(tmp_path / "work")
    steps = sorted(log["losses"])
    assert steps[-1] == 6 * (CLASSES * 6 // 48)  # 15 steps per epoch
    first = np.mean([log["losses"][s] for s in steps[:3]])
    last = np.mean([log["losses"][s] for s in steps[-3:]])
    assert last < 0.5 * first, (first, last)
    (start_step, before), (end_step, after) = log["accuracy"][0], log["accuracy"][-1]
    assert (start_step, end_step) == (0, steps[-1])
    assert after > before + 0.1, log["accuracy"]
    work = tmp_path / "work"
    assert (work / "backbone-symbol.json").is_file() and (work / "backbone-0000.params").is_file()
    assert list((work / "tensorboard").glob("events.out.tfevents.*"))
    assert re.search(r"Speed [\d.]+ samples/sec   Loss [\d.]+   LearningRate [\d.]+   "
                     r"Epoch: \d+   Global Step: \d+   Required: [\d.]+ hours", log["text"])
    assert (work / "backbone.onnx").is_file() and (work / "backbone-best-symbol.json").is_file()
    # the eval command on what training left reproduces the final logged accuracy
    heldout = str(synthetic / "synthetic_heldout.bin")
    for model, tolerance in ((work, 0.0), (work / "backbone.onnx", 0.005)):
        evaluated = run(python_module("eval", "--model", str(model), "--bin", heldout))
        assert evaluated.returncode == 0, evaluated.stdout[-2000:]
        accuracy = float(re.search(r"accuracy ([\d.]+) \+-", evaluated.stdout).group(1))
        assert abs(accuracy - after) <= tolerance, (model, accuracy, after)
    plots = run(python_module("plot", str(work)))
    assert plots.returncode == 0, plots.stdout
    for name in ("loss", "learning_rate", "speed", "verification"):
        assert (work / "plots" / f"{name}.png").stat().st_size > 5000


def test_resumed_run_repeats_the_uninterrupted_losses(tmp_path, synthetic):
    config = config_file(tmp_path, synthetic, max_steps=10, save_every=4, sample_rate=0.5,
                         keep_checkpoints=5)
    straight = mpirun(2, train_args(config, tmp_path / "a"), timeout=600)
    assert straight.returncode == 0, straight.stdout[-3000:]
    checkpoint = tmp_path / "a" / "checkpoints" / "step_000004"
    assert json.loads((checkpoint / "meta.json").read_text())["step"] == 4
    resumed = mpirun(2, train_args(config, tmp_path / "b", "--resume-from", str(checkpoint)),
                     timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    a, b = logged(tmp_path / "a")["losses"], logged(tmp_path / "b")["losses"]
    assert sorted(b) == list(range(5, 11))
    assert [b[s] for s in range(5, 11)] == [a[s] for s in range(5, 11)]


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2), (2, 3)])
def test_resharding_keeps_the_center_matrix(tmp_path, synthetic, before, after):
    config = config_file(tmp_path, synthetic, max_steps=2, save_every=2)
    args = train_args(config, tmp_path / "work")
    made = mpirun(before, args, timeout=600) if before > 1 else run(args, timeout=600)
    assert made.returncode == 0, made.stdout[-3000:]
    checkpoint = tmp_path / "work" / "checkpoints" / "step_000002"
    worker = [sys.executable, "tests/reshard_worker.py", str(checkpoint)]
    result = horovodrun_gloo(after, worker, timeout=300) if after > 1 else run(worker)
    assert result.returncode == 0, result.stdout[-3000:]
    assert f"RESHARD OK {before} -> {after}" in result.stdout
    # and training goes on from there on the new number of processes
    config = config_file(tmp_path, synthetic, max_steps=3, save_every=3)
    go_on = train_args(config, tmp_path / "more", "--resume-from", str(checkpoint))
    continued = mpirun(after, go_on, timeout=600) if after > 1 else run(go_on, timeout=600)
    assert continued.returncode == 0, continued.stdout[-3000:]
    assert sorted(logged(tmp_path / "more")["losses"]) == [3]


def test_load_from_takes_weights_and_starts_at_step_zero(tmp_path, synthetic):
    config = config_file(tmp_path, synthetic, max_steps=30, save_every=30)
    assert run(train_args(config, tmp_path / "a"), timeout=600).returncode == 0
    fresh = config_file(tmp_path, synthetic, max_steps=1)
    loaded = run(train_args(fresh, tmp_path / "b", "--load-from", str(tmp_path / "a")))
    scratch = run(train_args(fresh, tmp_path / "c"))
    assert loaded.returncode == 0 and scratch.returncode == 0, loaded.stdout[-2000:]
    b, c = logged(tmp_path / "b")["losses"], logged(tmp_path / "c")["losses"]
    assert sorted(b) == [1] and b[1] < c[1] - 2.0, (b, c)  # first step: trained weights
    assert "resumed" not in logged(tmp_path / "b")["text"]


def rank_pids(pattern: str) -> list[int]:
    """The training processes (not mpirun, whose command line matches too)."""
    found = subprocess.run(["pgrep", "-f", pattern], text=True, stdout=subprocess.PIPE)
    pids = [int(p) for p in found.stdout.split()]
    return [p for p in pids if Path(f"/proc/{p}/comm").read_text().startswith("python")]


def start_and_wait(args: list[str], work: Path, steps: int = 2) -> subprocess.Popen:
    process = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, text=True,
                               stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + 180
    while time.time() < deadline:
        log = work / "training.log"
        if log.is_file() and len(re.findall(r"Global Step: \d+", log.read_text())) >= steps:
            return process
        time.sleep(0.5)
    process.kill()
    raise AssertionError(f"training did not reach step {steps}: {process.stdout.read()}")


@pytest.mark.parametrize("launch", [mpirun_command, horovodrun_gloo_command])
def test_a_killed_rank_ends_the_job_within_a_minute(tmp_path, synthetic, launch):
    config = config_file(tmp_path, synthetic, num_epoch=1000)
    work = tmp_path / "killed"
    job = start_and_wait(launch(2, train_args(config, work)), work)
    pattern = f"partial_fc_mx train {config}"
    victims = rank_pids(pattern)
    assert len(victims) == 2
    start = time.time()
    subprocess.run(["kill", "-9", str(victims[-1])])
    try:
        code = job.wait(timeout=60)
    finally:
        job.kill()
    while rank_pids(pattern) and time.time() - start < 60:  # and no rank outlives it
        time.sleep(0.5)
    assert code != 0 and not rank_pids(pattern) and time.time() - start < 60


@pytest.mark.parametrize("launch", [mpirun_command, horovodrun_gloo_command])
def test_sigterm_to_one_rank_saves_a_checkpoint_on_all(tmp_path, synthetic, launch):
    config = config_file(tmp_path, synthetic, num_epoch=1000)
    work = tmp_path / "term"
    job = start_and_wait(launch(2, train_args(config, work)), work)
    ranks = rank_pids(f"partial_fc_mx train {config}")
    subprocess.run(["kill", "-TERM", str(ranks[-1])])
    try:
        job.wait(timeout=120)
    finally:
        job.kill()
    saved = sorted((work / "checkpoints").glob("step_*"))
    assert saved, "no checkpoint was written"
    meta = json.loads((saved[-1] / "meta.json").read_text())
    assert meta["step"] >= 2 and meta["world_size"] == 2
    assert (saved[-1] / "rank_0_softmax_weight.npy").is_file()
    assert (saved[-1] / "rank_1_softmax_weight.npy").is_file()
    assert "stopped by a signal" in (work / "training.log").read_text()


def test_divergence_stops_loudly_and_keeps_the_last_checkpoint(tmp_path, synthetic):
    config = config_file(tmp_path, synthetic, lr=1e30, max_steps=20, save_every=1)
    result = mpirun(2, train_args(config, tmp_path / "nan"), timeout=300)
    assert result.returncode != 0
    assert re.search(r"error: (the loss became (nan|inf)|Partial FC input rejected: "
                     r"rank \d passed non-finite embeddings)", result.stdout), result.stdout[-2000:]
    saved = sorted((tmp_path / "nan" / "checkpoints").glob("step_*"))
    assert not list((tmp_path / "nan" / "checkpoints").glob(".*partial"))
    if saved:  # every checkpoint that exists is complete and finite
        weights = np.load(saved[-1] / "rank_0_softmax_weight.npy")
        assert np.isfinite(weights).all()


def test_bad_configurations_are_refused(tmp_path, synthetic):
    cpu_fp16 = run(train_args(config_file(tmp_path, synthetic, fp16=True), tmp_path / "x"))
    assert cpu_fp16.returncode == 1 and "fp16=True needs a GPU" in cpu_fp16.stdout
    wrong = run(train_args(config_file(tmp_path, synthetic, num_classes=CLASSES + 1),
                           tmp_path / "y"))
    assert wrong.returncode == 1 and f"says {CLASSES} classes but num_classes is " \
                                      f"{CLASSES + 1}" in wrong.stdout
    unknown = run(train_args(config_file(tmp_path, synthetic), tmp_path / "z", "lr_step=3"))
    assert unknown.returncode == 2 and "did you mean 'lr_steps'" in unknown.stdout


@pytest.mark.parametrize("name, params_m, gflops", [
    ("r50", 43.6, 6.3), ("r100", 65.2, 12.1), ("mobilefacenet", 1.2, 0.22)])
def test_backbones_have_the_published_size(name, params_m, gflops):
    net = get_model(name)
    net.initialize()
    params, macs = count_flops(net)
    assert abs(params / 1e6 - params_m) < 0.1 and abs(macs / 1e9 - gflops) < 0.05
    assert net(mx.nd.zeros((2, 3, 112, 112))).shape == (2, 512)
