"""Restart on failure (setup-utils/restarts.sh, run/restarts.py) and the heartbeats that
name a frozen rank (run/heartbeat.py): the decisions on recorded evidence, then real
jobs under run.sh and a Slurm script with stub commands. The jobs that lose a host,
a rank or a link are in test_multihost.py."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    REPO,
    config_file,
    damage_header,
    finish,
    kill_group,
    output_of,
    rank_pids,
    run,
    slurm_job,
    start,
    wait_for_step,
)

from partial_fc_mx import dist
from partial_fc_mx.run import checkpoint, heartbeat, restarts
from partial_fc_mx.run.heartbeat import Heartbeat, write_json
from partial_fc_mx.run.metrics import read_metrics

KILLED = ("mpirun noticed that process rank 1 with PID 0 on node hostb exited on signal 9 "
          "(Killed).")
LOST = """ORTE has lost communication with a remote daemon.

  HNP daemon   : [[47530,0],0] on node hosta
  Remote daemon: [[47530,0],2] on node hostc

This is usually due to either a failure of the TCP network"""


def watcher(tmp_path: Path, timeout: float = 20.0) -> Heartbeat:
    """Rank 0 of 3, set up as __enter__ would, without its thread or a collective; its
    steps stopped at time 0. It looks every 3 s (its interval is 3.3 s)."""
    beat = Heartbeat(tmp_path, dist.World(rank=0, size=3, local_rank=0, local_size=1),
                     "hosta", timeout, first_step=7)
    beat.folder.mkdir(parents=True, exist_ok=True)
    (beat.folder / heartbeat.LAUNCH).write_text("this")
    beat.launch, beat.moved, beat.read = "this", 0.0, 0.0
    beat.seen = {1: (None, 0.0), 2: (None, 0.0)}
    return beat


def peer(tmp_path: Path, rank: int, beat: int, step: int = 7, launch: str = "this",
         done: bool = False) -> None:
    folder = heartbeat.beats_dir(tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    write_json(heartbeat.beat_file(folder, launch, rank),
               {"rank": rank, "host": f"host{rank}", "pid": 100 + rank, "step": step,
                "beat": beat, "launch": launch, "done": done})


def launched(tmp_path: Path, step: int, launch: str = "this") -> None:
    """A launch's rank 0 beat after `step`, as the supervisor finds it."""
    heartbeat.beats_dir(tmp_path).mkdir(parents=True, exist_ok=True)
    (heartbeat.beats_dir(tmp_path) / heartbeat.LAUNCH).write_text(launch)
    peer(tmp_path, 0, beat=1, step=step, launch=launch)


def looks(beat: Heartbeat, until: float, every: float = 3.0, before=None) -> list:
    """What the watcher says at each look from its next one to `until`; `before(now)`
    runs before each look (a peer beating)."""
    said, now = [], beat.read + every
    while now <= until:
        if before:
            before(now)
        said.append(beat.stalled_peers(now))
        now += every
    return said


def test_a_peer_that_stops_beating_is_named_once_this_rank_has_waited(tmp_path):
    beat = watcher(tmp_path)
    peer(tmp_path, 2, beat=1)
    said = looks(beat, until=30.0, before=lambda now: peer(tmp_path, 1, beat=int(now)))
    # moving until 6.6 s; rank 2 first seen at 9 s, unchanged for 20 s after: at 30 s
    assert said[:-1] == [None] * 9
    assert said[-1] == ("rank 2 (host2, pid 102) stopped beating after step 7: no heartbeat "
                        "for 21 s while rank 0 (hosta) waited for it (heartbeat_timeout=20)")


def test_nothing_is_read_or_named_while_this_ranks_steps_move(tmp_path):
    beat = watcher(tmp_path)
    peer(tmp_path, 1, beat=1)
    peer(tmp_path, 2, beat=1)
    beat.moved, beat.read = 95.0, 95.0  # a step 5 s ago: every peer took part in it
    assert beat.stalled_peers(now=100.0) is None
    assert beat.seen == {1: (None, 100.0), 2: (None, 100.0)}


