"""backbone.onnx written by a separate process beside training (background_export.py):
what it writes, one export at a time with later saves superseding, failures as
warnings, an export ended with its run or its rank, and no rank waiting for it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import mxnet as mx
import pytest
from conftest import REPO, config_file, logged, mpirun, train_args

from partial_fc_mx.config import Config
from partial_fc_mx.run import checkpoint
from partial_fc_mx.run.background_export import BackgroundExport
from partial_fc_mx.run.export import parity
from partial_fc_mx.run.precision import build_backbone


def save_tiny_backbone(work_dir, step: int) -> None:
    net, _ = build_backbone(Config(network="tiny", embedding_size=64), mx.cpu())
    checkpoint.save_backbone(net, work_dir / "backbone", {"step": step})


@pytest.fixture
def lines() -> list[str]:
    return []


def test_an_export_writes_backbone_onnx_and_says_which_step(tmp_path, lines):
    save_tiny_backbone(tmp_path, step=7)
    with BackgroundExport(tmp_path, True, lines.append) as exports:
        exports.request(7)
        assert exports.process is not None  # started, not waited for
        exports.wait()
    assert len(lines) == 1, lines
    assert re.fullmatch(rf"wrote {tmp_path / 'backbone.onnx'} \(step 7\) in the background "
                        r"in [\d.]+ s", lines[0])
    assert parity(tmp_path) <= 1e-5
    assert not list(tmp_path.glob(".backbone.onnx*"))  # no temporary file left


def test_saves_during_an_export_make_one_more_export_of_the_newest(tmp_path, lines):
    save_tiny_backbone(tmp_path, step=1)
    with BackgroundExport(tmp_path, True, lines.append) as exports:
        exports.request(1)
        first = exports.process
        save_tiny_backbone(tmp_path, step=2)
        exports.request(2)
        save_tiny_backbone(tmp_path, step=3)
        exports.request(3)
        assert exports.process is first and exports.due  # one runs; one more is due
        exports.wait()
    # the first export read step 1, or already 3 (it reads the newest when it starts);
    # then step 3 follows, or is not exported twice. Step 2 was superseded either way
    assert 1 <= len(lines) <= 2 and all(line.startswith("wrote") for line in lines), lines
    assert "(step 3) in the background" in lines[-1] and "(step 2)" not in " ".join(lines)


def test_a_failed_export_is_a_warning(tmp_path, lines):
    with BackgroundExport(tmp_path, True, lines.append) as exports:
        exports.request(1)  # nothing saved: no backbone to export
        exports.wait()
    assert len(lines) == 1 and lines[0].startswith(
        "WARNING: could not export backbone.onnx in the background: "), lines
    assert "has no backbone-symbol.json" in lines[0]
    assert "the checkpoint is safe" in lines[0]


def test_other_ranks_start_nothing(tmp_path, lines):
    save_tiny_backbone(tmp_path, step=1)
    with BackgroundExport(tmp_path, False, lines.append) as exports:
        exports.request(1)
        assert exports.process is None
        exports.wait()
    assert lines == [] and not (tmp_path / "backbone.onnx").exists()


def test_the_last_save_is_exported_here_and_supersedes_a_running_export(tmp_path, lines):
    save_tiny_backbone(tmp_path, step=1)
    with BackgroundExport(tmp_path, True, lines.append) as exports:
        exports.request(1)
        running = exports.process
        save_tiny_backbone(tmp_path, step=2)
        exports.request(2, last=True)
        assert exports.process is None and running.returncode is not None  # ended, reaped
    assert len(lines) == 1 and re.fullmatch(
        rf"wrote {tmp_path / 'backbone.onnx'} \(step 2\) in [\d.]+ s", lines[0]), lines
    assert parity(tmp_path) <= 1e-5


def test_a_run_that_stops_ends_its_export(tmp_path, lines):
    save_tiny_backbone(tmp_path, step=1)
    with BackgroundExport(tmp_path, True, lines.append) as exports:
        exports.request(1)
        process = exports.process
    assert process.returncode is not None  # reaped
    assert len(lines) == 1 and lines[0].startswith("stopped the export of backbone.onnx")


RANK = """
import sys, time
from pathlib import Path
from partial_fc_mx.run.background_export import BackgroundExport
exports = BackgroundExport(Path(sys.argv[1]), True, print)
exports.request(1)
print("EXPORT", exports.process.pid, flush=True)
time.sleep(600)
"""


def test_an_export_ends_with_the_rank_that_started_it(tmp_path):
    """kill -9 of the rank (no cleanup runs in it): its export process goes too, before
    it writes anything (left alone it would write backbone.onnx within seconds)."""
    save_tiny_backbone(tmp_path, step=1)
    rank = subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE)
    export = int(rank.stdout.readline().split()[1])
    os.kill(rank.pid, signal.SIGKILL)
    rank.wait()
    deadline = time.time() + 30
    while time.time() < deadline and alive(export):
        time.sleep(0.2)
    assert not alive(export)
    time.sleep(1)
    assert not (tmp_path / "backbone.onnx").exists()


def alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_training_goes_on_while_rank_0_exports(tmp_path, synthetic):
    """Both ranks train steps between a save and the end of its export, and the run's
    last save is exported by rank 0 itself: backbone.onnx is the last step's."""
    config = config_file(tmp_path, synthetic, max_steps=12, save_every=3, frequent=1)
    work = tmp_path / "work"
    result = mpirun(2, train_args(config, work), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:]
    text = logged(work)["text"]
    saved = text.index(f"saved checkpoint {work / 'checkpoints' / 'step_000003'} in")
    written = text.index("backbone.onnx (step")
    assert re.search(r"Global Step: [4-9]\b", text[saved:written]), text[saved:written + 200]
    background = [int(step) for step in
                  re.findall(r"backbone\.onnx \(step (\d+)\) in the background", text)]
    assert background == sorted(set(background)) and set(background) <= {3, 6, 9}, background
    assert re.search(rf"wrote {work / 'backbone.onnx'} \(step 12\) in [\d.]+ s\n", text)
    assert "could not export" not in text
    assert parity(work) <= 1e-4
