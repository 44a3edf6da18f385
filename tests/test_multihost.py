"""Hosts on this machine: network namespaces joined by veth pairs to a bridge (a
switch in a namespace of its own), each with its own host name (UTS namespace) and,
where a test asks, its own copy of a directory (a mount namespace with a tmpfs or a
bind mount over it). mpirun runs in host A and starts the other hosts' daemons through
an rsh agent that enters their namespaces instead of ssh-ing there. Everything is
created by the fixture and removed afterwards; the addresses live only inside these
namespaces."""

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
    BIN,
    REPO,
    config_file,
    finish,
    kill_group,
    rank_pids,
    start,
    train_args,
)

from partial_fc_mx.run.metrics import read_metrics

SUBNET = "10.213.57"
HOSTS = 3

AGENT = """#!/bin/sh
# Open MPI's rsh agent here: "agent HOST COMMAND..." runs COMMAND on host HOST, that is,
# in HOST's network namespace, under its own host name. PFC_PRIVATE_DIRS get a fresh
# tmpfs on each host (not shared); PFC_HOST_B_BIND="SRC=DST" puts SRC over DST on B.
host=$1; shift
case "$host" in
{cases}
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
    def __init__(self, directory: Path, size: int = HOSTS) -> None:
        tag = f"{os.getpid() % 100000}"
        self.namespaces = tuple(f"pfc{tag}{chr(ord('a') + i)}" for i in range(size))
        self.switch = f"pfc{tag}sw"
        self.links = tuple(f"pfc{tag}v{i}" for i in range(size))
        self.ports = tuple(f"pfc{tag}p{i}" for i in range(size))
        self.hosts = tuple(f"{SUBNET}.{i + 1}" for i in range(size))
        self.agent = directory / "agent.sh"
        cases = "\n".join(f"  {host}) ns={ns} ;;" for host, ns in zip(self.hosts,
                                                                       self.namespaces))
        self.agent.write_text(AGENT.format(cases=cases, ns_b=self.namespaces[1]))
        self.agent.chmod(0o755)

    def create(self) -> None:
        switch = self.switch
        commands = [["ip", "netns", "add", switch],
                    ["ip", "-n", switch, "link", "add", "br0", "type", "bridge"],
                    ["ip", "-n", switch, "link", "set", "br0", "up"]]
        for ns, link, port, host in zip(self.namespaces, self.links, self.ports, self.hosts):
            commands += [
                ["ip", "netns", "add", ns],
                ["ip", "link", "add", link, "type", "veth", "peer", "name", port],
                ["ip", "link", "set", link, "netns", ns],
                ["ip", "link", "set", port, "netns", switch],
                ["ip", "-n", switch, "link", "set", port, "master", "br0"],
                ["ip", "-n", switch, "link", "set", port, "up"],
                ["ip", "-n", ns, "addr", "add", f"{host}/24", "dev", link],
                ["ip", "-n", ns, "link", "set", "lo", "up"],
                ["ip", "-n", ns, "link", "set", link, "up"]]
        for command in commands:
            done = subprocess.run(command, text=True, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT)
            assert done.returncode == 0, (
                f"{' '.join(command)}: {done.stdout} (the multi-host tests need root, "
                "iproute2, bridges and network namespaces)")

    def remove(self) -> None:
        for ns in (*self.namespaces, self.switch):
            pids = subprocess.run(["ip", "netns", "pids", ns], text=True,
                                  stdout=subprocess.PIPE).stdout.split()
            for pid in pids:
                subprocess.run(["kill", "-9", pid])
            subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)

    def link(self, state: str, host: int = 1) -> None:
        subprocess.run(["ip", "-n", self.namespaces[host], "link", "set", self.links[host],
                        state], check=True)

    def environment(self, extra: dict | None = None) -> dict:
        """What makes mpirun (and run.sh) reach the other hosts: the agent instead of
        ssh, and the veth subnet for its control and data connections."""
        return {"PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
                "OMPI_MCA_plm_rsh_agent": str(self.agent),
                "OMPI_MCA_btl_tcp_if_include": f"{SUBNET}.0/24",
                "OMPI_MCA_oob_tcp_if_include": f"{SUBNET}.0/24", **(extra or {})}

    def run_sh(self, config: Path, *args: str, hosts: int = 2, env: dict | None = None):
        """`bash run.sh` on host A with a hostfile of one slot on each of the first
        `hosts` hosts: the preflight, then training, as users launch it."""
        hostfile = self.agent.with_name("hosts")
        hostfile.write_text("".join(f"{host} slots=1\n" for host in self.hosts[:hosts]))
        environment = self.environment({"NP": str(hosts), "HOSTFILE": str(hostfile),
                                        "CONFIG": str(config), **(env or {})})
        return start([str(self.agent), self.hosts[0], "bash", str(REPO / "run.sh"), *args],
                     env=environment)

    def mpirun(self, args: list[str], env: dict | None = None):
        """One rank on each of the first two hosts, without run.sh's preflight."""
        command = [str(self.agent), self.hosts[0], "mpirun", "--allow-run-as-root", "-np", "2",
                   "-H", f"{self.hosts[0]}:1,{self.hosts[1]}:1", "-x", "PATH",
                   "-x", "PYTHONUNBUFFERED", *args]
        return start(command, env=self.environment(env))

    def processes(self, host: int | None = None) -> list[str]:
        """Every process still running in the hosts' network namespaces (or one's)."""
        chosen = self.namespaces if host is None else [self.namespaces[host]]
        return [pid for ns in chosen for pid in subprocess.run(
            ["ip", "netns", "pids", ns], text=True, stdout=subprocess.PIPE).stdout.split()]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    made = Cluster(tmp_path_factory.mktemp("cluster"))
    made.create()
    yield made
    made.remove()


