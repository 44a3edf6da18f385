"""How well a recipe generalizes to people it never saw: train it on several random
identity splits (ORL: 30 people to train on, 10 held out; or a synthetic set per
seed) and report the held-out verification accuracy as mean and spread over the
splits, beside the untrained network and eigenfaces on the same pairs. One split
can flatter a recipe; five seldom do.

    python -m partial_fc_mx.quality --splits 0 1 2 3 4 \\
        --arm "default:" --arm "augmented:augment_crop_scale=0.8 augment_rotate=10"
    python -m partial_fc_mx.quality --config configs/synthetic_sampling.py \\
        --synthetic 5000 --splits 0 --arm "r1.0:sample_rate=1.0" --arm "r0.1:sample_rate=0.1"

An arm is a name and config overrides on --config (default configs/orl.py, or
configs/synthetic_sampling.py with --synthetic), trained like `bash run.sh` trains
(mpirun, --np processes, config.sh). Each run is kept in --work/<arm>/split<seed>; a
finished run is not repeated while its result.json records the same config text,
data, overrides and processes, so arms can be added later and the tables printed
again with all of them; anything else about it trains it again. The figures are read
from each run's metrics.jsonl.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .cli.arguments import fraction
from .config import Config, config_fingerprint
from .run.metrics import METRICS, read_metrics
from .tools.plot import plot_work_dirs

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class SyntheticSet:
    """Synthetic identities (prep/synthetic.py) instead of ORL: one set per split seed."""

    classes: int
    per_class: int
    heldout: int
    pairs: int
    shared: float = 0.0
    """How much all identities look alike (prep/synthetic.py)."""


@dataclass
class RunResult:
    overrides: list
    minutes: float
    """Wall time of the whole launch, start-up included."""
    untrained: float
    """Held-out accuracy at step 0."""
    trained: float
    """At the end of training (not the best along the way: that would pick on the test)."""
    fold_std: float
    """Of `trained`, over the ten folds of the verification protocol."""
    tar_at_far: dict
    eigenfaces: float | None
    """None where the run did not report the baseline."""
    final_loss: float
    ms_per_step: float
    """Median over the log lines: evaluations and saves are not steps."""


def split_data(work: Path, seed: int, synthetic: SyntheticSet | None = None) -> Path:
    """The training records and held-out pairs of split `seed`. ORL: all genuine pairs
    of the 10 held-out people (about 450) with as many impostor pairs."""
    if synthetic is None:
        directory = work / "data" / f"split{seed}"
        if not (directory / "orl_heldout.bin").is_file():
            from .prep.orl import prepare_orl

            prepare_orl(str(directory), heldout=10, seed=seed)
        return directory
    s = synthetic
    likeness = f"-shared{s.shared:g}" if s.shared else ""
    directory = (work / "data" / f"synthetic{s.classes}x{s.per_class}{likeness}"
                 f"-heldout{s.heldout}x{s.pairs}-seed{seed}")
    if not (directory / "synthetic_heldout.bin").is_file():
        from .prep.synthetic import prepare_synthetic

        prepare_synthetic(str(directory), s.classes, s.per_class, s.heldout, s.pairs, seed,
                          s.shared)
    return directory


def train_once(config: str, data: Path, overrides: list[str], work_dir: Path,
               processes: int) -> float:
    """Train one run as run.sh does; returns its wall time in minutes."""
    launch = [*mpirun_on_this_host(processes), "-x", "CONFIG"]
    started = time.perf_counter()
    work_dir.mkdir(parents=True)
    classes = int((data / "property").read_text().split(",")[0])
    with open(work_dir / "output.txt", "w") as output:
        done = subprocess.run([*launch, "bash", str(REPO / "config.sh"), f"rec={data}",
                               f"num_classes={classes}", *overrides,
                               "--work-dir", str(work_dir)], cwd=REPO,
                              env={**os.environ, "CONFIG": config}, stdout=output,
                              stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"training failed (exit {done.returncode}); its output: "
                         f"{work_dir / 'output.txt'}")
    return (time.perf_counter() - started) / 60


def mpirun_on_this_host(processes: int) -> list[str]:
    """mpirun starting `processes` here, as run.sh does, with PATH passed on."""
    launch = ["mpirun", "-np", str(processes), "-H", f"localhost:{processes}",
              "--oversubscribe", "-bind-to", "none", "-map-by", "slot", "-x", "PATH"]
    return [*launch, "--allow-run-as-root"] if os.geteuid() == 0 else launch


def run_key(config: str, data: Path, overrides: list[str], processes: int) -> dict:
    """Everything that decides what a run trains: a saved run is reused only when all
    of it is the same (a config file edited since, other data, or a default of the
    toolkit changed since, such as center_update's, trains again)."""
    text_hash = hashlib.sha256(Path(config).read_bytes()).hexdigest()
    return {"config": config, "config_sha256": text_hash, "data": str(data),
            "overrides": overrides, "processes": processes,
            "defaults": config_fingerprint(Config())}


def read_result(work_dir: Path) -> RunResult:
    saved = json.loads((work_dir / "result.json").read_text())
    series = read_metrics(work_dir)
    if len(series["verification"]) != 1 or not series["step"]:
        raise SystemExit(f"{work_dir / METRICS}: the study reads training steps and one "
                         "held-out set's "
                         f"evaluations; this run evaluated {sorted(series['verification'])}. "
                         "Keep val_targets to the held-out set, and delete this run.")
    [evaluations] = series["verification"].values()
    global_batch = series["images"][-1] // series["step"][-1]
    step_ms = [1000 * global_batch / speed for speed in series["speed"] if speed > 0]
    ms_per_step = statistics.median(step_ms) if step_ms else float("nan")
    baseline = next(iter(series["baseline"].values()), None)
    return RunResult(saved["overrides"], saved["minutes"], evaluations[0].accuracy,
                     evaluations[-1].accuracy, evaluations[-1].std,
                     evaluations[-1].tar_at_far, baseline, series["loss"][-1], ms_per_step)


def run_arm(config: str, work: Path, name: str, overrides: list[str], seeds: list[int],
            processes: int, synthetic: SyntheticSet | None = None) -> list[RunResult]:
    results = []
    for seed in seeds:
        work_dir = work / name / f"split{seed}"
        saved = work_dir / "result.json"
        data = split_data(work, seed, synthetic)
        key = run_key(config, data, overrides, processes)
        reusable = saved.is_file() and (work_dir / METRICS).is_file()  # (older runs: none)
        if not (reusable and same_run(json.loads(saved.read_text()), key)):
            if work_dir.exists():  # an unfinished, different or older run: start again
                shutil.rmtree(work_dir)
            minutes = train_once(config, data, overrides, work_dir, processes)
            saved.write_text(json.dumps({**key, "minutes": minutes}))
        results.append(read_result(work_dir))
        r = results[-1]
        eigenfaces = "-" if r.eigenfaces is None else f"{r.eigenfaces:.4f}"
        print(f"{name} split {seed}: {r.trained:.4f} (untrained {r.untrained:.4f}, "
              f"eigenfaces {eigenfaces}, {r.minutes:.1f} min)", flush=True)
    return results


def same_run(saved: dict, key: dict) -> bool:
    return {name: saved.get(name) for name in key} == key


def mean_std(values: list[float | None]) -> str:
    """Mean ± std over splits or seeds; one run has no spread to give (a ± 0 would
    claim one); "-" where a run has no such figure, "diverged" where one went NaN."""
    if None in values:
        return "-"
    if any(math.isnan(v) for v in values):
        return "diverged"
    if len(values) < 2:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def overrides_text(result: RunResult) -> str:
    return f"`{' '.join(result.overrides) or '(none)'}`"


def table(arms: dict[str, list[RunResult]]) -> str:
    """One row per arm: mean and spread over the splits."""
    rows = ["| arm | overrides | held-out accuracy | per split | untrained | eigenfaces "
            "| minutes per run |", "|---|---|---|---|---|---|---|"]
    for name, results in arms.items():
        per_split = " ".join(f"{r.trained:.3f}" for r in results)
        rows.append(f"| {name} | {overrides_text(results[0])} "
                    f"| **{mean_std([r.trained for r in results])}** | {per_split} "
                    f"| {mean_std([r.untrained for r in results])} "
                    f"| {mean_std([r.eigenfaces for r in results])} "
                    f"| {statistics.mean(r.minutes for r in results):.1f} |")
    return "\n".join(rows)


def runs_table(arms: dict[str, list[RunResult]], seeds: list[int]) -> str:
    """One row per run: the spread over folds, TAR at the FARs the pairs resolve, the
    last logged loss and the speed."""
    fars = sorted({far for results in arms.values() for r in results for far in r.tar_at_far},
                  reverse=True)
    rows = ["| arm | overrides | split | held-out accuracy ± std over folds | "
            + "".join(f"TAR@FAR={far:g} | " for far in fars)
            + "final loss | ms/step | minutes |", "|---" * (7 + len(fars)) + "|"]
    for name, results in arms.items():
        for seed, r in zip(seeds, results):
            tars = "".join(f"{r.tar_at_far[far]:.4f} | " if far in r.tar_at_far else "- | "
                           for far in fars)
            rows.append(f"| {name} | {overrides_text(r)} | {seed} | {r.trained:.4f} ± "
                        f"{r.fold_std:.4f} | {tars}{r.final_loss:.3f} | {r.ms_per_step:.0f} "
                        f"| {r.minutes:.1f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m partial_fc_mx.quality",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--arm", action="append", required=True, metavar="NAME:OVERRIDES",
                        help="a name, a colon, and key=value overrides separated by spaces")
    parser.add_argument("--splits", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--config", help="default: configs/orl.py, or "
                        "configs/synthetic_sampling.py with --synthetic")
    parser.add_argument("--work", type=Path, default=Path("work_dirs/quality"))
    parser.add_argument("--np", type=int, default=2, help="processes per run")
    parser.add_argument("--synthetic", type=int, metavar="CLASSES",
                        help="train on this many synthetic identities instead of ORL")
    parser.add_argument("--per-class", type=int, default=8, help="synthetic: images per class")
    parser.add_argument("--heldout", type=int, default=300,
                        help="synthetic: held-out identities for the verification pairs")
    parser.add_argument("--pairs", type=int, default=3000,
                        help="synthetic: genuine pairs (as many impostor pairs)")
    parser.add_argument("--shared", type=fraction, default=0.0,
                        help="synthetic: how much all identities look alike, in [0, 1)")
    parser.add_argument("--plot", type=Path, metavar="DIR",
                        help="also draw every split's arms on shared figures in DIR/split<seed>")
    args = parser.parse_args(argv)
    synthetic = (SyntheticSet(args.synthetic, args.per_class, args.heldout, args.pairs,
                              args.shared) if args.synthetic else None)
    config = args.config or ("configs/synthetic_sampling.py" if synthetic else "configs/orl.py")
    arms = {}
    for arm in args.arm:
        name, _, overrides = arm.partition(":")
        arms[name] = run_arm(str(Path(config).resolve()), args.work.resolve(), name,
                             overrides.split(), args.splits, args.np, synthetic)
    print(table(arms))
    print()
    print(runs_table(arms, args.splits))
    if args.plot:
        for seed in args.splits:
            runs = [str(args.work / name / f"split{seed}") for name in arms]
            plot_work_dirs(runs, str(args.plot / f"split{seed}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
