"""What a run needs and whether this build can run it: `gpus` (which GPUs the MXNet
build has kernels for), `model` (parameters and FLOPs of a backbone) and `plan` (memory,
collectives and FLOPs per GPU, and the fewest GPUs a run fits on)."""

from __future__ import annotations

import argparse

from ..config import load_config
from ..errors import UserError


def add_commands(commands: argparse._SubParsersAction) -> None:
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
    model.add_argument("network", help="r18, r34, r50, r100, r200, mobilefacenet, mbf or tiny")
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
    plan.add_argument("--network", help="r18, r34, r50, r100, r200, mobilefacenet, mbf or tiny")
    plan.add_argument("--fp16", action=argparse.BooleanOptionalAction,
                      help="the backbone in 16 bits")
    plan.add_argument("--fp16-centers", action=argparse.BooleanOptionalAction,
                      help="the class centers (and SGD's momentum) in float16")
    plan.add_argument("--center-optimizer", help="sgd or adamw")
    plan.add_argument("--num-subcenters", type=int,
                      help="sub-center ArcFace's centers per class (K times the rows)")
    plan.add_argument("--optimizer", help="the backbone's: sgd or adamw")
    plan.add_argument("--gradient-accumulation", type=int,
                      help="micro-batches of --batch-size per optimizer step")
    plan.add_argument("--recompute-activations", action=argparse.BooleanOptionalAction,
                      help="keep only each backbone segment's input; recompute in the backward")
    plan.add_argument("--gpus", "--processes", type=int, dest="world_size",
                      help="how many (default: the fewest the run fits on)")
    room = plan.add_mutually_exclusive_group(required=True)
    room.add_argument("--gpu-memory", type=float, metavar="GIB",
                      help="memory of one GPU, GiB (what is free: the CUDA context takes "
                           "some)")
    room.add_argument("--host-memory", type=float, metavar="GIB",
                      help="memory of a CPU host its processes share, GiB")


def gpus_command(args: argparse.Namespace) -> int:
    from ..hardware.gpu_support import gpus_report

    return gpus_report(args.wheel, args.table)


def model_command(args: argparse.Namespace) -> int:
    from ..backbones import get_model
    from ..backbones.summary import count_flops

    try:
        net = get_model(args.network, args.embedding_size)
    except ValueError as error:
        raise UserError(str(error)) from error
    net.initialize()
    params, macs = count_flops(net)
    print(f"{args.network}: {params / 1e6:.2f} M parameters, {macs / 1e9:.3f} GFLOPs "
          f"(multiply-adds) per 112x112 image, {args.embedding_size}-d embedding")
    return 0


PLAN_KEYS = ("num_classes", "embedding_size", "sample_rate", "batch_size", "network", "fp16",
             "fp16_centers", "center_optimizer", "optimizer", "num_subcenters",
             "gradient_accumulation", "recompute_activations")


def plan_command(args: argparse.Namespace) -> int:
    """0: the run fits (on --gpus, or on some number of GPUs); 1: it does not."""
    from ..config import Config
    from ..sizing.plan import format_plan, make_plan

    config = load_config(args.config) if args.config else Config()
    for key in PLAN_KEYS:
        if getattr(args, key) is not None:
            setattr(config, key, getattr(args, key))
    plan = make_plan(config, args.world_size, gpu_memory=args.gpu_memory,
                     host_memory=args.host_memory)
    print(format_plan(plan))
    return 0 if plan.fits else 1
