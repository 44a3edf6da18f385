"""Two hosts on this machine: two network namespaces joined by a veth pair, each with
its own host name (UTS namespace) and, where a test asks, its own copy of a directory
(a mount namespace with a tmpfs or a bind mount over it). mpirun runs in host A and
starts host B's daemon through an rsh agent that enters B's namespaces instead of
ssh-ing there. Everything is created by the fixture and removed afterwards; the
addresses live only inside these namespaces."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    BIN,
    REPO,
    config_file,
    finish,
    kill_group,
    logged,
    rank_pids,
    start,
    train_args,
)

SUBNET = "10.213.57"

AGENT = """#!/bin/sh
# Open MPI's rsh agent here: "agent HOST COMMAND..." runs COMMAND on host HOST, that is,
# in HOST's network namespace, under its own host name. PFC_PRIVATE_DIRS get a fresh
# tmpfs on each host (not shared); PFC_HOST_B_BIND="SRC=DST" puts SRC over DST on B.
host=$1; shift
case "$host" in
  {a}) ns={ns_a} ;;
  {b}) ns={ns_b} ;;
  *) echo "agent: unknown host $host" >&2; exit 1 ;;
esac
exec ip netns exec "$ns" unshare --uts --mount --propagation private sh -c '
  hostname "$0" || exit 1
  for dir in $PFC_PRIVATE_DIRS; do mount -t tmpfs tmpfs "$dir" || exit 1; done
  if [ "$0" = {ns_b} ] && [ -n "$PFC_HOST_B_BIND" ]; then
    mount --bind "${{PFC_HOST_B_BIND%%=*}}" "${{PFC_HOST_B_BIND#*=}}" || exit 1
  fi
  exec sh -c "$*"' "$ns" "$@"
"""


class Cluster:
    def __init__(self, directory: Path) -> None:
        tag = f"{os.getpid() % 100000}"
        self.namespaces = (f"pfc{tag}a", f"pfc{tag}b")
        self.links = (f"pfc{tag}va", f"pfc{tag}vb")
        self.hosts = (f"{SUBNET}.1", f"{SUBNET}.2")
        self.agent = directory / "agent.sh"
        self.agent.write_text(AGENT.format(a=self.hosts[0], b=self.hosts[1],
                                           ns_a=self.namespaces[0], ns_b=self.namespaces[1]))
        self.agent.chmod(0o755)

    def create(self) -> None:
        (ns_a, ns_b), (link_a, link_b) = self.namespaces, self.links
        commands = [
            ["ip", "netns", "add", ns_a], ["ip", "netns", "add", ns_b],
            ["ip", "link", "add", link_a, "type", "veth", "peer", "name", link_b],
            ["ip", "link", "set", link_a, "netns", ns_a],
            ["ip", "link", "set", link_b, "netns", ns_b],
            ["ip", "-n", ns_a, "addr", "add", f"{self.hosts[0]}/24", "dev", link_a],
            ["ip", "-n", ns_b, "addr", "add", f"{self.hosts[1]}/24", "dev", link_b],
        ]
        for ns, link in zip(self.namespaces, self.links):
            commands += [["ip", "-n", ns, "link", "set", "lo", "up"],
                         ["ip", "-n", ns, "link", "set", link, "up"]]
        for command in commands:
            done = subprocess.run(command, text=True, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT)
            assert done.returncode == 0, (
                f"{' '.join(command)}: {done.stdout} (the multi-host tests need root, "
                "iproute2 and network namespaces)")

    def remove(self) -> None:
        for ns in self.namespaces:
            pids = subprocess.run(["ip", "netns", "pids", ns], text=True,
                                  stdout=subprocess.PIPE).stdout.split()
            for pid in pids:
                subprocess.run(["kill", "-9", pid])
            subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)

    def link(self, state: str) -> None:
        subprocess.run(["ip", "-n", self.namespaces[1], "link", "set", self.links[1], state],
                       check=True)

    def environment(self, extra: dict | None = None) -> dict:
        """What makes mpirun (and run.sh) reach host B: the agent instead of ssh, and
        the veth subnet for its control and data connections."""
        return {"PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
                "OMPI_MCA_plm_rsh_agent": str(self.agent),
                "OMPI_MCA_btl_tcp_if_include": f"{SUBNET}.0/24",
                "OMPI_MCA_oob_tcp_if_include": f"{SUBNET}.0/24", **(extra or {})}

    def run_sh(self, config: Path, *args: str, env: dict | None = None):
        """`bash run.sh` on host A with a hostfile of one slot on each host: the
        preflight, then training, as users launch it."""
        hostfile = self.agent.with_name("hosts")
        hostfile.write_text("".join(f"{host} slots=1\n" for host in self.hosts))
        environment = self.environment({"NP": "2", "HOSTFILE": str(hostfile),
                                        "CONFIG": str(config), **(env or {})})
        return start([str(self.agent), self.hosts[0], "bash", str(REPO / "run.sh"), *args],
                     env=environment)

    def mpirun(self, args: list[str], env: dict | None = None):
        """One rank on each host, without run.sh's preflight."""
        command = [str(self.agent), self.hosts[0], "mpirun", "--allow-run-as-root", "-np", "2",
                   "-H", f"{self.hosts[0]}:1,{self.hosts[1]}:1", "-x", "PATH",
                   "-x", "PYTHONUNBUFFERED", *args]
        return start(command, env=self.environment(env))

    def processes(self) -> list[str]:
        """Every process still running in the hosts' network namespaces."""
        return [pid for ns in self.namespaces for pid in subprocess.run(
            ["ip", "netns", "pids", ns], text=True, stdout=subprocess.PIPE).stdout.split()]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    made = Cluster(tmp_path_factory.mktemp("cluster"))
    made.create()
    yield made
    made.remove()


