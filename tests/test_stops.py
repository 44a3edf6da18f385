"""A stop on purpose saves on every launcher users start (docs/launching.md, "Stopping a
job"): SIGTERM to mpirun, a terminal's Ctrl-C to run.sh's foreground process group,
Slurm's scancel through setup-utils/slurm.sbatch, horovodrun signalled as documented.
The ranks train configs/ms1mv3_r50.py at a reduced size: an IResNet-50, whose save takes
several seconds here (Open MPI's own 1 s before SIGKILL is not enough; the tiny
network's 0.3 s save would hide that). Every rank's checkpoint at the stop step must
exist and verify, and with MAX_RESTARTS=2 nothing is relaunched."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    BIN,
    REPO,
    finish,
    kill_group,
    rank_pids,
    slurm_job,
    start,
    wait_for_step,
)

from partial_fc_mx.run import checkpoint
from partial_fc_mx.run.metrics import read_metrics

CONFIG = REPO / "configs" / "ms1mv3_r50.py"
REDUCED = ["rec=random", "num_classes=64", "num_image=512", "batch_size=2", "max_steps=1000",
           "save_every=1000", "val_targets=[]", "frequent=1"]
"""A run that saves only when it is stopped: the checkpoint found is the stop's."""
SUPERVISED = {"CONFIG": str(CONFIG), "MAX_RESTARTS": "2", "RESTART_BACKOFF": "0", "NP": "2",
              "STOP_GRACE": "20"}
SRUN_WITH_TASKS = """#!/bin/sh
# srun as the Slurm stop test sees it: a probe (`... true`) answers; a launch runs its -n
# tasks on this host under mpirun; as srun with Slurm's default KillWait (30 s: Open
# MPI's kill delay twice) it ends its tasks 30 s after a SIGTERM, and hands SIGUSR1 to
# every task.
echo "srun $*" >> "$SRUN_LOG"
[ "$(eval echo \\${$#})" = true ] && exit 0
while [ "$1" != bash ]; do [ "$1" = -n ] && tasks=$2; shift; done
exec mpirun --allow-run-as-root --oversubscribe --mca odls_base_sigkill_timeout 15 \\
  -np "$tasks" "$@"
"""


def ranks() -> list[int]:
    return rank_pids(f"partial_fc_mx train {CONFIG}")


def saved_at_stop(result, work: Path) -> int:
    """The step the job stopped at, checking that every rank saved it, whole."""
    saved = checkpoint.checkpoints(work)
    assert len(saved) == 1, f"saved {saved}; output:\n{result.stdout[-4000:]}"
    assert checkpoint.verify(saved[0]) == []
    for rank in (0, 1):
        assert (saved[0] / checkpoint.center_file(rank, "weight")).is_file()
    step = checkpoint.step_of(saved[0])
    assert [stop["step"] for stop in read_metrics(work)["stops"]] == [step]
    assert not ranks(), "a rank outlived its launcher"
    return step


def stop(job, work: Path, how) -> subprocess.CompletedProcess:
    try:
        wait_for_step(job, work, 2, timeout=300)
        how(job)
        return finish(job, timeout=240)
    finally:
        kill_group(job)


def the_mpirun(*where: str) -> int:
    """The one mpirun that pgrep finds `where` (-s SESSION, -P PARENT)."""
    found = subprocess.run(["pgrep", "-x", *where, "mpirun"], capture_output=True,
                           text=True).stdout.split()
    assert len(found) == 1, found
    return int(found[0])


def sigterm_to_mpirun(job) -> None:
    os.kill(the_mpirun("-s", str(os.getsid(ranks()[0]))), signal.SIGTERM)


def ctrl_c(job) -> None:
    """What a terminal sends: SIGINT to the foreground process group, run.sh's."""
    os.killpg(job.pid, signal.SIGINT)


def hang_up(job) -> None:
    """The terminal closed (or an SSH session ended): SIGHUP to the whole group, which
    ends every process there that does not catch it (the shell that runs the launcher
    did, before it ignored it, and the stop never reached mpirun)."""
    os.killpg(job.pid, signal.SIGHUP)


@pytest.mark.parametrize("how", [sigterm_to_mpirun, ctrl_c, hang_up])
def test_a_stop_through_run_sh_saves_on_every_rank_and_is_not_relaunched(tmp_path, how):
    work = tmp_path / "work"
    job = start(["bash", str(REPO / "run.sh"), "--work-dir", str(work), *REDUCED],
                env=SUPERVISED)
    result = stop(job, work, how)
    step = saved_at_stop(result, work)
    assert result.returncode == 143, result.stdout[-4000:]
    said = re.findall(r"^stopped on purpose.*$", result.stdout, re.MULTILINE)
    assert said == [f"stopped on purpose: every rank saved at step {step}; not restarting "
                    "(exit status 143)"], result.stdout[-4000:]
    assert "restart 1" not in (work / "training.log").read_text()
    assert not read_metrics(work)["restarts"]


def test_scancel_through_the_slurm_script_saves_on_every_rank(tmp_path):
    """scancel signals every process of the job: the batch script, srun and each task."""
    env = {**slurm_job(tmp_path, nodes=("nodea",), per_node=2), **SUPERVISED,
           "PFC_REPO": str(REPO)}
    (tmp_path / "bin" / "srun").write_text(SRUN_WITH_TASKS)
    work = tmp_path / "work"
    job = start(["bash", str(REPO / "setup-utils" / "slurm.sbatch"), "--work-dir", str(work),
                 *REDUCED], env=env)

    def scancel(job) -> None:
        os.killpg(job.pid, signal.SIGTERM)
        for rank in ranks():
            os.kill(rank, signal.SIGTERM)

    result = stop(job, work, scancel)
    step = saved_at_stop(result, work)
    assert result.returncode == 143, result.stdout[-4000:]
    assert f"stopped on purpose: every rank saved at step {step}" in result.stdout
    assert "restart 1" not in (work / "training.log").read_text()


def sigusr1_to_its_mpirun(job) -> None:
    """horovodrun has become `/bin/sh -c "mpirun ..."` (Horovod's mpi_run); its child."""
    os.kill(the_mpirun("-P", str(job.pid)), signal.SIGUSR1)


def sigterm_to_the_ranks(job) -> None:
    for rank in ranks():
        os.kill(rank, signal.SIGTERM)


@pytest.mark.parametrize("controller, how", [("--mpi", sigusr1_to_its_mpirun),
                                             ("--gloo", sigterm_to_the_ranks)])
def test_horovodrun_signalled_as_documented_saves_on_every_rank(tmp_path, controller, how):
    """horovodrun gives the ranks 1 s (MPI: Open MPI's kill delay) or 5 s (Gloo: Horovod's
    GRACEFUL_TERMINATION_TIME_S) after its own SIGTERM or Ctrl-C; what saves is SIGUSR1
    to the mpirun it started (which hands it to every rank) or a signal to the ranks."""
    work = tmp_path / "work"
    mpi_args = ["--mpi-args=--oversubscribe"] if controller == "--mpi" else []
    job = start([str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", controller,
                 *mpi_args, "bash", str(REPO / "config.sh"), "--work-dir", str(work),
                 *REDUCED], env={"CONFIG": str(CONFIG)})
    began = time.time()
    result = stop(job, work, how)
    saved_at_stop(result, work)
    assert re.search(r"exit (with status )?code:?\s*143", result.stdout, re.IGNORECASE) or \
        result.returncode == 143, result.stdout[-4000:]
    assert time.time() - began < 240
