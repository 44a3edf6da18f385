"""`plan`: the preflight's memory estimate, the trainer's refusals, the collectives of a
step, and the fewest GPUs a run fits on."""

import json
import re
import sys
from pathlib import Path

import pytest
from conftest import config_file, horovodrun_gloo, run

from partial_fc_mx.config import Config, ConfigError, load_config
from partial_fc_mx.sizing.memory import IMAGE_BYTES, GiB, estimate_run_memory
from partial_fc_mx.sizing.pfc_memory import LOGIT_MATRICES
from partial_fc_mx.sizing.plan import format_plan, make_plan


def config(**changes) -> Config:
    values = dict(network="tiny", num_classes=2_000_000, embedding_size=128,
                  sample_rate=0.1, batch_size=16)
    return Config(**{**values, **changes})


@pytest.mark.parametrize("changes, device, dtype", [
    ({}, "gpu", "float32"),
    ({"fp16": True, "fp16_centers": True, "center_optimizer": "adamw"}, "gpu", "float16"),
    # a CPU host's precision depends on its CPU: planned in float32, the larger
    ({"fp16": True, "optimizer": "adamw"}, "cpu", "float32"),
    ({"fp16": True, "cpu_precision": "bfloat16"}, "cpu", "bfloat16"),  # forced
    ({"recompute_activations": True, "network": "vit_t"}, "cpu", "float32"),
])
def test_the_plan_counts_the_memory_the_preflight_estimates(changes, device, dtype):
    run_config = config(**changes)
    room = {"gpu_memory": 80.0} if device == "gpu" else {"host_memory": 24.0}
    plan = make_plan(run_config, 3, **room)
    assert plan.memory == estimate_run_memory(run_config, 3, 0, dtype, device)
    assert sum(plan.parts().values()) == plan.memory.total
    assert all(size >= 0 for size in plan.parts().values()), plan.parts()
    # 2,000,000 / 3 -> rank 0 holds 666,667 rows of 128 columns
    row_bytes = 2 if changes.get("fp16_centers") else 4
    assert plan.parts()["class centers"] == 666_667 * 128 * row_bytes
    assert plan.available == (80 * GiB if device == "gpu" else 24 * GiB // 3)
    recomputed = "backbone activations, recomputed" in plan.parts()
    assert recomputed == bool(changes.get("recompute_activations"))


def test_the_fewest_gpus_fit_and_one_fewer_does_not():
    run_config = config()
    one = make_plan(run_config, 1, gpu_memory=0.6)
    assert not one.fits  # 2M x 128 float32 centers and momentum are 1.9 GiB
    plan = make_plan(run_config, None, gpu_memory=0.6)
    k = plan.smallest
    assert k is not None and k > 2
    assert plan.world_size == k and plan.fits
    assert make_plan(run_config, k, gpu_memory=0.6).fits
    assert not make_plan(run_config, k - 1, gpu_memory=0.6).fits
    assert make_plan(run_config, k - 1, gpu_memory=0.6).smallest == k


def test_processes_sharing_a_host_each_get_their_share():
    """Four processes on one host split its memory: the host needs four ranks' worth."""
    need = make_plan(config(), 4, host_memory=1000.0).memory.total  # a CPU's estimate
    assert make_plan(config(), 4, host_memory=1.01 * 4 * need / GiB).fits
    short = make_plan(config(), 4, host_memory=0.99 * 4 * need / GiB)
    assert short.available < need and not short.fits


def in_call_order(collectives: list) -> list:
    """The plan's collectives as a step calls them: a run of those called once per
    micro-batch repeats as a whole, micro-batch after micro-batch."""
    order, start = [], 0
    while start < len(collectives):
        end = start
        while end < len(collectives) and collectives[end].calls == collectives[start].calls:
            end += 1
        order += collectives[start:end] * collectives[start].calls
        start = end
    return order


@pytest.mark.parametrize("accumulation, threshold", [(1, 0.0), (2, 0.4)])
def test_the_plan_lists_the_collectives_a_real_step_calls(tmp_path, synthetic, accumulation,
                                                          threshold):
    """plan's collectives against those two ranks call in a real training step, recorded
    by tests/collectives_worker.py around Horovod's own functions: a collective added to
    the step, dropped from it or changed in size fails here; with gradient accumulation,
    the accumulated batch's labels once and each micro-batch's own; with the inter-class
    filter, each row's counts beside its sums."""
    config = config_file(tmp_path, synthetic, max_steps=3, gradient_accumulation=accumulation,
                         interclass_filtering_threshold=threshold)
    recorded = tmp_path / "recorded"
    result = horovodrun_gloo(2, [sys.executable, "tests/collectives_worker.py", str(recorded),
                                 "train", str(config), "--work-dir", str(tmp_path / "work")],
                             timeout=600)
    assert result.returncode == 0, result.stdout[-3000:]
    ranks = [json.loads(Path(f"{recorded}.rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0]["steps"] == 3 and ranks[0]["calls"] == ranks[1]["calls"]
    calls = ranks[0]["calls"]
    plan = make_plan(load_config(config), 2, host_memory=24.0)
    planned_calls = in_call_order(plan.collectives)
    assert [(c.op, c.payload) for c in planned_calls] == [
        (call["op"], call["bytes"]) for call in calls], calls
    for planned, call in zip(planned_calls, calls):  # "48 x 64 float32"
        if not call.get("gradients"):
            [shape], [dtype] = call["shapes"], call["dtypes"]
            assert planned.shape == f"{' x '.join(map(str, shape))} {dtype}", (planned, call)
    # the trainer's allreduce of the backbone's gradients is the one the plan sizes so
    [gradients] = [c.payload for c in plan.collectives if c.name == "backbone gradients"]
    assert gradients == plan.memory.backbone.gradients == 4 * plan.parameters > 0
    assert [call.get("gradients", False) for call in calls].count(True) == 1


def test_the_step_flops_of_a_small_run():
    plan = make_plan(config(batch_size=4, embedding_size=8), 2, gpu_memory=80.0)
    n = 8  # the global batch
    assert {c.name: c.sent(2) for c in plan.collectives}["embeddings"] == n * 8 * 4 // 2
    assert {c.name: c.sent(2) for c in plan.collectives}["stop flag"] == 8
    # 2,000,000 / 2 rows, 10% sampled; 3 GEMMs of 2 x N x n x D
    assert plan.sampled == 100_000
    assert plan.gemm_flops == 3 * 2 * n * 100_000 * 8
    assert plan.backbone_flops == 3 * 2 * 4 * plan.backbone_macs > 0


def test_accumulation_counts_its_copies_its_sample_and_each_micro_batchs_work():
    """gradient_accumulation = 5: the summed gradients (one more copy) and the other
    four micro-batches' images; one sample for the positives of all five (5 x 8 x 2 =
    80 rows, past the rate's 50 of a rank's 500 classes) and five micro-batches'
    FLOPs; the memory the preflight estimates."""
    small = dict(num_classes=1000, sample_rate=0.1, batch_size=8)
    one = make_plan(config(**small), 2, gpu_memory=80.0)
    five = make_plan(config(**small, gradient_accumulation=5), 2, gpu_memory=80.0)
    assert "backbone accumulation" not in one.parts()
    assert five.parts()["backbone accumulation"] == 4 * five.parameters + 4 * 8 * IMAGE_BYTES
    assert five.memory == estimate_run_memory(five.config, 2, 0, "float32", "gpu")
    assert sum(five.parts().values()) == five.memory.total
    assert (one.sampled, five.sampled) == (50, 80)
    assert five.memory.partial_fc.logits == LOGIT_MATRICES * 80 * 16 * 4  # one micro-batch's
    assert five.gemm_flops == 5 * 3 * 2 * 16 * 80 * 128 == 8 * one.gemm_flops
    assert five.backbone_flops == 5 * one.backbone_flops
    assert "5 micro-batches per optimizer step (its sample drawn from all 80 images)" in \
        format_plan(five)


def test_the_trainers_refusal_is_a_problem_whatever_the_memory():
    """The N x n logits of one array past 2^31 elements: no world size helps."""
    plan = make_plan(config(network="tiny", num_classes=20_000_000, sample_rate=1.0,
                            batch_size=256), 8, gpu_memory=10_000.0)
    assert not plan.fits
    assert any("logits" in problem for problem in plan.problems), plan.problems
    assert plan.smallest is None
    assert "PROBLEM: " in format_plan(plan)


@pytest.mark.parametrize("changes, room, world_size, expected", [
    ({"num_classes": -5}, {"gpu_memory": 80.0}, 8, "num_classes must be > 0"),
    ({}, {"gpu_memory": 80.0}, 0, "must be >= 1 (got 0)"),
    ({}, {"gpu_memory": 0.0}, 8, "memory must be > 0"),
    ({}, {"gpu_memory": 80.0, "host_memory": 24.0}, 8, "one of the two"),
    ({}, {}, 8, "one of the two"),
])
def test_unreasonable_inputs_are_refused_with_the_reason(changes, room, world_size, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        make_plan(config(**changes), world_size, **room)


def test_the_plan_command_prints_the_plan_and_says_whether_it_fits():
    fits = run([sys.executable, "-m", "partial_fc_mx", "plan", "--network", "tiny",
                "--classes", "2000000", "--embedding-size", "128", "--batch-size", "16",
                "--sample-rate", "0.1", "--gpus", "2", "--gpu-memory", "80"], timeout=120)
    assert fits.returncode == 0, fits.stdout[-3000:]
    assert "on 2 GPU(s): it fits; the fewest GPU(s) it fits on: 1" in fits.stdout
    assert "allreduce backbone gradients" in fits.stdout
    refused = run([sys.executable, "-m", "partial_fc_mx", "plan", "--network", "tiny",
                   "--classes", "-3", "--gpu-memory", "80"], timeout=120)
    assert refused.returncode == 2
    assert "error: invalid config: num_classes must be > 0 (got -3)" in refused.stdout
    zero = run([sys.executable, "-m", "partial_fc_mx", "plan", "--gpus", "0",
                "--gpu-memory", "80", "--classes", "1000"], timeout=120)
    assert zero.returncode == 2 and "must be >= 1 (got 0)" in zero.stdout, zero.stdout