def test_a_gap_in_this_ranks_own_looks_times_every_peer_afresh(tmp_path):
    """A file system that hung every rank's beats for minutes (an NFS failover): the
    first rank back must not take a silent peer for a frozen one."""
    beat = watcher(tmp_path)
    peer(tmp_path, 1, beat=1)
    peer(tmp_path, 2, beat=1)
    assert looks(beat, until=12.0) == [None] * 4
    beat.read = 12.0
    assert beat.stalled_peers(now=150.0) is None  # its own looks stopped for 138 s
    assert beat.seen == {1: (None, 150.0), 2: (None, 150.0)}


def test_a_finished_peer_and_an_earlier_launchs_file_are_not_a_frozen_rank(tmp_path):
    beat = watcher(tmp_path)
    peer(tmp_path, 1, beat=5, done=True)  # rank 1 left: rank 0's last evaluation goes on
    peer(tmp_path, 2, beat=9, launch="earlier")  # an orphan; never beat in this launch
    said = looks(beat, until=27.0)  # timed from the last look while moving, at 6 s
    assert said[:-1] == [None] * 8
    assert said[-1] == ("rank 2 never beat: no heartbeat for 21 s while rank 0 (hosta) "
                        "waited for it (heartbeat_timeout=20)")


def test_the_last_common_step_is_the_latest_launchs(tmp_path):
    launched(tmp_path, 12)
    peer(tmp_path, 1, beat=1, step=11)
    peer(tmp_path, 2, beat=1, step=3, launch="earlier")  # left behind a cut link
    assert restarts.last_common_step(tmp_path) == 11
    (tmp_path / "checkpoints" / "step_000013").mkdir(parents=True)  # beats lag a save
    assert restarts.last_common_step(tmp_path) == 13


def test_the_failure_is_told_from_the_most_specific_evidence(tmp_path):
    launched(tmp_path, 12)
    assert restarts.failure_of(tmp_path, 1, f"error: horovod shut down\n{LOST}") == \
        restarts.Failure("lost host", "hostc", "the launcher lost its link to host hostc", 12)
    assert restarts.failure_of(tmp_path, 137, f"error: horovod shut down\n{KILLED}") == \
        restarts.Failure("signal", "rank 1", "rank 1 on hostb was ended by signal 9 (Killed)",
                         12)
    assert restarts.failure_of(tmp_path, 1, LOST.replace("ORTE", "PRTE")).kind == "lost host"
    srun = ("srun: error: nodeb: task 9: Exited with exit code 1\n"
            "srun: error: nodea: tasks 0-7: Killed\nerror: record 3 is damaged\n")
    assert restarts.failure_of(tmp_path, 1, srun).kind == "error"  # not the tasks srun ended
    assert restarts.failure_of(tmp_path, 137, "srun: error: nodeb: task 9: Killed\n"
                               "srun: error: nodea: tasks 0-7: Killed\n").reason == \
        "task 9 on nodeb was killed"
    assert restarts.failure_of(tmp_path, 1, "Timeout (0:30:00)!\nThread 0x1").kind == "watchdog"
    assert restarts.failure_of(tmp_path, 1, "x\nerror: record 3 is damaged\n").who == \
        "record 3 is damaged"
    assert restarts.failure_of(tmp_path, 7, "").reason == "the job exited with status 7"
    inspector = ("[2026-11-26 05:04:40.1] One or more tensors were submitted to be reduced, "
                 "gathered or broadcasted by subset of ranks and are waiting for remainder of "
                 "ranks for more than 60 seconds. This may indicate ... deadlock. \n"
                 "Missing ranks:\n1: [allreduce.pfc.max, allreduce.pfc.sum]\n")
    assert restarts.failure_of(tmp_path, 1, f"{inspector}Timeout (0:30:00)!\n").reason == (
        "a rank made no progress for stall_timeout seconds (the watchdog printed every "
        "thread's stack above) (Horovod's stall inspector: rank 1 had not submitted "
        "allreduce.pfc.max, allreduce.pfc.sum)")
    stall = {"reason": "rank 2 (hostc, pid 9) stopped beating after step 12: ...", "step": 12}
    write_json(heartbeat.beats_dir(tmp_path) / heartbeat.STALL, {**stall, "launch": "earlier"})
    assert restarts.failure_of(tmp_path, 75, KILLED).kind == "signal"  # an earlier launch's
    write_json(heartbeat.beats_dir(tmp_path) / heartbeat.STALL, {**stall, "launch": "this"})
    assert restarts.failure_of(tmp_path, 75, KILLED).kind == "stall"
    assert restarts.failure_of(tmp_path, 75, KILLED).who == "rank 2"


