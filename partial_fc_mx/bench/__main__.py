"""`python -m partial_fc_mx.bench COMMAND ...` (see --help).

Only the chosen benchmark's module is imported: each pulls in what it measures
(MXNet, Horovod, OpenCV, onnx, ...), and a library that cannot load on a machine
(an OpenCV or onnx built for another numpy crashed every rank of `pfc`, which uses
neither) must fail only the benchmark that uses it. --help lists every benchmark
from the table below without importing any.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ..errors import UserError

BENCHMARKS = {
    "pfc": "one Partial FC step: time, GEMM speed, memory",
    "train": "the whole training step: Partial FC against a data-parallel FC",
    "ops": "the operators PartialFC chose, next to alternatives",
    "prelu": "the backbones' PReLU on the CPU: MXNet's LeakyReLU against the project's kernel",
    "anchor": "arcface_torch's PartialFC_V2 at pfc's shapes (in a torch environment)",
    "backbone_anchor": "arcface_torch's backbones' forward and backward, beside train's "
                       "(in a torch environment)",
    "data": "decode throughput against mx.io.ImageRecordIter",
    "save": "the cost of durable, checksummed checkpoint files",
    "saving": "what a save costs the run: checkpoint, ONNX export inline or in the background",
    "ijb": "IJB-C-sized metadata: time and peak memory",
    "index": "record index open: seconds and private memory per rank",
    "soak": "a long training run: step time and memory of its last steps against its first",
}
"""Command -> summary; the command is also the module's name in this package, whose
add_arguments(parser) defines its options and run(args) runs it."""


def chosen_command(argv: list[str]) -> str | None:
    """The benchmark named on the command line (its first word that is no option)."""
    return next((word for word in argv if not word.startswith("-")), None)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """Every benchmark listed; only the chosen one's module imported and its options
    defined."""
    parser = argparse.ArgumentParser(prog="python -m partial_fc_mx.bench")
    commands = parser.add_subparsers(dest="command", required=True)
    chosen = chosen_command(argv)
    for name, summary in BENCHMARKS.items():
        command = commands.add_parser(name, help=summary, description=summary)
        if name == chosen:
            module = importlib.import_module(f"{__package__}.{name}")
            module.add_arguments(command)
            command.set_defaults(func=module.run)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        args.func(args)
    except UserError as error:  # a message that names the fix, not a traceback
        sys.stderr.write(f"error: {error}\n")
        sys.exit(2)


if __name__ == "__main__":
    main()
