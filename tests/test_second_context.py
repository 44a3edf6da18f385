"""Training with the model and the class centers on mx.cpu(1) while the data arrives
in host memory, under a check on MXNet's operator dispatch (context_guard.py): what a
GPU run does with its devices, found without a GPU. MXNet's imperative dispatch does
not tell cpu(0) from cpu(1), so only the check can; it is shown to catch a deliberate
mix first."""

from __future__ import annotations

import re
import sys

import mxnet as mx
import pytest
from conftest import config_file, horovodrun_gloo, logged, mpirun, run, sixteen_bits
from context_guard import ContextMix, guard

from partial_fc_mx.pfc.gemm import fully_connected_backward

WORKER = [sys.executable, "tests/context_worker.py"]


def test_the_check_catches_a_deliberate_mix_and_lets_copies_through():
    here, there = mx.nd.ones((2, 3), ctx=mx.cpu(0)), mx.nd.ones((3, 2), ctx=mx.cpu(1))
    graph = mx.nd.CachedOp(mx.sym.dot(mx.sym.var("a"), mx.sym.var("b")))
    with guard() as checked:
        with pytest.raises(ContextMix, match=r"operator \S*dot mixes contexts \['cpu\(0\)', "
                                             r"'cpu\(1\)'\]"):
            mx.nd.dot(here, there)
        with pytest.raises(ContextMix, match="add|plus"):
            here + there.T  # noqa: B018 (the mix is the point)
        with pytest.raises(ContextMix, match="a cached graph's inputs mix contexts"):
            graph(here, there)
        with pytest.raises(ContextMix, match="mixes contexts"):  # Partial FC's backward GEMMs
            fully_connected_backward(mx.nd.ones((3, 2)), here.T, mx.nd.ones((2, 2)),
                                     mx.nd.zeros((3, 2)), mx.nd.zeros((2, 2), ctx=mx.cpu(1)))
        moved = here.as_in_context(mx.cpu(1))  # an explicit copy
        assert mx.nd.dot(moved, there).context == mx.cpu(1)
        assert checked.operators >= 2
    assert mx.nd.dot(here, there).shape == (2, 2)  # the check is gone again


def guarded(result) -> list[tuple[int, int]]:
    """(operators, cached graphs) each rank ran under the check."""
    found = re.findall(r"GUARDED (\d+) (\d+)", result.stdout)
    return [(int(a), int(b)) for a, b in found]


def test_training_keeps_every_operator_on_its_device(tmp_path, synthetic):
    """Sampled Partial FC with float16 AdamW centers, AdaFace, clip_grad and the 16-bit
    backbone (bfloat16 where oneDNN runs it), evaluated and saved, then resumed on
    another number of processes; and sampled Partial FC with CosFace and SGD (the exact
    update). Every rank runs hundreds of operators and the cached graphs under the
    check, none mixing contexts, through the row passes and the SGD update a GPU runs
    (MXNet's operators, not the CPU's fused kernels)."""
    keys, dtype = sixteen_bits()
    sampled = config_file(tmp_path, synthetic, name="sampled.py", sample_rate=0.5,
                          fp16_centers=True, center_optimizer="adamw", margin="adaface",
                          clip_grad=1.0, val_targets=["synthetic_heldout"],
                          max_steps=3, save_every=2, keep_checkpoints=3, **keys)
    work = tmp_path / "sampled"
    first = horovodrun_gloo(2, [*WORKER, "train", str(sampled), "--work-dir", str(work)],
                            timeout=600)
    assert first.returncode == 0, first.stdout[-4000:]
    step_2 = work / "checkpoints" / "step_000002"
    resumed = run([*WORKER, "train", str(sampled), "--work-dir", str(tmp_path / "resumed"),
                   "--resume-from", str(step_2)], timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    with_sgd = config_file(tmp_path, synthetic, name="sgd.py", sample_rate=0.5, max_steps=2)
    second = mpirun(2, [*WORKER, "train", str(with_sgd), "--work-dir", str(tmp_path / "sgd")],
                    timeout=600)
    assert second.returncode == 0, second.stdout[-4000:]
    for result, ranks in ((first, 2), (resumed, 1), (second, 2)):
        counts = guarded(result)
        assert len(counts) == ranks, result.stdout[-3000:]
        assert all(operators > 300 and cached >= 1 for operators, cached in counts), counts
        composed = re.findall(r"COMPOSED (\d+) \d+ \d+", result.stdout)
        assert len(composed) == ranks and all(int(rows) >= 1 for rows in composed)
    sgd = re.findall(r"COMPOSED \d+ (\d+) (\d+)", second.stdout)  # SGD's, unfused
    assert len(sgd) == 2 and all(int(updates) >= 2 and int(replays) >= 1
                                 for updates, replays in sgd), sgd
    text = logged(work)["text"]
    assert f"2 processes on cpu(1), backbone in {dtype}" in text
    assert logged(work)["accuracy"] and (work / "backbone.onnx").is_file()
    assert f"resuming from {step_2}" in logged(tmp_path / "resumed")["text"]
    assert "1 processes on cpu(1)" in logged(tmp_path / "resumed")["text"]
    assert (tmp_path / "sgd" / "checkpoints" / "step_000002").is_dir()


def test_the_check_stops_a_run_whose_centers_live_elsewhere(tmp_path, synthetic):
    """The same trainer with Partial FC on cpu(0) beside a backbone on cpu(1): on a GPU
    host, the classifier's gradient would start the backbone's backward from another
    device. The check stops it at that point."""
    config = config_file(tmp_path, synthetic, max_steps=1)
    result = run([*WORKER, "train", str(config), "--work-dir", str(tmp_path / "work")],
                 env={"CENTERS_ON_CPU0": "1"}, timeout=300)
    assert result.returncode != 0
    assert ("ContextMix: a backward pass and its head gradient mix contexts ['cpu(0)', "
            "'cpu(1)']") in result.stdout, result.stdout[-3000:]
