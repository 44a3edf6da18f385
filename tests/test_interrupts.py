"""What ends a step loop: the stop request, the watchdog, and the one decision of
what follows each step (evaluate, save, stop)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from partial_fc_mx.config import Config
from partial_fc_mx.run.checkpoint import TrainState
from partial_fc_mx.run.interrupts import StopRequest
from partial_fc_mx.train import Due, due_after


@pytest.mark.parametrize("sent", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1])
def test_a_stop_request_records_the_signal_and_gives_the_handlers_back(sent, monkeypatch):
    """One exit status whatever the signal, or the launcher's (run.sh, slurm.sbatch: 0)."""
    before = signal.getsignal(sent)
    monkeypatch.delenv("PFC_STOPPED_STATUS", raising=False)
    with StopRequest() as stop:
        os.kill(os.getpid(), sent)
        time.sleep(0.01)
        assert stop.signal == sent and stop.exit_code == 143
        monkeypatch.setenv("PFC_STOPPED_STATUS", "0")
        assert stop.exit_code == 0
        monkeypatch.setenv("PFC_STOPPED_STATUS", "yes")
        assert stop.exit_code == 143
    assert signal.getsignal(sent) is before
    with StopRequest() as again:  # a second run in the same process starts clean
        assert again.signal is None


@pytest.mark.parametrize("seconds, restarts, ends", [(1, 0, True), (3, 4, False), (0, 0, False)])
def test_the_watchdog_ends_a_process_that_stops_restarting_it(seconds, restarts, ends):
    code = ("import time\nfrom partial_fc_mx.run.interrupts import Watchdog\n"
            f"with Watchdog({seconds}) as dog:\n"
            f"    for _ in range({restarts}):\n"
            "        time.sleep(0.5); dog.restart()\n"
            f"    time.sleep({0.5 if restarts else 2.5})\n"
            "print('finished', flush=True)\n"
            "time.sleep(2.0)\n"  # after the block: no watchdog left armed
            "print('after', flush=True)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    if ends:
        assert result.returncode != 0 and "finished" not in result.stdout
        assert "Thread" in result.stderr and "most recent call first" in result.stderr
    else:
        assert result.returncode == 0 and "finished\nafter" in result.stdout, result.stderr


def config(**keys) -> Config:
    return Config(**{"num_classes": 10, "verbose": 4, "val_targets": ["lfw"], **keys})


@pytest.mark.parametrize("keys, step, images_in_epoch, done, stopping, expected", [
    ({}, 3, 24, False, False, Due(False, False, False, False)),
    ({}, 4, 24, False, False, Due(True, False, False, False)),     # every verbose steps
    ({}, 5, 0, False, False, Due(False, True, False, False)),      # an epoch just ended
    ({"save_every": 5}, 5, 24, False, False, Due(False, True, False, False)),
    ({"save_every": 5}, 6, 0, False, False, Due(False, False, False, False)),
    ({}, 7, 24, True, False, Due(True, True, False, True)),        # the end: both
    ({}, 4, 24, False, True, Due(False, True, True, False)),       # a signal: save, stop
    ({"val_targets": []}, 4, 24, True, False, Due(False, True, False, True)),
])
def test_one_decision_says_what_follows_a_step(keys, step, images_in_epoch, done, stopping,
                                               expected):
    state = TrainState(step=step, images_in_epoch=images_in_epoch)
    assert due_after(config(**keys), state, done, stopping) == expected


def test_a_failing_run_gives_back_its_log_signal_handlers_and_watchdog(tmp_path, monkeypatch):
    """Two runs in one process (a notebook, a test): the first one's failure at its
    first evaluation must not leave its log handlers, SIGTERM handler or watchdog."""
    import logging
    import types

    from partial_fc_mx import dist, train
    from partial_fc_mx.run.background_export import BackgroundExport
    from partial_fc_mx.run.heartbeat import read_beats
    from partial_fc_mx.run.training_log import TrainingLog

    log = TrainingLog(tmp_path, enabled=True, total_steps=1, global_batch=8, frequent=1)
    run = types.SimpleNamespace(log=log, state=TrainState(), work_dir=tmp_path,
                                world=dist.World(rank=0, size=1, local_rank=0, local_size=1),
                                exports=BackgroundExport(tmp_path, True, log.info))

    def fails(run):
        raise train.TrainingError("the first evaluation failed")

    monkeypatch.setattr(train, "start", lambda config, resume_from, load_from: run)
    monkeypatch.setattr(train, "evaluate", fails)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(train.TrainingError, match="the first evaluation failed"):
        train.train(config(stall_timeout=1))
    assert not logging.getLogger("partial_fc_mx.train").handlers
    assert log.metrics.closed and signal.getsignal(signal.SIGTERM) is before
    assert "heartbeat" not in [thread.name for thread in threading.enumerate()]
    assert read_beats(tmp_path)[0]["done"] is False  # it failed: no "finished" beat
    time.sleep(1.5)  # an armed watchdog would have ended this process by now
