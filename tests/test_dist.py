"""Process-level helpers in dist.py, run on real processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, horovodrun_gloo, mpirun, mpirun_command, run

WORKER = [sys.executable, "tests/dist_worker.py"]


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
def test_cycle_time_follows_the_device_unless_exported(monkeypatch, exported, gpus, expected):
    from partial_fc_mx import dist

    environ = {} if exported is None else {"HOROVOD_CYCLE_TIME": exported}
    monkeypatch.setattr(dist.os, "environ", environ)  # the test's own, not this process's
    seen = []
    monkeypatch.setattr(dist.mx.context, "num_gpus", lambda: gpus)
    monkeypatch.setattr(dist.hvd, "init", lambda: seen.append(environ["HOROVOD_CYCLE_TIME"]))
    for name in ("rank", "size", "local_rank", "local_size"):
        monkeypatch.setattr(dist.hvd, name, lambda: 0)
    dist.init()
    assert seen == [expected]


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
