"""Runs that stop anywhere exit; runs resumed on another number of processes train
what an uninterrupted run trains (real processes throughout)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from conftest import config_file, logged, mpirun, run, train_args

from partial_fc_mx.data.loader import FaceLoader
from partial_fc_mx.data.recordio import RecordDataset
from partial_fc_mx.prep.synthetic import prepare_synthetic

# 720 images: 15 global batches of 24 x 2 per epoch


@pytest.mark.parametrize("prefetch", [1, 2, 4])
def test_a_loader_stopped_at_any_position_finishes(synthetic, prefetch):
    """Closing the epoch's generator with 0..5 batches left must return at once: the
    producer may be blocked handing over a batch, or the end of the epoch."""
    dataset = RecordDataset(synthetic)
    loader = FaceLoader(dataset, 48, num_workers=1, prefetch=prefetch, seed=3)
    for left in range(6):
        batches = loader.epoch(0)
        for _ in range(len(loader) - left):
            next(batches)
        time.sleep(0.3)  # let the producer fill the queue (and block on it)
        closer = threading.Thread(target=batches.close, daemon=True)
        closer.start()
        closer.join(timeout=10)
        assert not closer.is_alive(), f"stopping {left} batches before the end hangs"


@pytest.mark.parametrize("before_end", [0, 3])
def test_training_that_stops_before_the_epoch_end_exits(tmp_path, synthetic, before_end):
    """The whole job, at the epoch's end and with the loader's producer blocked on a full
    queue (3 batches left, 2 prefetched); every position in between is the loader's own
    test above."""
    config = config_file(tmp_path, synthetic, max_steps=15 - before_end, val_targets=[])
    began = time.time()
    result = mpirun(2, train_args(config, tmp_path / "work"), timeout=180)
    assert result.returncode == 0, result.stdout[-3000:]
    lines = logged(tmp_path / "work")["steps"]
    assert [line["step"] for line in lines] == list(range(1, 16 - before_end))
    saved = tmp_path / "work" / "checkpoints" / f"step_{15 - before_end:06d}"
    assert (saved / "meta.json").is_file()
    assert time.time() - began < 150


# ----- resuming on another world size -----
PER_RANK = 12


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """360 images: a whole number of global batches of 12 x 1, 2 and 3 processes, so
    the step boundaries of different world sizes coincide and can be compared."""
    directory = tmp_path_factory.mktemp("small") / "syn"
    prepare_synthetic(str(directory), 60, per_class=6, heldout=10, pairs=20, seed=2)
    return directory


def schedule_config(directory: Path, data: Path, name: str = "config.py") -> Path:
    return config_file(directory, data, name=name, num_classes=60, batch_size=PER_RANK,
                       num_epoch=2, warmup_epoch=1, save_every=3, keep_checkpoints=100,
                       val_targets=[])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, small) -> dict:
    """A whole two-epoch run on 1 and on 2 processes, with checkpoints every 3 steps."""
    runs = {}
    for world in (1, 2):
        directory = tmp_path_factory.mktemp(f"whole{world}")
        args = train_args(schedule_config(directory, small), directory / "work")
        result = mpirun(world, args, timeout=600) if world > 1 else run(args, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:]
        runs[world] = directory / "work"
    return runs


def lr_by_start(lines: list[dict], global_batch: int) -> dict:
    """{image position where a step started: its learning rate} (no image is dropped
    here, so the images seen before a step are its position)."""
    return {line["images"] - global_batch: line["learning_rate"] for line in lines}


@pytest.mark.parametrize("before, after", [(1, 2), (2, 1), (2, 3)])
def test_a_run_resumed_on_another_world_size_covers_the_same_epochs_at_the_same_rates(
        tmp_path, small, uninterrupted, before, after):
    whole = uninterrupted[before]
    # step 6 is inside the warmup epoch, and the rest of that epoch (360 - 72 x before
    # images) is a whole number of global batches of 12 x after
    checkpoint = whole / "checkpoints" / "step_000006"
    resumed = tmp_path / "resumed"
    args = train_args(schedule_config(tmp_path, small), resumed, "--resume-from",
                      str(checkpoint))
    result = mpirun(after, args, timeout=600) if after > 1 else run(args, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:]
    reference, lines = logged(whole)["steps"], logged(resumed)["steps"]
    # the same two epochs: every image of both, the last step in epoch 1
    assert reference[-1]["images"] == lines[-1]["images"] == 2 * 360
    assert lines[-1]["epoch"] == reference[-1]["epoch"] == 1
    assert lines[0]["images"] == 6 * PER_RANK * before + PER_RANK * after
    assert lines[0]["step"] == 7 and len(lines) == (720 - 6 * PER_RANK * before) // (
        PER_RANK * after)
    # the learning rate is the same function of progress: equal wherever both runs
    # start a step at the same image
    expected = lr_by_start(reference, PER_RANK * before)
    got = lr_by_start(lines, PER_RANK * after)
    shared = sorted(set(expected) & set(got))
    assert len(shared) >= min(len(expected), len(got)) // 2 - 5, shared
    assert [got[p] for p in shared] == [expected[p] for p in shared]
    assert max(got.values()) == pytest.approx(0.1, abs=1e-6)  # the warmup reached base lr


def test_a_resume_where_the_epoch_has_no_global_batch_left_goes_on_with_the_next(
        tmp_path, small):
    """29 steps of 12 on one process leave 12 images of epoch 0: less than the 24 of a
    global batch on two processes, which therefore start at epoch 1."""
    first = schedule_config(tmp_path, small)
    config = config_file(tmp_path, small, name="short.py", num_classes=60,
                         batch_size=PER_RANK, max_steps=29, save_every=29, val_targets=[])
    assert run(train_args(config, tmp_path / "short"), timeout=300).returncode == 0
    checkpoint = tmp_path / "short" / "checkpoints" / "step_000029"
    result = mpirun(2, train_args(first, tmp_path / "resumed", "--resume-from",
                                  str(checkpoint)), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "resumed at step 29 (epoch 1, 0 images into it)" in result.stdout
    lines = logged(tmp_path / "resumed")["steps"]
    assert [line["epoch"] for line in lines] == [1] * 15  # all of epoch 1, nothing else
    assert lines[0]["images"] == 29 * PER_RANK + 2 * PER_RANK
    assert (tmp_path / "resumed" / "checkpoints" / "step_000044").is_dir()


def test_a_run_started_again_on_fewer_processes_keeps_the_first_launchs_schedule(
        tmp_path, small):
    """The restart supervisor relaunches a job that has no checkpoint yet with
    reference_batch = the first launch's global batch: max_steps (and lr_steps) are
    steps of that batch, so one process trains the images two would have."""
    config = config_file(tmp_path, small, num_classes=60, batch_size=PER_RANK, max_steps=5,
                         lr_steps=[3], val_targets=[])
    two = mpirun(2, train_args(config, tmp_path / "two"), timeout=300)
    assert two.returncode == 0, two.stdout[-3000:]
    one = run(train_args(config, tmp_path / "one", f"reference_batch={2 * PER_RANK}"),
              timeout=300)
    assert one.returncode == 0, one.stdout[-3000:]
    first, again = logged(tmp_path / "two")["steps"], logged(tmp_path / "one")["steps"]
    assert first[-1]["images"] == again[-1]["images"] == 5 * 2 * PER_RANK
    assert len(again) == 10
    for lines, batch in ((first, 2 * PER_RANK), (again, PER_RANK)):  # lr / 10 after 3
        rates = lr_by_start(lines, batch)                          # steps of 24 in both
        assert min(p for p, rate in rates.items() if rate < 0.1 - 1e-9) == 3 * 2 * PER_RANK
