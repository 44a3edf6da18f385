"""What a run wrote, evaluated and exported: `eval` (.bin verification sets),
`eval-ijb` and `roc` (IJB-B/IJB-C 1:1), `export` and `check-onnx` (backbone.onnx),
`plot` (curves from metrics.jsonl); and `import-backbone`, another framework's model
as a work dir to start from."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_commands(commands: argparse._SubParsersAction) -> None:
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
    imported = commands.add_parser(
        "import-backbone", help="an arcface_torch or insightface model (ONNX, or MXNet "
                                "symbol/params) as a work dir to fine-tune from (--load-from)")
    imported.set_defaults(func=import_command)
    imported.add_argument("source", help="MODEL.onnx, or PREFIX-symbol.json (with "
                                         "PREFIX-0000.params), or PREFIX,EPOCH")
    imported.add_argument("work_dir")
    imported.add_argument("--network", required=True,
                          help="its architecture by our name: r18, r34, r50, r100, r200, mbf, "
                               "mobilefacenet")
    imported.add_argument("--calibrate", metavar="DATASET",
                          help="a packed dataset (e.g. your own photos) to measure the "
                               "statistics of BatchNorms the export folded away on (default: "
                               "the ORL faces)")
    plot = commands.add_parser("plot", help="PNG curves from WORK_DIR/metrics.jsonl; several "
                                            "work dirs are compared on the same figures")
    plot.set_defaults(func=plot_command)
    plot.add_argument("work_dirs", nargs="+", metavar="work_dir")
    plot.add_argument("--out", help="where the PNGs go (default: WORK_DIR/plots for one "
                                    "work dir, ./plots for several)")


def plot_command(args: argparse.Namespace) -> int:
    from ..tools.plot import plot_work_dirs

    for path in plot_work_dirs(args.work_dirs, args.out):
        print(f"wrote {path}")
    return 0


def import_command(args: argparse.Namespace) -> int:
    from ..backbones import unknown_network
    from ..imports.calibration import agreement_reading
    from ..imports.importer import MIN_COSINE, import_backbone
    from ..imports.layers import BackboneImportError

    if problem := unknown_network(args.network):
        raise BackboneImportError(problem)
    report = import_backbone(args.source, args.work_dir, args.network, args.calibrate)
    print(f"imported {report.source.path} ({report.source.kind}) as {report.network}, "
          f"{report.embedding_size}-d embeddings: our network and the source agree on random "
          f"inputs to a worst cosine of {report.worst_cosine:.6f} (>= {MIN_COSINE})")
    if report.folded:
        print(f"{len(report.folded)} BatchNorms the export had folded into the layer before "
              f"them got statistics from {report.calibrated_on}: in training mode the embeddings "
              f"of those faces agree with inference to a worst cosine of "
              f"{report.training_cosine:.4f}, {agreement_reading(report.training_cosine)}")
    print(f"wrote {report.checkpoint} and {args.work_dir}/backbone-*: fine-tune with "
          f"`train CONFIG network={report.network} --load-from {args.work_dir}`; `eval` "
          "and `export` take the work dir")
    return 0


def export_command(args: argparse.Namespace) -> int:
    from ..run import export

    path = export.export_onnx(args.work_dir)
    difference = export.parity(args.work_dir)
    print(f"wrote {path}; onnxruntime against MXNet on random inputs: {difference:.2e} "
          "(the larger of the relative and the normalized embeddings' difference)")
    return 0 if difference <= 1e-4 else 1


def check_onnx_command(args: argparse.Namespace) -> int:
    from ..run import export

    checked = export.check_onnx(args.onnx, args.runs, args.max_mb, args.max_ms)
    print(f"{args.onnx}: input {checked.input_shape}, output {checked.output_shape}, "
          f"{checked.size_mb:.1f} MB, median latency {checked.latency_ms:.2f} ms "
          f"(batch 1, onnxruntime CPU, {args.runs} runs)")
    for warning in checked.warnings:
        print(f"WARNING: {warning}")
    return 1 if checked.warnings else 0


def eval_command(args: argparse.Namespace) -> int:
    from ..evaluation.verification import load_bin, verify

    sets = {path: load_bin(path) for path in args.bin}  # bad files first: they are cheap
    from ..evaluation.validator import BEST_MODEL
    from ..run.export import describe_backbone, model_forward

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

    from ..evaluation import ijb
    from ..run.export import model_forward

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
    from ..evaluation import ijb

    curves = {}
    for number, path in enumerate(args.scores, 1):
        name = f"{Path(path).parent.name}/{Path(path).stem}"
        if name in curves:  # one row and one curve per file, even of the same name
            name = f"{name} ({number})"
        curves[name] = ijb.roc_curve(*ijb.load_scores(Path(path)))
    print(ijb.table({name: ijb.tar_at_fars(roc) for name, roc in curves.items()}))
    print(f"wrote {ijb.plot_rocs(curves, Path(args.out), '1:1 verification')}")
    return 0
