"""One command line: `python -m partial_fc_mx COMMAND CONFIG [key=value ...]`."""

from __future__ import annotations

import argparse
import sys

from .config import ConfigError, load_config


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m partial_fc_mx")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, summary in (
        ("check", "preflight: build, processes, devices, data files and memory"),
        ("train", "train a backbone with Partial FC (launch with horovodrun or mpirun)"),
    ):
        command = commands.add_parser(name, help=summary, description=summary)
        command.add_argument("config", help="a config file, e.g. configs/orl.py")
        command.add_argument("overrides", nargs="*", metavar="key=value",
                             help="override config keys, e.g. sample_rate=0.1 batch_size=64")
        command.add_argument("--work-dir", help="output directory (overrides `output`)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides = list(args.overrides)
    if args.work_dir:
        overrides.append(f"output={args.work_dir}")
    try:
        config = load_config(args.config, overrides)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.command == "check":
        return check_command(config)
    print("partial_fc_mx train: the trainer is not written yet (issue 5); "
          "the preflight above is all this version does.", file=sys.stderr)
    return 3


def check_command(config) -> int:
    try:
        from .check import run_check
    except ImportError as error:  # MXNet or Horovod's MXNet extension is missing
        print(f"PROBLEM: {error}; run `bash setup-utils/install.sh` (it builds Horovod "
              "with MXNet support)")
        return 1
    return run_check(config)


if __name__ == "__main__":
    sys.exit(main())
