"""Open MPI hostfiles (`mpirun --hostfile`), read as Open MPI 4.1 reads them, for run.sh:
the hosts and their slots, and the file narrowed to the hosts a restart keeps.

What mpirun does (orte/util/hostfile): `#` and `//` start a comment to the end of the
line, and `/* ... */` one that may span lines and ends the line it starts in; a line is a
host (`user@host` too) followed by `key=value` words (spaces around `=` allowed):
`slots` (or `cpu`, `count`) gives its slots, `max_slots` (or `slots_max`, `max-slots`,
...) caps them and stands for them when `slots` is missing; a host with neither gets as
many slots as it has cores (found when mpirun starts); each further line naming the host
without counts adds one slot (a further line with counts mpirun refuses). The last line
needs no newline (a comment on it does, for mpirun 4.1: run.sh passes mpirun its own
copy). A line mpirun would refuse is refused here, by file and line, before any process
starts."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError

SLOTS_KEYS = {"slots", "cpu", "count"}
MAX_SLOTS_KEYS = {"max_slots", "max-slots", "slots_max", "slots-max", "cpu_max", "cpu-max",
                  "max_cpu", "max-cpu", "count_max", "count-max", "max_count", "max-count"}
NUMBER_KEYS = {"boards", "sockets", "sockets_per_board", "sockets-per-board", "cores",
               "cores_per_socket", "cores-per-socket"}
TEXT_KEYS = {"username", "user-name", "user_name", "cpu_set", "cpu-set"}
COMMENT_START = re.compile(r"/\*|#|//")
SETTING = re.compile(r"\s*([A-Za-z_-]+)\s*=\s*(\"[^\"]*\"|[^\s=]+)")


class HostfileError(UserError, ValueError):
    """A hostfile mpirun would not read; the message names the file and line."""


@dataclass
class Host:
    name: str
    slots: int | None = None
    """None: not given, so as many as the host has cores (mpirun's rule)."""
    max_slots: int | None = None
    lines: list[str] = field(default_factory=list)
    """What the file says of this host, comments left out."""


def read_hostfile(path: Path) -> list[Host]:
    """The hosts of an Open MPI hostfile, in the order they first appear."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise HostfileError(f"cannot read the hostfile {path}: {error}") from error
    hosts: dict[str, Host] = {}
    for number, line in logical_lines(text):
        add_line(hosts, line, f"{path}, line {number}")
    if not hosts:
        raise HostfileError(f"the hostfile {path} names no host")
    return list(hosts.values())


def logical_lines(text: str):
    """(line number, text) of each line mpirun parses, comments left out: a block comment
    ends the line it starts in, and what follows it is a line of its own (as in Open
    MPI's lexer)."""
    in_block = False
    for number, line in enumerate(text.split("\n"), start=1):
        while True:
            if in_block:
                end = line.find("*/")
                if end < 0:
                    break
                line, in_block = line[end + 2:], False
            found = COMMENT_START.search(line)
            part = line[:found.start()] if found else line
            if part.strip():
                yield number, part.strip()
            if not found or found.group() != "/*":
                break
            line, in_block = line[found.end():], True


def add_line(hosts: dict[str, Host], line: str, where: str) -> None:
    name = line.split(None, 1)[0]
    rest = line[len(name):]
    if "=" in name or name.startswith(("+", "^")) or name == "rank":
        raise HostfileError(f"{where}: {line!r} does not start with a host name; run.sh "
                            "reads lines of the form `host slots=N [max_slots=M]`")
    slots = max_slots = None
    position = 0
    while rest[position:].strip():
        found = SETTING.match(rest, position)
        if not found:
            raise HostfileError(f"{where}: cannot read {rest[position:].strip()!r}: mpirun "
                                "takes `key=value` words after the host name")
        key, value = found.group(1).lower(), found.group(2)
        position = found.end()
        if key in SLOTS_KEYS:
            if slots is not None:
                raise HostfileError(f"{where}: {name}'s slots are given twice on one line; "
                                    "mpirun refuses that")
            slots = number(value, key, where)
            if max_slots is not None and max_slots < slots:
                max_slots = slots  # as mpirun does
        elif key in MAX_SLOTS_KEYS:
            max_slots = number(value, key, where)
            if max_slots < (slots or 0):
                raise HostfileError(f"{where}: max_slots={max_slots} is below the {slots} "
                                    f"slots given before it; mpirun refuses it")
        elif key in NUMBER_KEYS:
            number(value, key, where)
        elif key not in TEXT_KEYS:
            raise HostfileError(f"{where}: {key}= is not a key of Open MPI hostfiles "
                                "(slots, max_slots, username, ...)")
    host = hosts.get(name)
    if host is None:
        hosts[name] = Host(name, slots if slots is not None else max_slots, max_slots, [line])
        return
    if slots is not None or max_slots is not None:
        raise HostfileError(f"{where}: {name} is on several lines with slot counts; mpirun "
                            "refuses that: give it one line with slots=N, or one line per "
                            "slot without counts")
    # a line without counts adds a slot: to the first line's count, or to its own one
    host.slots = (host.slots if host.slots is not None else 1) + 1
    host.lines.append(line)


def number(value: str, key: str, where: str) -> int:
    if not value.isdigit():
        raise HostfileError(f"{where}: {key}={value} is not a whole number")
    return int(value)


def narrowed(hosts: list[Host], keep: list[str]) -> str:
    """The hostfile's own lines for the hosts in `keep` (a restart's), in its order."""
    unknown = sorted(set(keep) - {host.name for host in hosts})
    if unknown:
        raise HostfileError(f"not in the hostfile: {', '.join(unknown)}")
    return "".join(f"{line}\n" for host in hosts if host.name in keep for line in host.lines)
