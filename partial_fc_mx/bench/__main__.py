"""`python -m partial_fc_mx.bench COMMAND ...` (see --help)."""

from __future__ import annotations

import argparse

from . import data, ijb, ops, pfc, save, train

BENCHMARKS = (pfc, train, ops, data, save, ijb)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m partial_fc_mx.bench")
    commands = parser.add_subparsers(dest="command", required=True)
    for benchmark in BENCHMARKS:
        benchmark.add_command(commands)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
