"""The trainer with real processes: learning, resume, re-sharding, failures, signals."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    CLASSES,
    config_file,
    finish,
    horovodrun_gloo,
    horovodrun_gloo_command,
    kill_group,
    logged,
    mpirun,
    mpirun_command,
    output_of,
    python_module,
    rank_pids,
    run,
    sixteen_bits,
    start,
    train_args,
)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from partial_fc_mx.pfc.partial_fc import PartialFC
from partial_fc_mx.run import checkpoint
from partial_fc_mx.run.metrics import read_metrics


def test_two_processes_learn_and_verify_better_on_unseen_identities(tmp_path, synthetic):
    config = config_file(tmp_path, synthetic, val_targets=["synthetic_heldout"], num_epoch=6,
                         report_baseline=True)
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
    # TensorBoard itself reads the event files: the same losses and accuracies
    events = EventAccumulator(str(work / "tensorboard"))
    events.Reload()
    board_losses = {event.step: event.value for event in events.Scalars("loss")}
    assert board_losses.keys() == log["losses"].keys()
    assert np.allclose([board_losses[s] for s in steps], [log["losses"][s] for s in steps])
    board_accuracy = [(e.step, e.value) for e in events.Scalars("verification/synthetic_heldout")]
    assert [s for s, _ in board_accuracy] == [s for s, _ in log["accuracy"]]
    assert np.allclose([a for _, a in board_accuracy], [a for _, a in log["accuracy"]])
    assert re.search(r"Speed [\d.]+ samples/sec   Loss [\d.]+   LearningRate [\d.]+   "
                     r"Epoch: \d+   Global Step: \d+   Required: [\d.]+ hours", log["text"])
    assert (work / "backbone.onnx").is_file() and (work / "backbone-best-symbol.json").is_file()
    # the eval command on what training left reproduces the final logged accuracy
    heldout = str(synthetic / "synthetic_heldout.bin")
    for model, tolerance in ((work, 0.0), (work / "backbone.onnx", 0.005)):
        evaluated = run(python_module("eval", "--model", str(model), "--bin", heldout))
        assert evaluated.returncode == 0, evaluated.stdout[-2000:]
        accuracy = float(re.search(r"accuracy ([\d.]+) \+-", evaluated.stdout).group(1))
        # eval prints 5 decimals; metrics.jsonl keeps the full value
        assert abs(accuracy - round(after, 5)) <= tolerance, (model, accuracy, after)
        assert "Cannot decide type" not in evaluated.stdout
        if model == work:  # which model, saved at which step
            assert f"evaluating {work}/backbone (step {steps[-1]})\n" in evaluated.stdout
    # --best: the model the best verification kept, named with its step and accuracy
    best_accuracy, best_step = max((a, -s) for s, a in log["accuracy"] if s > 0)
    best = run(python_module("eval", "--model", str(work), "--bin", heldout, "--best"))
    assert best.returncode == 0, best.stdout[-2000:]
    assert (f"evaluating {work}/backbone-best (step {-best_step}, mean verification accuracy "
            f"{best_accuracy:.5f} in training)") in best.stdout, best.stdout
    assert float(re.search(r"accuracy ([\d.]+) \+-", best.stdout).group(1)) == round(
        best_accuracy, 5)
    plots = run(python_module("plot", str(work)))
    assert plots.returncode == 0, plots.stdout
    assert plots.stdout.splitlines() == [f"wrote {work / 'plots' / name}.png" for name in
                                         ("loss", "learning_rate", "speed", "verification")]
    for name in ("loss", "learning_rate", "speed", "verification"):
        assert (work / "plots" / f"{name}.png").stat().st_size > 5000
    # the last line: the gain from training, from step 0's accuracy, beside eigenfaces
    # (checkpoints keep step 0's: tests/test_evaluation.py, the validator's state)
    assert re.search(rf"\[synthetic_heldout\] model accuracy {after:.4f} \({before:.4f} at "
                     rf"step 0, before training\) vs eigenfaces \(PCA\) baseline 0\.\d{{4}} on "
                     "the same pairs", log["text"]), log["text"][-2000:]


@pytest.mark.parametrize("centers", [
    {},
    {"center_optimizer": "adamw", "center_lr_scale": 0.1, "fp16_centers": True,
     "margin": "adaface", "margin_options": {"t_alpha": 0.5}},  # its statistics resume too
    {"optimizer": "adamw", "lr": 0.001, "center_lr_scale": 100.0},  # the backbone's AdamW
])
def test_resumed_run_repeats_the_uninterrupted_losses(tmp_path, synthetic, centers):
    config = config_file(tmp_path, synthetic, max_steps=10, save_every=4, sample_rate=0.5,
                         keep_checkpoints=5, **centers)
    straight = mpirun(2, train_args(config, tmp_path / "a"), timeout=600)
    assert straight.returncode == 0, straight.stdout[-3000:]
    assert "no launcher started it" not in straight.stdout
    checkpoint = tmp_path / "a" / "checkpoints" / "step_000004"
    assert json.loads((checkpoint / "meta.json").read_text())["step"] == 4
    resumed = mpirun(2, train_args(config, tmp_path / "b", "--resume-from", str(checkpoint)),
                     timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    a, b = logged(tmp_path / "a")["losses"], logged(tmp_path / "b")["losses"]
    assert sorted(b) == list(range(5, 11))
    assert [b[s] for s in range(5, 11)] == [a[s] for s in range(5, 11)]


def test_a_resume_in_the_same_work_dir_says_which_lines_are_redone(tmp_path, synthetic):
    """Resumed from an earlier checkpoint into its own work dir, training.log says the
    later step lines are the stopped run's, and the metrics keep one line of steps;
    resumed at its end, a run trains and evaluates nothing again."""
    config = config_file(tmp_path, synthetic, max_steps=4, save_every=2, keep_checkpoints=3,
                         val_targets=["synthetic_heldout"])
    work = tmp_path / "work"
    assert run(train_args(config, work), timeout=600).returncode == 0
    again = run(train_args(config, work, "--resume-from",
                           str(work / "checkpoints" / "step_000002")), timeout=600)
    assert again.returncode == 0, again.stdout[-3000:]
    text = logged(work)["text"]
    assert "resumed at step 2: the lines above for steps 3..4 are the stopped run's" in text
    assert len(re.findall(r"Global Step: 4\b", text)) == 2  # kept: the log is append-only
    assert read_metrics(work)["step"] == [1, 2, 3, 4]
    evaluations = len(logged(work)["accuracy"])
    done = run(train_args(config, work, "--resume-from", str(work)), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "nothing left to train: step 4 is the end of the run" in done.stdout
    assert len(logged(work)["accuracy"]) == evaluations  # no second evaluation of step 4
    assert "resumed at step 4:" not in logged(work)["text"]
    # a checkpoint whose step was not evaluated (a periodic save, a save on a signal)
    # is evaluated once when the run resumed from it has nothing left to train
    shorter = config_file(tmp_path, synthetic, name="shorter.py", max_steps=2,
                          val_targets=["synthetic_heldout"])
    ended = run(train_args(shorter, tmp_path / "ended", "--resume-from",
                           str(work / "checkpoints" / "step_000002")), timeout=600)
    assert ended.returncode == 0, ended.stdout[-3000:]
    assert "nothing left to train: step 2" in ended.stdout
    assert [step for step, _ in logged(tmp_path / "ended")["accuracy"]] == [2]


@pytest.mark.parametrize("before, after, optimizer, blocks, subcenters", [
    (2, 1, "sgd", [], 1), (1, 2, "adamw", [], 3), (2, 3, "sgd", ["7"], 3),
    (3, 2, "adamw", ["9"], 1)])
def test_resharding_keeps_the_center_matrix(tmp_path, synthetic, before, after, optimizer,
                                            blocks, subcenters):
    """`blocks`: the new ranks store their rows in blocks of that many rows;
    `subcenters`: K rows per class, which a new shard takes together (7-row blocks
    split a class's 3)."""
    keys = {"num_subcenters": subcenters, "interclass_filtering_threshold": 0.3} \
        if subcenters > 1 else {}
    config = config_file(tmp_path, synthetic, max_steps=2, save_every=2,
                         center_optimizer=optimizer, **keys)
    args = train_args(config, tmp_path / "work")
    made = mpirun(before, args, timeout=600) if before > 1 else run(args, timeout=600)
    assert made.returncode == 0, made.stdout[-3000:]
    checkpoint = tmp_path / "work" / "checkpoints" / "step_000002"
    worker = [sys.executable, "tests/reshard_worker.py", str(checkpoint), *blocks]
    result = horovodrun_gloo(after, worker, timeout=300) if after > 1 else run(worker)
    assert result.returncode == 0, result.stdout[-3000:]
    states = {"sgd": "mom", "adamw": "mean steps var"}[optimizer]
    assert f"RESHARD OK {before} -> {after} weight {states}" in result.stdout
    # and training goes on from there on the new number of processes
    config = config_file(tmp_path, synthetic, max_steps=3, save_every=3,
                         center_optimizer=optimizer, **keys)
    go_on = train_args(config, tmp_path / "more", "--resume-from", str(checkpoint))
    continued = mpirun(after, go_on, timeout=600) if after > 1 else run(go_on, timeout=600)
    assert continued.returncode == 0, continued.stdout[-3000:]
    # max_steps counts steps of the global batch the run started with (24 x before):
    # the resumed run stops at the same image, in as many of its own steps as that takes
    lines = logged(tmp_path / "more")["steps"]
    assert [line["step"] for line in lines] == list(range(3, 3 + -(-before // after)))
    assert lines[-1]["images"] >= 3 * 24 * before > lines[-1]["images"] - 24 * after
    assert ("filtered_percent" in lines[-1]) == (subcenters > 1)  # the filter's share


def test_sub_centers_start_from_one_center_per_class_and_never_lose_rows(tmp_path, synthetic):
    """--load-from a K = 1 run into K = 3: sub-center 0 of every class is its trained row,
    the others that row turned by about 6 degrees (all distinct). A K = 3 checkpoint
    cannot resume as K = 1 or load into K = 2: refused, naming both counts."""
    config = config_file(tmp_path, synthetic, max_steps=2, save_every=2)
    assert run(train_args(config, tmp_path / "a"), timeout=600).returncode == 0
    three = config_file(tmp_path, synthetic, name="three.py", max_steps=1, save_every=1,
                        num_subcenters=3)
    loaded = run(train_args(three, tmp_path / "b", "--load-from", str(tmp_path / "a")),
                 timeout=600)
    assert loaded.returncode == 0, loaded.stdout[-3000:]
    one = np.load(tmp_path / "a/checkpoints/step_000002/rank_0_softmax_weight.npy")
    meta = json.loads((tmp_path / "b/checkpoints/step_000001/meta.json").read_text())
    assert meta["num_subcenters"] == 3
    refused = run(train_args(config, tmp_path / "c", "--resume-from", str(tmp_path / "b")),
                  timeout=600)
    assert refused.returncode != 0
    assert "holds 3 sub-center(s) per class; this run has num_subcenters=1" in refused.stdout
    two = run(train_args(config, tmp_path / "d", "--load-from", str(tmp_path / "b"),
                         "num_subcenters=2"), timeout=600)
    assert two.returncode != 0
    assert "holds 3 sub-center(s) per class; this run has num_subcenters=2" in two.stdout
    # the loaded rows, before any step: a K = 3 PartialFC given the K = 1 checkpoint
    saved = tmp_path / "a/checkpoints/step_000002"
    pfc = PartialFC(CLASSES, 64, num_subcenters=3, initialize_centers=False)
    checkpoint.load_centers(saved, json.loads((saved / "meta.json").read_text()), pfc,
                            with_states=False)
    rows = pfc.centers.state_dict()["weight"].reshape(CLASSES, 3, 64)
    assert rows[:, 0].tobytes() == one.tobytes()
    cos = (rows[:, 1:] * one[:, None]).sum(2) / (np.linalg.norm(rows[:, 1:], axis=2)
                                                 * np.linalg.norm(one, axis=1)[:, None])
    angles = np.degrees(np.arccos(np.clip(cos, -1, 1)))
    assert 4 < angles.min() and angles.max() < 7, (angles.min(), angles.max())
    assert not np.allclose(rows[:, 1], rows[:, 2])


def test_load_from_takes_weights_and_starts_at_step_zero(tmp_path, synthetic):
    config = config_file(tmp_path, synthetic, max_steps=30, save_every=30)
    assert run(train_args(config, tmp_path / "a"), timeout=600).returncode == 0
    fresh = config_file(tmp_path, synthetic, max_steps=1)
    loaded = run(train_args(fresh, tmp_path / "b", "--load-from", str(tmp_path / "a")))
    scratch = run(train_args(fresh, tmp_path / "c"))
    assert loaded.returncode == 0 and scratch.returncode == 0, loaded.stdout[-2000:]
    assert "training in this one process: no launcher started it" in scratch.stdout
    b, c = logged(tmp_path / "b")["losses"], logged(tmp_path / "c")["losses"]
    assert sorted(b) == [1] and b[1] < c[1] - 2.0, (b, c)  # first step: trained weights
    assert "resumed" not in logged(tmp_path / "b")["text"]


def test_a_16_bit_run_saves_resumes_on_more_processes_exports_and_loads_in_float32(
        tmp_path, synthetic):
    """The mixed-precision graph in bfloat16 where oneDNN runs it (with the loss scaler
    and clip_grad) saves on 1 process, resumes on 2, exports an ONNX model that
    matches; a float32 run then loads its weights; the 16-bit run goes on under an
    AVX2 cap (a host without AVX-512: float32 there), and resumes a float32 checkpoint
    with a fresh loss scale."""
    keys, dtype = sixteen_bits()
    scale = 2.0**16 if dtype != "float32" else 1.0  # a float32 run keeps 1.0: no scaler
    config = config_file(tmp_path, synthetic, clip_grad=2.0, max_steps=2, **keys)
    work = tmp_path / "work"
    first = run(train_args(config, work), timeout=600)
    assert first.returncode == 0, first.stdout[-3000:]
    saved = json.loads((work / "checkpoints" / "step_000002" / "meta.json").read_text())
    assert saved["loss_scale"] == scale
    longer = config_file(tmp_path, synthetic, name="longer.py", clip_grad=2.0,
                         max_steps=6, **keys)  # 6 steps of 24 images: 2 more of 48 on 2
    resumed = mpirun(2, train_args(longer, work, "--resume-from", str(work)), timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    log = logged(work)
    assert sorted(log["losses"]) == [1, 2, 3, 4] and all(np.isfinite(list(log["losses"].values())))
    assert f"2 processes on cpu(0), backbone in {dtype} (fp16=True" in log["text"]
    exported = run(python_module("export", str(work)))
    assert exported.returncode == 0, exported.stdout[-2000:]  # parity within 1e-4
    assert exported.stdout.startswith(f"wrote {work / 'backbone.onnx'}; onnxruntime against")
    assert "INFO" not in exported.stdout  # MXNet's exporter says nothing
    full = config_file(tmp_path, synthetic, name="full.py", max_steps=1)
    loaded = run(train_args(full, tmp_path / "full", "--load-from", str(work)))
    assert loaded.returncode == 0, loaded.stdout[-2000:]
    assert "backbone in float32" in logged(tmp_path / "full")["text"]
    # the same config moved to a CPU without AVX-512: auto trains it in float32
    capped = config_file(tmp_path, synthetic, name="capped.py", fp16=True, max_steps=8)
    moved = run(train_args(capped, work, "--resume-from", str(work)), timeout=600,
                env={"DNNL_MAX_CPU_ISA": "AVX2"})
    assert moved.returncode == 0, moved.stdout[-3000:]
    assert "backbone in float32 (fp16=True on a CPU without native bfloat16 (oneDNN uses " \
           "Intel AVX2" in logged(work)["text"]
    assert sorted(logged(work)["losses"]) == [1, 2, 3, 4, 5, 6]
    meta = work / "checkpoints" / "step_000006" / "meta.json"
    assert json.loads(meta.read_text())["loss_scale"] == 1.0
    # and back: a float32 checkpoint (no loss scaling) resumed with fp16 scales afresh
    again = config_file(tmp_path, synthetic, name="again.py", max_steps=2, **keys)
    half = run(train_args(again, tmp_path / "full", "--resume-from", str(tmp_path / "full")))
    assert half.returncode == 0, half.stdout[-2000:]
    meta = tmp_path / "full" / "checkpoints" / "step_000002" / "meta.json"
    assert json.loads(meta.read_text())["loss_scale"] == scale


def start_and_wait(args: list[str], work: Path, steps: int = 2) -> subprocess.Popen:
    process = start(args)
    deadline = time.time() + 180
    while time.time() < deadline:
        log = work / "training.log"
        if log.is_file() and len(re.findall(r"Global Step: \d+", log.read_text())) >= steps:
            return process
        time.sleep(0.5)
    kill_group(process)
    raise AssertionError(f"training did not reach step {steps}: {output_of(process)}")


def wait_for_ranks_to_exit(pattern: str, since: float, limit: float) -> None:
    while rank_pids(pattern) and time.time() - since < limit:
        time.sleep(0.5)
    assert not rank_pids(pattern), f"ranks still running {limit} s later"


@pytest.mark.parametrize("launch", [mpirun_command, horovodrun_gloo_command])
def test_a_killed_rank_ends_the_job_within_a_minute(tmp_path, synthetic, launch):
    config = config_file(tmp_path, synthetic, num_epoch=1000)
    work = tmp_path / "killed"
    job = start_and_wait(launch(2, train_args(config, work)), work)
    pattern = f"partial_fc_mx train {config}"
    victims = rank_pids(pattern)
    assert len(victims) == 2
    begin = time.time()
    subprocess.run(["kill", "-9", str(victims[-1])])
    code = finish(job, timeout=60).returncode
    wait_for_ranks_to_exit(pattern, begin, 60)  # and no rank outlives it
    assert code != 0


@pytest.mark.parametrize("launch", [mpirun_command, horovodrun_gloo_command])
def test_sigterm_to_one_rank_saves_a_checkpoint_on_all_and_it_resumes(tmp_path, synthetic,
                                                                      launch):
    config = config_file(tmp_path, synthetic, num_epoch=1000)
    work = tmp_path / "term"
    job = start_and_wait(launch(2, train_args(config, work)), work)
    pattern = f"partial_fc_mx train {config}"
    begin = time.time()
    subprocess.run(["kill", "-TERM", str(rank_pids(pattern)[-1])])
    result = finish(job, timeout=60)
    wait_for_ranks_to_exit(pattern, begin, 60)
    assert result.stdout.count("stopped by a signal") == 1  # rank 0's log line
    assert re.search(r"exit code:\s*143", result.stdout, re.IGNORECASE) or \
        result.returncode == 143, (result.returncode, result.stdout[-2000:])
    saved = checkpoint.checkpoints(work)
    assert saved, "no checkpoint was written"
    meta = json.loads((saved[-1] / "meta.json").read_text())
    assert meta["step"] >= 2 and meta["world_size"] == 2
    assert (saved[-1] / "rank_0_softmax_weight.npy").is_file()
    assert (saved[-1] / "rank_1_softmax_weight.npy").is_file()
    # the SIGTERM checkpoint resumes: two more steps from where it stopped
    more = config_file(tmp_path, synthetic, name="more.py", max_steps=meta["step"] + 2)
    resumed = mpirun(2, train_args(more, tmp_path / "resumed", "--resume-from", str(work)))
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    steps = [line["step"] for line in logged(tmp_path / "resumed")["steps"]]
    assert steps == [meta["step"] + 1, meta["step"] + 2]


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


def test_an_update_that_makes_the_weights_non_finite_is_never_saved(tmp_path, synthetic):
    """The loss of step 3 is finite (it is computed before the update), but the update
    multiplies every weight by about -lr * weight_decay (the rate there is 2.5e29 of the
    polynomial schedule; x 1e12 = 2.5e41): beyond float32, infinite. The save after it
    must refuse on every rank, and the last good checkpoint (step 2) stays the newest."""
    good = config_file(tmp_path, synthetic, max_steps=2, save_every=2)
    assert mpirun(2, train_args(good, tmp_path / "run")).returncode == 0
    bad = config_file(tmp_path, synthetic, name="bad.py", lr=1e30, weight_decay=1e12,
                      max_steps=4, save_every=1)
    result = mpirun(2, train_args(bad, tmp_path / "run", "--resume-from",
                                  str(tmp_path / "run")))
    assert result.returncode == 1, result.stdout[-3000:]
    steps = [line for line in logged(tmp_path / "run")["steps"] if line["step"] == 3]
    assert steps and np.isfinite(steps[0]["loss"])
    message = re.findall(r"error: (.*)", result.stdout)
    assert len(message) == 1, result.stdout[-3000:]
    assert message[0].startswith("the weights became non-finite (NaN/Inf) at step 3: "
                                 "backbone parameter")
    assert f"the last good checkpoint, {tmp_path / 'run' / 'checkpoints' / 'step_000002'}, " \
           "is untouched" in message[0]
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert saved == ["step_000002"]


def test_bad_configurations_are_refused(tmp_path, synthetic):
    wrong = run(train_args(config_file(tmp_path, synthetic, num_classes=CLASSES + 1),
                           tmp_path / "y"))
    assert wrong.returncode == 1 and f"says {CLASSES} classes but num_classes is " \
                                      f"{CLASSES + 1}" in wrong.stdout
    unknown = run(train_args(config_file(tmp_path, synthetic), tmp_path / "z", "lr_step=3"))
    assert unknown.returncode == 2 and "did you mean 'lr_steps'" in unknown.stdout
