"""How well a recipe generalizes to people it never saw: train it on several random
identity splits of ORL (30 people to train on, 10 held out) and report the held-out
verification accuracy as mean and spread over the splits, beside the untrained
network and eigenfaces on the same pairs. One split can flatter a recipe; five
seldom do.

    python -m partial_fc_mx.quality --splits 0 1 2 3 4 \\
        --arm "default:" --arm "augmented:augment_crop_scale=0.8 augment_rotate=10"

An arm is a name and config overrides on --config (default configs/orl.py), trained
like `bash run.sh` trains (mpirun, --np processes, config.sh). Each run is kept in
--work/<arm>/split<seed> with a result.json; a run already there is not repeated, so
arms can be added later and the table printed again with all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .data.orl import prepare_orl
from .plot import read_log

REPO = Path(__file__).resolve().parents[1]
BASELINE = re.compile(r"eigenfaces \(PCA\) baseline ([\d.]+)")


@dataclass
class RunResult:
    overrides: list
    untrained: float
    """Held-out accuracy at step 0."""
    trained: float
    """At the end of training (not the best along the way: that would pick on the test)."""
    eigenfaces: float
    minutes: float


def split_data(work: Path, seed: int) -> Path:
    """ORL packed with identity split `seed`, and all genuine pairs of the held-out
    people (about 450) with as many impostor pairs."""
    directory = work / "data" / f"split{seed}"
    if not (directory / "orl_heldout.bin").is_file():
        prepare_orl(str(directory), heldout=10, seed=seed)
    return directory


def train_once(config: str, data: Path, overrides: list[str], work_dir: Path,
               processes: int) -> RunResult:
    launch = ["mpirun", "-np", str(processes), "-H", f"localhost:{processes}",
              "--oversubscribe", "-bind-to", "none", "-map-by", "slot", "-x", "PATH",
              "-x", "CONFIG"]
    if os.geteuid() == 0:
        launch.append("--allow-run-as-root")
    started = time.perf_counter()
    work_dir.mkdir(parents=True)
    with open(work_dir / "output.txt", "w") as output:
        done = subprocess.run([*launch, "bash", str(REPO / "config.sh"), f"rec={data}",
                               *overrides, "--work-dir", str(work_dir)], cwd=REPO,
                              env={**os.environ, "CONFIG": config}, stdout=output,
                              stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"training failed (exit {done.returncode}); its output: "
                         f"{work_dir / 'output.txt'}")
    minutes = (time.perf_counter() - started) / 60
    log = work_dir / "training.log"
    [accuracies] = read_log(log)["verification"].values()  # (step, accuracy) of orl_heldout
    return RunResult(overrides, accuracies[0][1], accuracies[-1][1],
                     float(BASELINE.findall(log.read_text())[-1]), minutes)


def run_arm(config: str, work: Path, name: str, overrides: list[str], seeds: list[int],
            processes: int) -> list[RunResult]:
    results = []
    for seed in seeds:
        work_dir = work / name / f"split{seed}"
        saved = work_dir / "result.json"
        if saved.is_file() and json.loads(saved.read_text())["overrides"] == overrides:
            results.append(RunResult(**json.loads(saved.read_text())))
            continue
        if work_dir.exists():  # an unfinished or different run: start again
            shutil.rmtree(work_dir)
        result = train_once(config, split_data(work, seed), overrides, work_dir, processes)
        saved.write_text(json.dumps(asdict(result)))
        print(f"{name} split {seed}: {result.trained:.4f} (untrained {result.untrained:.4f}, "
              f"eigenfaces {result.eigenfaces:.4f}, {result.minutes:.1f} min)", flush=True)
        results.append(result)
    return results


def mean_std(values: list[float]) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.4f} ± {spread:.4f}"


def table(arms: dict[str, list[RunResult]]) -> str:
    rows = ["| arm | overrides | held-out accuracy | per split | untrained | eigenfaces "
            "| minutes per run |", "|---|---|---|---|---|---|---|"]
    for name, results in arms.items():
        per_split = " ".join(f"{r.trained:.3f}" for r in results)
        rows.append(f"| {name} | `{' '.join(results[0].overrides) or '(none)'}` "
                    f"| **{mean_std([r.trained for r in results])}** | {per_split} "
                    f"| {mean_std([r.untrained for r in results])} "
                    f"| {mean_std([r.eigenfaces for r in results])} "
                    f"| {statistics.mean(r.minutes for r in results):.1f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m partial_fc_mx.quality",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--arm", action="append", required=True, metavar="NAME:OVERRIDES",
                        help="a name, a colon, and key=value overrides separated by spaces")
    parser.add_argument("--splits", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--config", default="configs/orl.py")
    parser.add_argument("--work", type=Path, default=Path("work_dirs/quality"))
    parser.add_argument("--np", type=int, default=2, help="processes per run")
    args = parser.parse_args(argv)
    arms = {}
    for arm in args.arm:
        name, _, overrides = arm.partition(":")
        arms[name] = run_arm(str(Path(args.config).resolve()), args.work.resolve(), name,
                             overrides.split(), args.splits, args.np)
    print(table(arms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
