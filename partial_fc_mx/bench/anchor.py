"""arcface_torch's PartialFC_V2, timed at `bench pfc`'s shapes: the anchor our step is
measured against (issue 28). It runs insightface's own files, from a checkout the
user names, in an environment with torch (CPU) and no MXNet:

    git clone https://github.com/deepinsight/insightface
    python -m venv torch-venv && torch-venv/bin/pip install torch numpy
    OMP_NUM_THREADS=1 PYTHONPATH=<checkout> torch-venv/bin/torchrun --nproc-per-node 2 \\
        -m partial_fc_mx.bench anchor --arcface-torch insightface/recognition/arcface_torch \\
        --classes 1000000 --sample-rate 0.1 --batch-size 512

Give `bench pfc` the same OMP_NUM_THREADS: torchrun sets 1 where it is unset, MXNet
under horovodrun takes half the cores; both reports print their T. One step is what
arcface_torch's train_v2.py does for the classifier: forward, loss
(CombinedMarginLoss: ArcFace, s = 64, m = 0.5), backward into the embeddings and the
centers (a dense gradient of the whole shard, as `weight[index]` gives), SGD with
momentum 0.9 and weight decay 5e-4 (on every row of the shard, as torch's SGD does),
zero_grad. Ours updates the sampled rows only (lazy_update, insightface's MXNet
reference's rule). The embeddings are a leaf that needs its gradient, as a backbone's
output would. torch and insightface are imported only here: nothing of the project
depends on them.
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import statistics
import time
from pathlib import Path
from types import ModuleType

from ..errors import UserError
from ..pfc.threads import rank_threads
from . import shapes

REFERENCE_FILES = ("partial_fc_v2.py", "losses.py")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arcface-torch", type=Path, required=True,
                        help="the recognition/arcface_torch folder of an insightface checkout")
    shapes.add_arguments(parser)


def run(args: argparse.Namespace) -> None:
    reference = load_reference(args.arcface_torch)  # before any collective: fails alike
    import torch
    from torch import distributed

    distributed.init_process_group("gloo")  # torchrun's environment
    torch.set_num_threads(rank_threads())
    # a CPU run even where torch sees a GPU: the reference moves each tensor it makes
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    mine = [bench_config(torch, reference, num_classes, args) for num_classes in
            sorted(args.classes)]
    everyone = [None] * distributed.get_world_size()
    distributed.all_gather_object(everyone, mine)
    if distributed.get_rank() == 0:
        print_report(torch, args, everyone)
    distributed.barrier()  # torch 2.14's gloo aborted rank 1 torn down before rank 0 printed
    distributed.destroy_process_group()


def load_reference(folder: Path, files: tuple[str, ...] = REFERENCE_FILES
                   ) -> dict[str, ModuleType]:
    """insightface's arcface_torch `files` (partial_fc_v2.py and losses.py), by their
    paths, by their stems."""
    modules = {}
    for name in files:
        path = folder.resolve() / name
        if not path.is_file():
            raise UserError(f"{path} does not exist: --arcface-torch names the "
                            "recognition/arcface_torch folder of a clone of "
                            "https://github.com/deepinsight/insightface")
        spec = importlib.util.spec_from_file_location(f"arcface_torch_{path.stem}", path)
        modules[path.stem] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules[path.stem])
    return modules


def bench_config(torch, reference: dict, num_classes: int, args) -> dict:
    """Median step time and peak memory of PartialFC_V2 for one class count."""
    from torch import distributed

    rank, world = distributed.get_rank(), distributed.get_world_size()
    # PartialFC_V2's own split (centers.shard_of's, which needs MXNet, not here)
    shard_rows = num_classes // world + (rank < num_classes % world)
    torch.manual_seed(rank)
    margin = reference["losses"].CombinedMarginLoss(64.0, 1.0, 0.5, 0.0)
    pfc = reference["partial_fc_v2"].PartialFC_V2(
        margin, args.embedding_size, num_classes, shapes.sample_rate(args, shard_rows))
    optimizer = torch.optim.SGD(pfc.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    embeddings = torch.randn(args.batch_size, args.embedding_size, requires_grad=True)
    labels = torch.randint(0, num_classes, (args.batch_size,))
    losses = []

    def step() -> None:
        loss = pfc(embeddings, labels.clone())  # it rewrites its labels in place
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        embeddings.grad = None
        losses.append(loss.item())

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        distributed.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    sampled = len(pfc.weight_index) if pfc.sample_rate < 1 else shard_rows
    return {"classes": num_classes, "sampled": sampled, "step_ms": 1e3 *
            statistics.median(times), "first_loss": losses[0], "threads": torch.get_num_threads(),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def print_report(torch, args, everyone: list[list[dict]]) -> None:
    print(f"arcface_torch PartialFC_V2: {len(everyone)} ranks, batch {args.batch_size}/rank, "
          f"D={args.embedding_size}, float32, torch {torch.__version__}")
    print("step = median wall ms of forward + backward + SGD step (momentum, weight decay) "
          "+ zero_grad; peak RSS of the whole process so far")
    for rank, results in enumerate(everyone):
        for r in results:
            print(f"rank {rank}  C={r['classes']:>9,}  sampled {r['sampled']:>7,}  "
                  f"step {r['step_ms']:7.1f} ms  (T={r['threads']})  peak RSS "
                  f"{r['peak_rss_mib']:,.0f} MiB  first loss {r['first_loss']:.3f}")
