"""`check` (the preflight) and `train`: a config file with key=value overrides, read
alike on every rank."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from ..config import ConfigError, config_fingerprint, configs_differ, find_config, load_config
from ..errors import UserError
from .messages import LAUNCHER_WORLD_SIZE, report

LAUNCHER_VARIABLES = (*LAUNCHER_WORLD_SIZE, "PMIX_RANK", "SLURM_NTASKS")


def add_commands(commands: argparse._SubParsersAction) -> None:
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
    add_restart_command(commands)
    add_hostfile_command(commands)


def add_restart_command(commands: argparse._SubParsersAction) -> None:
    summary = ("between two launches of a failed training (run.sh, slurm.sbatch with "
               "MAX_RESTARTS): record why it ended and print the arguments to relaunch "
               "with, one per line")
    command = commands.add_parser("restart", help=summary, description=summary)
    command.set_defaults(func=restart_command)
    command.add_argument("config")
    command.add_argument("overrides", nargs="*", metavar="key=value")
    command.add_argument("--work-dir")
    for ignored in ("--resume-from", "--load-from"):  # the training's own arguments
        command.add_argument(ignored, help=argparse.SUPPRESS)
    command.add_argument("--status", type=int, required=True, help="the launcher's exit status")
    command.add_argument("--output", required=True, help="a file with the launcher's output")
    command.add_argument("--hosts", nargs="*", default=[], help="the hosts it relaunches on")
    command.add_argument("--processes", type=int, required=True)
    command.add_argument("--dropped", nargs="*", default=[], help="hosts that did not answer")
    command.add_argument("--attempt", type=int, required=True, help="1 for the first restart")
    command.add_argument("--job", required=True,
                         help="the supervisor's id of this job (PFC_JOB): only its own "
                              "earlier restarts count as the same failure")
    command.add_argument("--first-processes", type=int, required=True,
                         help="how many processes the job's first launch had")


def add_hostfile_command(commands: argparse._SubParsersAction) -> None:
    summary = ("read an Open MPI hostfile as mpirun does: each host and its slots ('cores': "
               "as many as it has cores), as run.sh reads it")
    command = commands.add_parser("hostfile", help=summary, description=summary)
    command.set_defaults(func=hostfile_command)
    command.add_argument("file", help="the hostfile, e.g. hosts/host_16")
    command.add_argument("--keep", nargs="+", metavar="HOST",
                         help="print the file's own lines for these hosts only (what a "
                              "restart relaunches on)")


def hostfile_command(args: argparse.Namespace) -> int:
    from ..run.hostfile import narrowed, read_hostfile

    hosts = read_hostfile(Path(args.file))
    if args.keep:
        sys.stdout.write(narrowed(hosts, args.keep))
        return 0
    for host in hosts:
        print(host.name, "cores" if host.slots is None else host.slots)
    return 0


def launched() -> bool:
    """Whether mpirun, horovodrun or srun (PMI or PMIx) started this process."""
    return any(name in os.environ for name in LAUNCHER_VARIABLES)


def check_command(args: argparse.Namespace) -> int:
    if problem := mxnet_load_problem():
        from ..hardware.gpu_support import gpus_report

        print(f"PROBLEM: {problem}")
        gpus_report(None, None)  # whether these GPUs could run it is known without MXNet
        return 1
    from ..sizing.preflight import run_check

    override_alone = args.config and "=" in args.config and not Path(args.config).exists()
    if override_alone or (args.config is None and (args.overrides or args.work_dir)):
        raise ConfigError("key=value overrides and --work-dir need a config file: "
                          "check CONFIG key=value ...")
    config = agreed_config(args) if args.config else None
    return run_check(config, args.resume_from or args.load_from,
                     weights_only=not args.resume_from)


def train_command(args: argparse.Namespace) -> int:
    if problem := mxnet_load_problem():
        report(problem)
        return 1
    from ..train import train

    config = agreed_config(args)
    if not launched():
        sys.stderr.write("training in this one process: no launcher started it (for several, "
                         "`horovodrun -np N -H localhost:N bash config.sh` or `bash run.sh`)\n")
    try:
        return train(config, args.resume_from, args.load_from)
    except UserError as error:
        report(error)
        return 1


def restart_command(args: argparse.Namespace) -> int:
    """Prints the arguments to relaunch with, one per line, or says why not to relaunch
    and returns 1."""
    from ..run.restarts import restart

    config, _ = config_of(args)
    output = Path(args.output).read_text(errors="replace")
    relaunch, refusal = restart(Path(config.output), args.status, output, args.hosts,
                                args.processes, args.dropped, args.attempt, args.job,
                                config.images_per_step() * args.first_processes)
    if refusal:  # said in training.log and on stderr
        return 1
    print("\n".join(relaunch))
    return 0


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
    from .. import dist

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