def test_the_same_failure_after_the_same_step_twice_is_refused(tmp_path):
    launched(tmp_path, 12)
    relaunch, refusal = restarts.restart(tmp_path, 137, KILLED, ["a", "b"], 2, ["c"], 1, "j1",
                                         48)
    # no checkpoint yet: start again, at the first launch's global batch
    assert (relaunch, refusal) == (["reference_batch=48"], None)
    assert not list(heartbeat.beats_dir(tmp_path).iterdir())  # read: the next launch's own
    (tmp_path / "checkpoints" / "step_000010").mkdir(parents=True)
    launched(tmp_path, 12, "second")
    relaunch, refusal = restarts.restart(tmp_path, 1, "error: other\n", ["a", "b"], 2, [], 2,
                                         "j1", 48)
    assert (relaunch, refusal) == (["--resume-from", str(tmp_path)], None)
    launched(tmp_path, 12, "third")
    relaunch, refusal = restarts.restart(tmp_path, 1, "error: other\n", ["a", "b"], 2, [], 3,
                                         "j1", 48)
    assert relaunch == [] and refusal.startswith(
        "not restarting: the job failed again after step 12 for the same reason (error: "
        "other)")
    text = (tmp_path / "training.log").read_text()
    assert "restart 1: rank 1 on hostb was ended by signal 9 (Killed) after step 12; " \
        "relaunching 2 processes on a, b, without c, from the start: no checkpoint yet" in text
    assert "restart 2: error: other after step 12; relaunching 2 processes on a, b, from " \
        "checkpoint step 10" in text
    assert text.splitlines()[-1].endswith(refusal)
    assert [(r["attempt"], r["failure"]) for r in read_metrics(tmp_path)["restarts"]] == [
        (1, "signal"), (2, "error")]


def test_the_same_failure_is_refused_without_a_new_checkpoint_but_not_after_one(tmp_path):
    """Steps are written down about once a second: with fast steps the same failure may
    be seen a step or two apart; a checkpoint saved in between is progress."""
    (tmp_path / "checkpoints" / "step_000010").mkdir(parents=True)
    launched(tmp_path, 12)
    resume = ["--resume-from", str(tmp_path)]
    assert restarts.restart(tmp_path, 137, KILLED, ["a"], 2, [], 1, "j", 48) == (resume, None)
    launched(tmp_path, 14, "second")
    (tmp_path / "checkpoints" / "step_000013").mkdir()
    assert restarts.restart(tmp_path, 137, KILLED, ["a"], 2, [], 2, "j", 48) == (resume, None)
    launched(tmp_path, 15, "third")  # the same rank killed again, no checkpoint since 13
    relaunch, refusal = restarts.restart(tmp_path, 137, KILLED, ["a"], 2, [], 3, "j", 48)
    assert relaunch == [] and "failed again after step 15 for the same reason" in refusal


