"""Hostfiles read as Open MPI reads them (run/hostfile.py, run.sh): checked against
mpirun's own reading of the same files (`--display-allocation`), and a job launched
by run.sh from a hostfile written as people write them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, config_file, logged, python_module, run

from partial_fc_mx.run.hostfile import HostfileError, narrowed, read_hostfile


def cores() -> int:
    """This host's cores as run.sh counts them for a line without slots= (lscpu)."""
    listed = subprocess.run(["lscpu", "-p=core,socket"], capture_output=True, text=True).stdout
    return len({line for line in listed.splitlines() if not line.startswith("#")})


def mpirun_reads(path: Path) -> tuple[int, int] | None:
    """(slots, max_slots) of this host in mpirun's allocation from the file; None when
    mpirun refuses the file."""
    shown = subprocess.run(["mpirun", "--allow-run-as-root", "--hostfile", str(path),
                            "--display-allocation", "-np", "1", "true"],
                           capture_output=True, text=True, timeout=60)
    found = re.search(r"slots=(\d+) max_slots=(\d+)", shown.stdout + shown.stderr)
    return (int(found.group(1)), int(found.group(2))) if shown.returncode == 0 and found else None


# (file text, slots read; None: a line without count, so the host's cores), every one
# ending without a newline where mpirun takes that (a comment on the last line needs one)
AS_MPIRUN_READS = [
    ("localhost slots=2", 2),
    ("localhost max_slots=16 slots=8\n", 8),        # slots= matched as its own key
    ("localhost slots = 3 max_slots=5 # four\n", 3),
    ("localhost max_slots=4", 4),                    # max_slots stands for the count
    ("localhost max_slots=3 slots=5", 5),            # ... and grows to it, as mpirun does
    ("localhost cpu=3 // counted as slots\n", 3),
    ("/* two\n lines */ localhost count=4", 4),
    ("# a comment\n\nlocalhost", None),
    ("localhost\nlocalhost\nlocalhost", 3),          # one slot per line
    ("localhost slots=2\nlocalhost", 3),             # ... added to the first line's count
]


@pytest.mark.parametrize("text, slots", AS_MPIRUN_READS)
def test_a_hostfile_is_read_as_mpirun_reads_it(tmp_path, text, slots):
    path = tmp_path / "hosts"
    path.write_text(text)
    hosts = read_hostfile(path)
    assert [(host.name, host.slots) for host in hosts] == [("localhost", slots)]
    expected = slots if slots is not None else cores()
    assert mpirun_reads(path)[0] == expected


@pytest.mark.parametrize("text, said", [
    ("localhost slots=2\nlocalhost slots=1\n", "line 2: localhost is on several lines with "
                                               "slot counts; mpirun refuses that"),
    ("localhost\nlocalhost slots=3\n", "line 2: localhost is on several lines with slot"),
    ("localhost slots=5 max_slots=3\n", "line 1: max_slots=3 is below the 5 slots"),
    ("localhost slots=2 slots=3\n", "line 1: localhost's slots are given twice on one line"),
    ("localhost slots=two\n", "line 1: slots=two is not a whole number"),
    ("localhost gpus=2\n", "line 1: gpus= is not a key of Open MPI hostfiles"),
    ("slots=2\n", "line 1: 'slots=2' does not start with a host name"),
    ("# nothing\n", "names no host"),
])
def test_a_hostfile_mpirun_refuses_is_refused_by_file_and_line(tmp_path, text, said):
    path = tmp_path / "hosts"
    path.write_text(text)
    with pytest.raises(HostfileError, match=re.escape(said)):
        read_hostfile(path)
    if "localhost" in text:
        assert mpirun_reads(path) is None


def test_a_restart_keeps_what_the_file_says_of_the_hosts_kept(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# the cluster\nnode1 slots=8 max_slots=16  # fast\n"
                    "node2 slots=8 username=me\nnode3 slots=4")
    hosts = read_hostfile(path)
    assert [(h.name, h.slots, h.max_slots) for h in hosts] == [
        ("node1", 8, 16), ("node2", 8, None), ("node3", 4, None)]
    assert narrowed(hosts, ["node1", "node3"]) == "node1 slots=8 max_slots=16\nnode3 slots=4\n"
    with pytest.raises(HostfileError, match="not in the hostfile: node9"):
        narrowed(hosts, ["node9"])
    listed = run(python_module("hostfile", str(path)))
    assert listed.returncode == 0 and listed.stdout == "node1 8\nnode2 8\nnode3 4\n"


def test_run_sh_trains_from_a_hostfile_as_people_write_it(tmp_path, synthetic):
    """No newline at the end, max_slots before slots, a comment: 2 processes."""
    hosts = tmp_path / "hosts"
    hosts.write_text("# one machine\nlocalhost max_slots=4 slots=2")
    config = config_file(tmp_path, synthetic, max_steps=2, val_targets=[])
    work = tmp_path / "work"
    done = run(["bash", str(REPO / "run.sh"), "--work-dir", str(work)], timeout=300,
               env={"CONFIG": str(config), "HOSTFILE": str(hosts), "NP": "2"})
    assert done.returncode == 0, done.stdout[-3000:]
    assert "2 processes on cpu(0)" in logged(work)["text"]
    hosts.write_text("localhost slots=2\nlocalhost slots=2\n")
    refused = run(["bash", str(REPO / "run.sh"), "--work-dir", str(work)], timeout=300,
                  env={"CONFIG": str(config), "HOSTFILE": str(hosts), "NP": "2"})
    assert refused.returncode == 2
    assert f"error: {hosts}, line 2: localhost is on several lines" in refused.stdout
    assert "== preflight" not in refused.stdout
