"""Process-level helpers in dist.py, run on real processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, horovodrun_gloo, mpirun, mpirun_command, run

WORKER = [sys.executable, "tests/dist_worker.py"]
DEVICE_WORKER = [sys.executable, "tests/device_worker.py"]


@pytest.mark.parametrize("launcher, world_size", [("mpirun", 2), ("horovodrun", 3)])
def test_parameters_arrive_from_rank_zero_bit_for_bit(launcher, world_size):
    launch = mpirun if launcher == "mpirun" else horovodrun_gloo
    result = launch(world_size, WORKER, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    for rank in range(world_size):
        assert f"BROADCAST OK {rank} {world_size}" in result.stdout, result.stdout[-3000:]
        # no GPU here and none exported: Horovod's thread must not take the CPU's cores
        assert f"CYCLE TIME 5 rank {rank}" in result.stdout, result.stdout[-3000:]


@pytest.mark.parametrize("exported, gpus, expected", [
    (None, 0, "5"), (None, 2, "0.1"), ("", 0, "5"), ("2", 0, "2"), ("2", 1, "2")])
def test_cycle_time_and_response_cache_unless_exported(monkeypatch, exported, gpus, expected):
    from partial_fc_mx import dist

    environ = {} if exported is None else {"HOROVOD_CYCLE_TIME": exported,
                                           "HOROVOD_CACHE_CAPACITY": exported}
    monkeypatch.setattr(dist.os, "environ", environ)  # the test's own, not this process's
    seen = []
    monkeypatch.setattr(dist.mx.context, "num_gpus", lambda: gpus)
    monkeypatch.setattr(dist.hvd, "init", lambda: seen.append(
        (environ["HOROVOD_CYCLE_TIME"], environ["HOROVOD_CACHE_CAPACITY"])))
    for name in ("rank", "size", "local_rank", "local_size"):
        monkeypatch.setattr(dist.hvd, name, lambda: 0)
    dist.init()
    # the response cache holds every gradient of r200 (1,506) unless exported
    assert seen == [(expected, exported or "4096")]


@pytest.fixture(scope="module")
def slow_enqueue_log(tmp_path_factory) -> Path:
    shim = tmp_path_factory.mktemp("shim") / "slow_enqueue_log.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(shim),
                    str(REPO / "tests" / "slow_enqueue_log.c"), "-ldl"], check=True)
    return shim


def test_broadcast_survives_horovods_enqueue_race(slow_enqueue_log):
    """With the race forced (hvd.broadcast_parameters then crashes or hangs every time,
    8 of 8 runs), the trainer's broadcast still delivers rank 0's values."""
    command = mpirun_command(2, ["-x", "LD_PRELOAD", *WORKER])
    result = run(command, env={"LD_PRELOAD": str(slow_enqueue_log)}, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "BROADCAST OK 1 2" in result.stdout, result.stdout[-3000:]


@pytest.mark.parametrize("local_rank, gpus, expected", [
    (0, 0, "cpu(0)"), (3, 0, "cpu(0)"),
    (3, 1, "gpu(0)"),  # srun --gpus-per-task=1, GPU binding: each process's GPU is gpu(0)
    (2, 4, "gpu(2)"), (0, 8, "gpu(0)")])
def test_each_process_takes_its_own_gpu(local_rank, gpus, expected):
    from partial_fc_mx import dist

    assert str(dist.choose_device(local_rank, gpus)) == expected


def test_a_local_rank_past_the_visible_gpus_is_named(monkeypatch):
    from partial_fc_mx import dist

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(dist.DeviceError, match=r"local rank 2 has no GPU of its own: this "
                       r"process sees 2 GPUs \(CUDA_VISIBLE_DEVICES=0,1\).*at most 2 processes"):
        dist.choose_device(2, 2)


def test_two_ranks_on_one_gpu_are_named():
    from partial_fc_mx import dist

    a, b = ("h1", "0000:3b:00.0"), ("h1", "0000:5e:00.0")
    assert dist.shared_gpus([a, b, ("h2", "0000:3b:00.0"), None]) is None
    assert dist.shared_gpus([a, b, a]).startswith(
        "ranks 0, 2 on h1 share the GPU at PCI bus 0000:3b:00.0. Start one process per GPU")


def test_ranks_on_gpus_beside_ranks_on_the_cpu_are_named():
    from partial_fc_mx import dist

    assert dist.mixed_devices(["gpu", "gpu"]) is None
    assert dist.mixed_devices(["cpu", "none"]) is None  # the rank without one says so itself
    assert dist.mixed_devices(["gpu", "cpu", "gpu", "cpu"]).startswith("rank(s) 1, 3 see no GPU")


def test_the_preflight_names_a_rank_without_a_gpu_of_its_own_on_every_rank(tmp_path):
    """Three processes on a host whose processes see two GPUs: rank 2 has none of its
    own. Every rank reports (this CPU build cannot read a GPU's memory either: a
    PROBLEM line, not a traceback) and exits non-zero; nobody waits."""
    result = horovodrun_gloo(3, [*DEVICE_WORKER, "2,2,2", "check"], timeout=180)
    assert result.returncode != 0
    problems = [line for line in result.stdout.splitlines() if "PROBLEM" in line]
    assert any("rank 2 (" in line and "local rank 2 has no GPU of its own: this process "
               "sees 2 GPUs" in line for line in problems), result.stdout[-3000:]
    assert any("cannot read the free memory of gpu(1)" in line for line in problems)
    assert "<stderr>:Traceback" not in result.stdout  # (horovodrun's own follows the exit)


@pytest.mark.parametrize("gpus, message", [
    ("2,2,2", "local rank 2 has no GPU of its own"),
    ("1,0,1", "rank(s) 1 see no GPU while the others train on GPUs")])
def test_training_stops_every_rank_before_using_a_device(tmp_path, gpus, message):
    config = tmp_path / "config.py"
    config.write_text("rec = 'random'\nnum_classes = 30\nnetwork = 'tiny'\n"
                      "embedding_size = 32\nbatch_size = 2\nmax_steps = 1\n")
    result = horovodrun_gloo(3, [*DEVICE_WORKER, gpus, "train", str(config), "--work-dir",
                                 str(tmp_path / "work")], timeout=180)
    assert result.returncode != 0
    lines = [line for line in result.stdout.splitlines() if message in line]
    assert len(lines) == 1, result.stdout[-3000:]  # every rank stops; rank 0 says why
    assert not (tmp_path / "work" / "checkpoints").exists()


@pytest.mark.parametrize("command", ["check", "train"])
def test_two_processes_that_see_the_same_single_gpu_are_refused(tmp_path, fake_driver,
                                                                 command):
    """Each process sees one GPU, so each takes gpu(0): right when each has its own
    (srun --gpus-per-task=1), wrong on a one-GPU host with two processes, where both
    would take the same GPU. The driver's PCI bus ids tell the two apart."""
    config = tmp_path / "config.py"
    config.write_text("rec = 'random'\nnum_classes = 30\nnetwork = 'tiny'\n"
                      "embedding_size = 32\nbatch_size = 2\nmax_steps = 1\n")
    args = [*DEVICE_WORKER, "1,1", command, str(config), "--work-dir", str(tmp_path / "w")]
    same = horovodrun_gloo(2, args, timeout=180, env={
        "LD_LIBRARY_PATH": str(fake_driver), "FAKE_CUDA_GPUS": "NVIDIA A100-SXM4-40GB=8.0"})
    assert same.returncode != 0
    lines = [line for line in same.stdout.splitlines()
             if "ranks 0, 1 on " in line and "share the GPU at PCI bus 0000:00:00.0" in line]
    assert len(lines) == 1, same.stdout[-3000:]
    own = horovodrun_gloo(2, args, timeout=180, env={
        "LD_LIBRARY_PATH": str(fake_driver),
        "FAKE_GPUS_BY_RANK": "NVIDIA A100=8.0@0000:3b:00.0|NVIDIA A100=8.0@0000:5e:00.0"})
    assert own.returncode != 0  # a CPU build cannot go on to use gpu(0)...
    assert "share the GPU" not in own.stdout  # ...but the device choice passed
    past = {"check": "cannot read the free memory of gpu(0)",
            "train": "error: start-up failed: MXNetError"}[command]
    assert past in own.stdout, own.stdout[-3000:]