def test_another_jobs_failure_in_the_same_work_dir_is_not_this_ones(tmp_path):
    """An earlier job in the default work_dirs/<config> failed before its first save;
    a new job's first failure, the same before any checkpoint, is a restart, not a
    refusal."""
    launched(tmp_path, 0)
    assert restarts.restart(tmp_path, 137, KILLED, ["a"], 2, [], 1, "old", 48)[1] is None
    launched(tmp_path, 0, "new")
    assert restarts.restart(tmp_path, 137, KILLED, ["a"], 2, [], 1, "new", 48) == (
        ["reference_batch=48"], None)
    launched(tmp_path, 0, "again")
    assert restarts.restart(tmp_path, 137, KILLED, ["a"], 2, [], 2, "new", 48)[1].startswith(
        "not restarting: the job failed again")


# STOP_GRACE: mpirun ends the ranks left after a failure 2 x STOP_GRACE seconds later
# (docs/launching.md); these jobs fail on purpose and stop by no signal to mpirun
RESTARTING = {"MAX_RESTARTS": "2", "RESTART_BACKOFF": "0", "NP": "2", "STOP_GRACE": "2"}


def run_sh(config: Path, work: Path, env: dict | None = None):
    """`bash run.sh` on 2 local processes, restarting up to twice, as users launch it."""
    return start(["bash", str(REPO / "run.sh"), "--work-dir", str(work)],
                 env={**RESTARTING, "CONFIG": str(config), **(env or {})})


def test_the_same_failure_after_the_same_step_twice_stops_with_its_reason(tmp_path, synthetic):
    """A damaged record fails the job at the same step on every launch: one restart
    (it might have been a host), then the supervisor stops and says why. Which step
    each launch reached is known to a heartbeat (Failure.same_as): the refusal names
    its own launch's, and no checkpoint came between the two."""
    data = tmp_path / "data"
    shutil.copytree(synthetic, data)
    damage_header(data, 300)
    config = config_file(tmp_path, data, num_epoch=1, save_every=2, val_targets=[])
    work = tmp_path / "work"
    result = finish(run_sh(config, work), timeout=400)
    assert result.returncode == 1, result.stdout[-3000:]
    text = (work / "training.log").read_text()
    damaged = f"{data / 'train.rec'}: record 300 has a damaged header"
    restarted = re.findall(r"restart 1: error: (.*) after step (\d+); relaunching 2 processes "
                           r"on localhost, from (.*)", text)
    assert len(restarted) == 1 and damaged in restarted[0][0], text[-3000:]
    assert re.search(rf"not restarting: the job failed again after step \d+ for the same "
                     rf"reason \(error: .*{re.escape(damaged)}", text), text[-3000:]
    assert "restart 2" not in text


@pytest.mark.parametrize("signalled", ["a rank", "run.sh's shell"])
def test_a_job_stopped_with_sigterm_is_not_restarted(tmp_path, synthetic, signalled):
    """A scheduler's SIGTERM to a rank, or a person's to run.sh: every rank saves and
    stops; the supervisor says so once, exits 143 and leaves it stopped, though restarts
    are allowed."""
    config = config_file(tmp_path, synthetic, num_epoch=1000, val_targets=[])
    work = tmp_path / "work"
    job = run_sh(config, work)
    try:
        wait_for_step(job, work, 3)
        os.kill(rank_pids(f"partial_fc_mx train {config}")[-1] if signalled == "a rank"
                else job.pid, signal.SIGTERM)
        result = finish(job, timeout=120)
    finally:
        kill_group(job)
    assert result.returncode == 143, result.stdout[-3000:]
    stops = read_metrics(work)["stops"]
    assert len(stops) == 1 and re.findall(r"^stopped on purpose.*$", result.stdout, re.M) == [
        f"stopped on purpose: every rank saved at step {stops[0]['step']}; not restarting "
        "(exit status 143)"], result.stdout[-3000:]
    assert "restart 1" not in (work / "training.log").read_text()
    assert not read_metrics(work)["restarts"]


