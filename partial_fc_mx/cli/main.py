"""`python -m partial_fc_mx COMMAND ...`: parse, run the command, and turn a user's
error (a bad config, file or argument) into one message and exit status 2."""

from __future__ import annotations

import argparse
import logging

from ..config import ConfigError
from ..errors import UserError
from . import datasets, results, sizing, training
from .messages import let_peers_report, report

AREAS = (training, datasets, sizing, results)
"""Each adds its commands to the parser, in the order --help lists them."""

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m partial_fc_mx")
    commands = parser.add_subparsers(dest="command", required=True)
    for area in AREAS:
        area.add_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    # this package's own INFO lines; MXNet's (its ONNX exporter says three per export)
    # and other libraries' only from WARNING up
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    logging.getLogger(__package__.split(".")[0]).setLevel(logging.INFO)
    parser = build_parser()
    # key=value overrides may also come after options (config.sh passes "$@" last)
    args, extra = parser.parse_known_args(argv)
    stray = [word for word in extra if "=" not in word or word.startswith("-")]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    try:
        return args.func(args)
    except ConfigError as error:
        report(error)
        if not hasattr(error, "printed_by_rank_0"):  # not agreed: peers may still say why
            let_peers_report()
        return 2
    except UserError as error:
        report(error)
        return 2
