"""Process-level helpers in dist.py, run on real processes."""

from __future__ import annotations

import sys

import pytest
from conftest import horovodrun_gloo, mpirun

WORKER = [sys.executable, "tests/dist_worker.py"]


@pytest.mark.parametrize("launcher, world_size", [("mpirun", 2), ("horovodrun", 3)])
def test_parameters_arrive_from_rank_zero_bit_for_bit(launcher, world_size):
    launch = mpirun if launcher == "mpirun" else horovodrun_gloo
    result = launch(world_size, WORKER, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    for rank in range(world_size):
        assert f"BROADCAST OK {rank} {world_size}" in result.stdout, result.stdout[-3000:]