def test_the_slurm_script_relaunches_on_the_nodes_that_answer(tmp_path, synthetic):
    """sbatch with MAX_RESTARTS=1 on 2 nodes x 8 tasks: a task killed on node B, whose
    probe then fails; the job is relaunched on node A's 8 tasks after its preflight.
    The supervisor's copy of the job's output (mktemp) is gone when it returns."""
    config = config_file(tmp_path, synthetic, val_targets=[])
    work, temporary = tmp_path / "work", tmp_path / "tmp"
    temporary.mkdir()
    env = {**slurm_job(tmp_path), "PFC_REPO": str(REPO), "CONFIG": str(config),
           "MAX_RESTARTS": "1", "RESTART_BACKOFF": "0", "SRUN_DEAD": "nodeb",
           "SRUN_FAILURES": "1", "TMPDIR": str(temporary)}
    done = run(["bash", str(REPO / "setup-utils" / "slurm.sbatch"), "--work-dir", str(work)],
               env=env, timeout=120)
    assert done.returncode == 0, done.stdout
    calls = [line.replace(f"CONFIG={config} ", "")
             for line in (tmp_path / "srun.log").read_text().splitlines()]
    launch = "srun --mpi=pmix --kill-on-bad-exit=1"
    config_sh = f"bash {REPO}/config.sh --work-dir {work}"
    assert calls == [
        f"{launch} -N 2 -n 16 -w nodea,nodeb {config_sh} PFC_COMMAND=check",
        f"{launch} -N 2 -n 16 -w nodea,nodeb {config_sh} PFC_COMMAND=",
        "srun --overlap -N 1 -n 1 -w nodea true PFC_COMMAND=",
        "srun --overlap -N 1 -n 1 -w nodeb true PFC_COMMAND=",
        # no checkpoint yet: started again with the first launch's global batch, 16 x 24
        f"{launch} -N 1 -n 8 -w nodea {config_sh} reference_batch=384 PFC_COMMAND=check",
        f"{launch} -N 1 -n 8 -w nodea {config_sh} reference_batch=384 PFC_COMMAND="]
    assert "host nodeb did not answer within 30 s: dropped" in done.stdout
    assert "restart 1: task 9 on nodeb was killed; relaunching 8 processes on nodea, " \
        "without nodeb, from the start: no checkpoint yet" in (work / "training.log").read_text()
    assert not list(temporary.glob("tmp.*")), list(temporary.iterdir())


@pytest.mark.parametrize("ending", ["signalled in the backoff", "signalled in the preflight",
                                    "restart refused"])
def test_the_supervisor_returns_the_jobs_status_and_leaves_nothing(tmp_path, ending):
    """restarts.sh alone, with stub commands: a job that fails (status 3), then either
    scancel or Ctrl-C reaching the whole process group while the supervisor waits to
    relaunch, a SIGTERM to its shell during the relaunch's preflight, or `restart`
    refusing. Each time it stops with the job's status (not the signalled sleep's 143),
    relaunches nothing and leaves no copy of the job's output."""
    temporary, launches, asked = tmp_path / "tmp", tmp_path / "launches", tmp_path / "asked"
    temporary.mkdir()
    restart = tmp_path / "python"
    restart.write_text(f"#!/bin/sh\ntouch {asked}\nexit {int(ending == 'restart refused')}\n")
    restart.chmod(0o755)
    backoff = "0" if ending == "signalled in the preflight" else "60"
    script = f"""set -euo pipefail
source {REPO / 'setup-utils' / 'restarts.sh'}
launch_training() {{
  echo "launch ${{PFC_COMMAND:-}}" >> {launches}
  if [ "${{PFC_COMMAND:-}}" = check ]; then sleep 3; return 0; fi
  return 3
}}
probe_host() {{ true; }}
python={restart}; HOSTS=(localhost); SLOTS=(2); NP=2; CONFIG=configs/orl.py
train_with_restarts"""
    job = start(["bash", "-c", script], env={"MAX_RESTARTS": "1", "RESTART_BACKOFF": backoff,
                                             "TMPDIR": str(temporary)})
    try:
        deadline = time.time() + 30
        if ending == "signalled in the backoff":
            while not subprocess.run(["pgrep", "-s", str(job.pid), "-x", "sleep"],
                                     capture_output=True).stdout and time.time() < deadline:
                time.sleep(0.1)
            os.killpg(job.pid, signal.SIGTERM)
        elif ending == "signalled in the preflight":
            while "check" not in (launches.read_text() if launches.is_file() else ""):
                assert time.time() < deadline
                time.sleep(0.1)
            os.kill(job.pid, signal.SIGTERM)  # the shell alone: the preflight goes on
        result = finish(job, timeout=30)
    finally:
        kill_group(job)
    assert result.returncode == 3, result.stdout
    expected = "launch \nlaunch check\n" if ending == "signalled in the preflight" else "launch \n"
    assert asked.is_file() and launches.read_text() == expected, result.stdout
    assert not list(temporary.glob("tmp.*")), list(temporary.iterdir())