def test_two_hosts_train_save_and_resume_on_a_shared_work_dir(tmp_path, synthetic, cluster):
    config = config_file(tmp_path, synthetic, max_steps=4, save_every=2, val_targets=[])
    work = tmp_path / "work"
    trained = finish(cluster.run_sh(config, "--work-dir", str(work)), timeout=300)
    assert trained.returncode == 0, trained.stdout[-3000:]
    ns_a, ns_b = cluster.namespaces
    assert "OK: no problems found" in trained.stdout  # run.sh's preflight
    assert f"processes: 2 on 2 host(s) ({ns_a}, {ns_b})" in trained.stdout
    assert [line["step"] for line in logged(work)["steps"]] == [1, 2, 3, 4]
    resumed = finish(cluster.run_sh(config, "--work-dir", str(work), "--resume-from",
                                    str(work), "max_steps=6"), timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert f"checkpoint: {work / 'checkpoints' / 'step_000004'} verifies" in resumed.stdout
    assert f"resuming from {work / 'checkpoints' / 'step_000004'}" in resumed.stdout
    assert [line["step"] for line in logged(work)["steps"]][-2:] == [5, 6]
    assert (work / "checkpoints" / "step_000006" / "rank_1_softmax_weight.npy").is_file()


def test_a_work_dir_that_is_not_shared_is_reported_before_training(tmp_path, synthetic,
                                                                    cluster):
    """Each host gets its own tmpfs over the work dir's parent."""
    private = tmp_path / "private"
    private.mkdir()
    config = config_file(tmp_path, synthetic, max_steps=4, val_targets=[])
    work = private / "work"
    env = {"PFC_PRIVATE_DIRS": str(private)}
    check = finish(cluster.run_sh(config, "--work-dir", str(work), env=env), timeout=300)
    ns_a, ns_b = cluster.namespaces
    assert check.returncode == 1, check.stdout[-3000:]
    assert "the preflight found the PROBLEM lines above" in check.stdout
    problems = [line for line in check.stdout.splitlines() if line.startswith("PROBLEM")]
    assert any(f"rank 0 ({ns_a}) does not see the files that rank(s) 1 ({ns_b}) wrote into "
               f"work_dir {work}: it is not shared between the hosts" in p for p in problems)
    assert any(f"rank 1 ({ns_b}) does not see the files that rank(s) 0 ({ns_a})" in p
               for p in problems), problems
    began = time.time()  # started without the preflight, training refuses too
    trained = finish(cluster.mpirun(train_args(config, work), env=env), timeout=300)
    assert trained.returncode == 1, trained.stdout[-3000:]
    said = re.findall(r"^error: (.*)$", trained.stdout, flags=re.MULTILINE)
    assert len(said) == 1 and "is not shared between the hosts" in said[0]
    assert "Global Step" not in trained.stdout and time.time() - began < 60


def test_hosts_with_different_copies_of_the_dataset_are_reported(tmp_path, synthetic, cluster):
    """Host B sees another dataset (one image fewer per class) at the same path; a
    record count includes the header and the 120 identity records."""
    from partial_fc_mx.prep.synthetic import prepare_synthetic

    other = tmp_path / "other"
    prepare_synthetic(str(other), 120, per_class=5, heldout=40, pairs=200, seed=1)
    data = tmp_path / "data"
    shutil.copytree(synthetic, data)
    config = config_file(tmp_path, data, max_steps=4, val_targets=[])
    env = {"PFC_HOST_B_BIND": f"{other}={data}"}
    check = finish(cluster.run_sh(config, "--work-dir", str(tmp_path / "work"), env=env),
                   timeout=300)
    assert check.returncode == 1, check.stdout[-3000:]
    ns_a, ns_b = cluster.namespaces
    assert re.search(rf"PROBLEM: the ranks read different copies of the dataset: rank\(s\) "
                     rf"0 \({ns_a}\): 841 records, .*; rank\(s\) 1 \({ns_b}\): 721 records",
                     check.stdout), check.stdout[-3000:]
    trained = finish(cluster.mpirun(train_args(config, tmp_path / "work"), env=env),
                     timeout=300)
    assert trained.returncode == 1, trained.stdout[-3000:]
    said = re.findall(r"^error: (.*)$", trained.stdout, flags=re.MULTILINE)
    assert len(said) == 1, trained.stdout[-3000:]
    assert "the ranks read different copies of the dataset" in said[0]


def test_a_link_that_goes_down_mid_run_ends_every_process(tmp_path, synthetic, cluster):
    """run.sh's keepalive settings let mpirun and host B's daemon notice the lost link
    within about a minute (30 s idle + 3 probes 10 s apart) and end the job on both
    hosts. The stall watchdog is the last resort; kept above that minute here, as by
    default (1800 s): once a rank has exited, mpirun's pending kill request to the lost
    host is retransmitted for ~15 minutes and keepalives no longer apply."""
    stall_timeout = 90
    config = config_file(tmp_path, synthetic, num_epoch=1000, val_targets=[],
                         stall_timeout=stall_timeout)
    work = tmp_path / "work"
    job = cluster.run_sh(config, "--work-dir", str(work))
    pattern = f"partial_fc_mx train {config}"
    try:
        deadline = time.time() + 240
        while time.time() < deadline and len(logged(work)["steps"]
                                             if (work / "training.log").exists() else []) < 3:
            time.sleep(0.5)
        assert len(rank_pids(pattern)) == 2, "the job did not start on both hosts"
        cluster.link("down")
        began = time.time()
        result = finish(job, timeout=stall_timeout + 60)
        while cluster.processes() and time.time() - began < stall_timeout + 60:
            time.sleep(0.5)
        assert not cluster.processes(), "a process outlived the lost link"
        assert not rank_pids(pattern)
        assert result.returncode != 0
        assert "ORTE has lost communication with a remote daemon" in result.stdout or \
            "Timeout" in result.stdout, result.stdout[-3000:]
    finally:
        kill_group(job)
        cluster.link("up")
