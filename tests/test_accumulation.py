"""gradient_accumulation: k micro-batches per optimizer step are one step of the large
batch. The trainer's own train_step against the whole batch with real processes
(tests/accumulation_worker.py); the classifier's side against the float64 reference
is test_partial_fc.py's `accum` cases. Then a run as users launch it counts optimizer
steps of the accumulated global batch, saves and resumes on another world size."""

from __future__ import annotations

import sys

import pytest
from conftest import config_file, horovodrun_gloo, logged, mpirun, run, train_args

from partial_fc_mx.config import Config, ConfigError
from partial_fc_mx.run import checkpoint

WORKER = "tests/accumulation_worker.py"


@pytest.mark.parametrize("launcher, world, optimizer", [
    ("python", 1, "sgd"), ("mpirun", 2, "adamw"), ("horovodrun", 3, "sgd")])
def test_micro_batches_accumulated_are_the_whole_batchs_step(launcher, world, optimizer):
    args = [sys.executable, WORKER, optimizer]
    result = (run(args) if launcher == "python" else
              mpirun(world, args) if launcher == "mpirun" else horovodrun_gloo(world, args))
    assert result.returncode == 0, result.stdout[-3000:]
    for rank in range(world):
        assert f"PASS rank {rank}/{world} {optimizer}:" in result.stdout, result.stdout[-3000:]


def test_a_run_counts_steps_of_the_accumulated_batch_and_resumes_on_more_processes(tmp_path):
    """240 images, 2 processes x 2 micro-batches of 12: a global batch of 48, 5 steps an
    epoch, as a run of batch_size 24 has; resumed from step 2 on 3 processes (a global
    batch of 72) it finishes the epoch in 2 more."""
    config = config_file(tmp_path, "random", num_image=240, batch_size=12,
                         gradient_accumulation=2, num_epoch=1, save_every=2,
                         keep_checkpoints=3)
    work = tmp_path / "work"
    result = mpirun(2, train_args(config, work))
    assert result.returncode == 0, result.stdout[-3000:]
    log = logged(work)
    assert "global batch 48 (each 2 micro-batches of 12 per process, accumulated), 5 steps " \
           "per epoch, 5 steps" in log["text"], log["text"][:3000]
    assert sorted(log["losses"]) == [1, 2, 3, 4, 5]
    assert [checkpoint.step_of(path) for path in checkpoint.checkpoints(work)] == [2, 4, 5]
    again = tmp_path / "again"
    resumed = horovodrun_gloo(3, train_args(config, again, "--resume-from",
                                            str(work / "checkpoints" / "step_000002")))
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    log = logged(again)
    assert "global batch 72 (each 2 micro-batches of 12 per process, accumulated)" in \
        log["text"] and "resumed at step 2 (epoch 0, 96 images into it)" in log["text"], \
        log["text"][:3000]
    assert sorted(log["losses"]) == [3, 4]


@pytest.mark.parametrize("keys, said", [
    ({"gradient_accumulation": 0}, "gradient_accumulation=0 must be a whole number"),
    ({"gradient_accumulation": 2, "margin": "adaface"},
     "AdaFace follows statistics of each whole global batch's embeddings")])
def test_accumulation_that_cannot_equal_the_large_batch_is_refused(keys, said):
    with pytest.raises(ConfigError, match=said):
        Config(**keys).validate()