def test_a_work_dir_that_is_not_shared_is_reported_before_training(tmp_path, synthetic,
                                                                    cluster):
    """Each host gets its own tmpfs over the work dir's parent."""
    private = tmp_path / "private"
    private.mkdir()
    config = config_file(tmp_path, synthetic, max_steps=4, val_targets=[])
    work = private / "work"
    env = {"PFC_PRIVATE_DIRS": str(private)}
    check = finish(cluster.run_sh(config, "--work-dir", str(work), env=env), timeout=300)
    ns_a, ns_b = cluster.namespaces[:2]
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
    ns_a, ns_b = cluster.namespaces[:2]
    assert re.search(rf"PROBLEM: the ranks read different copies of the dataset: rank\(s\) "
                     rf"0 \({ns_a}\): 841 records, .*; rank\(s\) 1 \({ns_b}\): 721 records",
                     check.stdout), check.stdout[-3000:]
    trained = finish(cluster.mpirun(train_args(config, tmp_path / "work"), env=env),
                     timeout=300)
    assert trained.returncode == 1, trained.stdout[-3000:]
    said = re.findall(r"^error: (.*)$", trained.stdout, flags=re.MULTILINE)
    assert len(said) == 1, trained.stdout[-3000:]
    assert "the ranks read different copies of the dataset" in said[0]


# STOP_GRACE: mpirun ends the ranks left after a failure 2 x STOP_GRACE seconds later
# (docs/launching.md); these jobs fail on purpose and stop by no signal to mpirun
RESTARTS = {"MAX_RESTARTS": "2", "RESTART_BACKOFF": "1", "PROBE_TIMEOUT": "5",
            "STOP_GRACE": "2"}


def steps_trained(work: Path) -> list[int]:
    """The steps of the run as it stands (a resume forgets the steps it trains again)."""
    try:
        return read_metrics(work)["step"]
    except (OSError, ValueError, KeyError):
        return []


def wait_until(condition, job, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert job.poll() is None, f"the job ended before {what}: {job.returncode}"
        assert time.time() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.5)


def ranks_on(cluster: Cluster, host: int, pattern: str) -> list[int]:
    """The training processes running in one host's namespace."""
    there = set(cluster.processes(host))
    return [pid for pid in rank_pids(pattern) if str(pid) in there]


def restart_records(work: Path) -> list[dict]:
    return read_metrics(work)["restarts"]


