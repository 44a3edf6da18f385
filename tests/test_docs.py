"""The commands in README.md and docs/*.md exist: every `python -m partial_fc_mx ...`,
`python -m partial_fc_mx.bench ...`, `bash config.sh ...` and `bash run.sh ...`
(under horovodrun or mpirun too) names a real subcommand, real flags of it, and real
config keys in its `key=value` overrides. Checked against the real argument parsers,
nothing is run: a renamed flag fails here instead of failing a user."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from partial_fc_mx.bench.__main__ import build_parser as build_bench_parser
from partial_fc_mx.cli.main import build_parser
from partial_fc_mx.config import FIELDS

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ENTRY_POINTS = [  # (pattern, parser) in the order they are tried on a command
    (re.compile(r"-m partial_fc_mx\.bench(?=\s|$)"), "bench"),
    (re.compile(r"-m partial_fc_mx(?=\s|$)"), "main"),
    (re.compile(r"bash (?:\S*/)?(?:config|run)\.sh(?=\s|$)"), "train"),
]
SHELL_ENDS = re.compile(r"\s(?:\|\||\||;|&&|>|2>|#)\s|`|\)$")


def command_texts(text: str) -> list[str]:
    """Each code line (4-space indented or in a ``` fence, continuation lines joined)
    and each `inline` span of prose (a paragraph's lines joined: a span may wrap)."""
    found, fenced, joined, prose = [], False, "", []
    for line in [*text.splitlines(), ""]:
        code = fenced or line.startswith("    ")
        if line.strip().startswith("```") or code or not line.strip():
            found += re.findall(r"`([^`]+)`", " ".join(prose))
            prose = []
        if line.strip().startswith("```"):
            fenced = not fenced
        elif code:
            joined += line.strip().removeprefix("$ ")
            if joined.endswith("\\"):
                joined = joined[:-1] + " "
                continue
            found.append(joined)
            joined = ""
        elif line.strip():
            prose.append(line.strip())
    return found


def invocations(command: str) -> list[tuple[str, list[str]]]:
    """(parser, the words after the entry point) of each command in `command` (split
    where the shell would run another)."""
    found = []
    for piece in SHELL_ENDS.split(command):
        for pattern, parser in ENTRY_POINTS:
            if match := pattern.search(piece):
                rest = piece[match.end():]
                try:
                    words = shlex.split(rest)
                except ValueError:  # prose with an apostrophe: the words up to it
                    words = rest.split("'")[0].split()
                found.append((parser, [w.strip("[]|(),") for w in words if w.strip("[]|(),")]))
                break
    return found


def subparser(kind: str, command: str | None):
    """The argparse parser of `command` (a subcommand of the main or bench CLI)."""
    parser = build_bench_parser([command or ""]) if kind == "bench" else build_parser()
    choices = parser._subparsers._group_actions[0].choices
    return choices.get(command), sorted(choices)


def problems_of(kind: str, words: list[str]) -> list[str]:
    """What in one documented invocation does not exist."""
    if kind == "train":
        command, rest = "train", words
    elif not words or words[0].startswith("-"):
        return []  # `python -m partial_fc_mx --help` and the like
    else:
        command, rest = words[0], words[1:]
    parser, commands = subparser("bench" if kind == "bench" else "main", command)
    if parser is None:
        return [f"no subcommand {command!r} (there are {', '.join(commands)})"]
    options = parser._option_string_actions
    problems = [f"{command}: no option {word.split('=')[0]}" for word in rest
                if word.startswith("--") and word != "--" and word.split("=")[0] not in options]
    if command in ("train", "check"):
        problems += [f"{command}: no config key {word.split('=')[0]!r}" for word in rest
                     if re.fullmatch(r"[a-z_][a-z0-9_]*=.*", word)
                     and word.split("=")[0] not in FIELDS and word != "key=value"]
    return problems


def documented() -> list[tuple[str, str, list[str]]]:
    return [(f"{path.name}: {text}", kind, words) for path in DOCS
            for text in command_texts(path.read_text())
            for kind, words in invocations(text)]


def test_the_docs_document_commands():
    kinds = {kind for _, kind, _ in documented()}
    assert kinds == {"main", "bench", "train"} and len(documented()) > 60


@pytest.mark.parametrize("where, kind, words", documented(),
                         ids=lambda value: value if isinstance(value, str) else None)
def test_every_documented_command_exists(where, kind, words):
    assert not problems_of(kind, words), where


@pytest.mark.parametrize("line, problem", [
    ("    python -m partial_fc_mx plan --classes 10 --gpu-mem 80",
     "plan: no option --gpu-mem"),
    ("    python -m partial_fc_mx.bench pfc --clases 1000", "pfc: no option --clases"),
    ("    python -m partial_fc_mx evaluate --model x", "no subcommand 'evaluate'"),
    ("    horovodrun -np 2 -H localhost:2 bash config.sh sample_rat=0.1 --work-dir w",
     "train: no config key 'sample_rat'"),
    ("Run `bash run.sh --resume work_dirs/orl` to go on.", "train: no option --resume"),
    ("A span that wraps: `python -m partial_fc_mx\ntrain configs/orl.py batchsize=4`.",
     "train: no config key 'batchsize'"),
    ("    python -m partial_fc_mx check x || bash run.sh --bogus", "train: no option --bogus"),
])
def test_a_renamed_flag_or_key_is_caught(line, problem):
    found = [p for text in command_texts(line) for kind, words in invocations(text)
             for p in problems_of(kind, words)]
    assert len(found) == 1 and found[0].startswith(problem), found


def test_the_configuration_page_is_generated_from_config_and_lists_every_key():
    from partial_fc_mx.tools.config_reference import render, sections

    page = (REPO / "docs" / "configuration.md").read_text()
    assert page == render(), ("docs/configuration.md is out of date: python -m "
                              "partial_fc_mx.tools.config_reference > docs/configuration.md")
    listed = [key for _, keys in sections() for key, *_ in keys]
    assert sorted(listed) == sorted(FIELDS)
    undocumented = [key for _, keys in sections() for key, _, _, meaning in keys if not meaning]
    assert not undocumented, f"say what these keys mean in config.py: {undocumented}"
    assert "| `val_targets` | list | `[]` | Verification sets: names looked up as " in page
    shipped = sorted(path.name for path in (REPO / "configs").glob("*.py"))
    missing = [name for name in shipped if f"`{name}`" not in page]
    assert not missing, f"add these configs to the table in config_reference.HEADER: {missing}"