def test_a_stop_is_a_stop_when_its_line_cannot_be_written(tmp_path):
    """A terminal that went away (a hang-up) makes every line to it fail: under set -e
    the supervisor must still exit 143 for a stopped job, not the ranks' 0 (which would
    read as a finished run) nor end before it has handed the stop on."""
    script = f"""set -euo pipefail
source {REPO / 'setup-utils' / 'restarts.sh'}
launch_training() {{ echo "12:00 stopped by a signal at step 5; resume with ..."; }}
probe_host() {{ true; }}
python=false; HOSTS=(localhost); SLOTS=(2); NP=2; CONFIG=configs/orl.py
train_with_restarts 2>&-"""
    done = run(["bash", "-c", script], env={"MAX_RESTARTS": "2", "TMPDIR": str(tmp_path)})
    assert done.returncode == 143, done.stdout


def test_a_max_restarts_that_is_no_number_is_refused_before_anything_runs():
    said = run(["bash", "-c", f"source {REPO}/setup-utils/restarts.sh; echo sourced"],
               env={**os.environ, "MAX_RESTARTS": "yes"})
    assert said.returncode == 2 and "sourced" not in said.stdout
    assert "MAX_RESTARTS=yes must be a whole number" in said.stdout


def test_a_killed_rank_of_a_configs_network_is_relaunched_from_its_checkpoint(tmp_path):
    """configs/ms1mv3_r50.py at a reduced size (an IResNet-50, bfloat16 where the CPU
    computes it): a rank killed after the first checkpoint; the job is relaunched from
    it and finishes the run."""
    config = REPO / "configs" / "ms1mv3_r50.py"
    work = tmp_path / "work"
    job = start(["bash", str(REPO / "run.sh"), "--work-dir", str(work), "rec=random",
                 "num_classes=64", "num_image=512", "batch_size=2", "max_steps=4",
                 "save_every=2", "val_targets=[]", "frequent=1"],
                env={**RESTARTING, "CONFIG": str(config)})
    try:
        deadline = time.time() + 300
        while not (work / "checkpoints" / "step_000002" / "meta.json").is_file():
            assert job.poll() is None and time.time() < deadline, output_of(job)[-3000:]
            time.sleep(0.5)
        ranks = rank_pids(f"partial_fc_mx train {config}")  # 2 steps, a save and an
        assert len(ranks) == 2, output_of(job)[-3000:]  # export are still to come
        os.kill(ranks[-1], signal.SIGKILL)
        result = finish(job, timeout=400)
    finally:
        kill_group(job)
    assert result.returncode == 0, result.stdout[-3000:]
    text = (work / "training.log").read_text()
    assert re.search(r"restart 1: rank 1 on \S+ was ended by signal 9 \(Killed\) after step "
                     r"\d+; relaunching 2 processes on localhost, from checkpoint step [24]",
                     text), text[-3000:]
    assert "restart 2" not in text
    saved = checkpoint.checkpoints(work)
    assert checkpoint.step_of(saved[-1]) == 4 and checkpoint.verify(saved[-1]) == []
    assert read_metrics(work)["step"][-1] == 4