def test_a_killed_rank_then_a_frozen_one_restart_the_job_which_finishes(tmp_path, synthetic,
                                                                         cluster):
    """3 hosts, MAX_RESTARTS=2, `run.sh` with a hostfile: the preflight, then training
    that saves on every host into the shared work dir. SIGKILL to host C's rank after the
    first checkpoint, then SIGSTOP to host B's in the relaunched job: each time the job
    ends, is relaunched on the three hosts (all answer) from its last checkpoint, which
    the preflight verifies, and finally trains to max_steps; the frozen rank is named by
    the heartbeats within 45 s."""
    config = config_file(tmp_path, synthetic, max_steps=10, save_every=3, val_targets=[],
                         heartbeat_timeout=10)
    work = tmp_path / "work"
    pattern = f"partial_fc_mx train {config}"
    ns_a, ns_b, ns_c = cluster.namespaces
    job = cluster.run_sh(config, "--work-dir", str(work), hosts=3, env=RESTARTS)
    frozen = None
    try:
        wait_until(lambda: max(steps_trained(work), default=0) >= 4, job, 300, "step 4")
        killed = ranks_on(cluster, 2, pattern)
        assert len(killed) == 1
        os.kill(killed[0], signal.SIGKILL)
        wait_until(lambda: len(restart_records(work)) == 1 and
                   max(steps_trained(work), default=0) >= 7, job, 300, "step 7 relaunched")
        frozen = ranks_on(cluster, 1, pattern)[0]
        os.kill(frozen, signal.SIGSTOP)
        froze = time.time()
        wait_until(lambda: len(restart_records(work)) == 2, job, 180, "a second restart")
        named_within = restart_records(work)[1]["time"] - froze
        result = finish(job, timeout=300)
    finally:
        if frozen is not None:
            subprocess.run(["kill", "-CONT", str(frozen)], stderr=subprocess.DEVNULL)
        kill_group(job)
    assert result.returncode == 0, result.stdout[-4000:]
    text = (work / "training.log").read_text()
    assert re.search(rf"restart 1: rank 2 on ({ns_c}|{re.escape(cluster.hosts[2])}) was ended "
                     rf"by signal 9 \(Killed\) after "
                     rf"step \d+; relaunching 3 processes on {', '.join(cluster.hosts)}, from "
                     rf"checkpoint step 3", text), text[-4000:]
    assert re.search(rf"restart 2: the job stalled: rank 1 \({ns_b}, pid {frozen}\) stopped "
                     rf"beating after step \d+: no heartbeat for \d+ s while rank \d \(pfc\w+\) "
                     rf"waited for it \(heartbeat_timeout=10\) after step \d+; relaunching 3",
                     text), text[-4000:]
    assert named_within < 45, named_within
    first, second = restart_records(work)
    for record in (first, second):  # at most one save interval of steps is lost
        assert record["processes"] == 3 and record["dropped"] == []
        assert 0 <= record["step"] - record["checkpoint"] <= 3, record
    assert steps_trained(work) == list(range(1, 11))
    assert not rank_pids(pattern)
    assert result.stdout.count("OK: no problems found") == 3  # each launch's preflight
    assert f"processes: 3 on 3 host(s) ({ns_a}, {ns_b}, {ns_c})" in result.stdout
    for step in (first["checkpoint"], second["checkpoint"]):
        path = work / "checkpoints" / f"step_{step:06d}"
        assert f"checkpoint: {path} verifies" in result.stdout  # the relaunch's preflight
        assert f"resuming from {path}" in text
    assert (work / "checkpoints" / "step_000010" / "rank_2_softmax_weight.npy").is_file()


def test_a_host_whose_link_goes_down_is_dropped_and_the_job_finishes_on_the_others(
        tmp_path, synthetic, cluster):
    """3 hosts, MAX_RESTARTS=2: host C's link cut after the first checkpoint. Open MPI's
    keepalives (run.sh's take about a minute; here shortened to about 20 s) let mpirun
    notice; the supervisor's probe finds host C silent, drops it and relaunches on A and
    B from the checkpoint, re-sharded to 2 processes, to max_steps. The rank left behind
    on C ends by itself (its daemon's keepalives, at the latest its watchdog)."""
    stall_timeout = 90
    config = config_file(tmp_path, synthetic, max_steps=12, save_every=4, val_targets=[],
                         stall_timeout=stall_timeout)
    work = tmp_path / "work"
    pattern = f"partial_fc_mx train {config}"
    keepalive = {"OMPI_MCA_oob_tcp_keepalive_time": "10",
                 "OMPI_MCA_oob_tcp_keepalive_intvl": "5", "OMPI_MCA_oob_tcp_keepalive_probes": "2"}
    job = cluster.run_sh(config, "--work-dir", str(work), hosts=3, env={**RESTARTS, **keepalive})
    try:
        wait_until(lambda: max(steps_trained(work), default=0) >= 5, job, 300, "step 5")
        cluster.link("down", host=2)
        cut = time.time()
        result = finish(job, timeout=400)
        while rank_pids(pattern) and time.time() - cut < stall_timeout + 60:
            time.sleep(0.5)
        assert not rank_pids(pattern), "a rank outlived the lost link"
    finally:
        kill_group(job)
        cluster.link("up", host=2)
    assert result.returncode == 0, result.stdout[-4000:]
    lost, kept = cluster.hosts[2], ", ".join(cluster.hosts[:2])
    assert f"host {lost} did not answer within 5 s: dropped" in result.stdout
    text = (work / "training.log").read_text()
    assert re.search(rf"restart 1: the launcher lost its link to host "
                     rf"({cluster.namespaces[2]}|{re.escape(lost)}) after step \d+; "
                     rf"relaunching 2 processes on {re.escape(kept)}, without "
                     rf"{re.escape(lost)}, from checkpoint step [48]", text), text[-4000:]
    assert re.search(r"training tiny on .*: 120 classes, 2 processes on", text), text[-4000:]
    # max_steps counts steps of the first launch's global batch (3 x 24 images): on 2
    # processes the same 864 images take more, smaller steps
    series = read_metrics(work)
    resumed_at = restart_records(work)[0]["checkpoint"]
    assert series["step"] == list(range(1, resumed_at + (864 - 72 * resumed_at) // 48 + 1))
    assert series["images"][-1] == 864
