"""What a run needs before any GPU is booked: `python -m partial_fc_mx plan`.

For one rank of a run (rank 0: it holds the largest shard) it gives the memory of
every part, the bytes each collective of a step moves, the FLOPs of a step, whether
it fits and the fewest GPUs (or processes of one host) it fits on. The memory is the
preflight's own estimate (memory.estimate_run_memory) and the refusals are the
trainer's own (Config.check_world_size): the plan cannot promise what `check` or
`train` would then refuse.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..config import Config, ConfigError
from ..pfc.centers import center_dtype, sampled_per_step, shard_of
from .memory import CLOSE, GiB, RunMemory, backbone_memory, partial_fc_memory

MAX_WORLD_SIZE = 65536
"""The largest world size the search for the fewest GPUs tries (a few microseconds
each: the backbone's part does not depend on it)."""


@dataclass(frozen=True)
class Collective:
    """One collective of a training step, as every rank calls it."""

    name: str
    op: str
    """"allgather" or "allreduce"."""
    shape: str
    payload: int
    """Bytes of the tensor every rank holds afterwards."""
    calls: int = 1
    """How often an optimizer step calls it (gradient accumulation: once per micro-batch)."""

    def sent(self, world_size: int) -> int:
        """Bytes one rank sends (and receives) with a ring algorithm (NCCL's, Gloo's):
        an allgather passes on the W - 1 parts of the others, an allreduce does that
        twice (reduce-scatter, then allgather)."""
        rounds = 1 if self.op == "allgather" else 2
        return rounds * self.payload * (world_size - 1) // world_size


@dataclass(frozen=True)
class Plan:
    config: Config
    world_size: int
    device: str
    """"gpu", or "cpu" for processes sharing one host's memory."""
    available: int
    """Bytes one rank may use: a GPU's memory, or the host's divided by the processes."""
    memory: RunMemory
    """Rank 0's, from memory.py (the preflight's estimate)."""
    shard_rows: int
    sampled: int
    """Center rows rank 0 scores per step (more than the sample when the positives are;
    with sub-centers, every row of each sampled class)."""
    collectives: list[Collective]
    backbone_macs: int
    """Multiply-adds of one image through the backbone (`model`'s count)."""
    parameters: int
    """The backbone's trainable parameters (each one float32 in the gradient allreduce)."""
    problems: list[str]
    """Why the trainer would refuse this world size, whatever the memory."""
    smallest: int | None
    """The fewest GPUs (processes) the run fits on; None: none up to MAX_WORLD_SIZE."""

    @property
    def global_batch(self) -> int:
        """The rows of one forward and backward (a micro-batch's, with accumulation)."""
        return self.config.batch_size * self.world_size

    @property
    def gemm_flops(self) -> int:
        """Partial FC's three GEMMs on rank 0 per optimizer step (logits, the centers'
        gradient, the embeddings' gradient), each 2 x N x n x D per micro-batch."""
        return (3 * 2 * self.global_batch * self.sampled * self.config.embedding_size
                * self.config.gradient_accumulation)

    @property
    def backbone_flops(self) -> int:
        """One rank's backbone per optimizer step: forward and backward, about 3 x the
        forward (the backward computes the gradients of both the inputs and the
        weights)."""
        return 3 * 2 * self.config.images_per_step() * self.backbone_macs

    @property
    def fits(self) -> bool:
        return not self.problems and self.memory.total <= self.available

    def parts(self) -> dict[str, int]:
        """Rank 0's memory by part; they add up to memory.total."""
        backbone, pfc = self.memory.backbone, self.memory.partial_fc
        return {
            "backbone weights": backbone.weights,
            "backbone gradients": backbone.gradients,
            "backbone optimizer states": backbone.optimizer,
            ("backbone activations, recomputed" if self.config.recompute_activations
             else "backbone activations"): backbone.activations,
            **({"backbone accumulation": backbone.accumulation} if backbone.accumulation
               else {}),
            "class centers": pfc.weights,
            "center optimizer states": pfc.states,
            "per step: sampled rows": pfc.sampled_rows,
            "per step: logits": pfc.logits,
        }


def backbone_dtype(config: Config, device: str) -> str:
    """fp16 on a GPU: float16. On a CPU host whose CPU is not known here, fp16 trains in
    bfloat16 or float32 (cpu_precision.py): planned in float32, the larger, unless
    cpu_precision forces bfloat16."""
    if not config.fp16:
        return "float32"
    if device == "gpu":
        return "float16"
    return "bfloat16" if config.cpu_precision == "bfloat16" else "float32"


def make_plan(config: Config, world_size: int | None, *, gpu_memory: float | None = None,
              host_memory: float | None = None) -> Plan:
    """The plan of `config` (validated here) on `world_size` GPUs of `gpu_memory` GiB,
    or `world_size` processes sharing a CPU host of `host_memory` GiB; world_size None:
    on the fewest that fit (or on 1 when none does)."""
    config.validate()
    if (gpu_memory is None) == (host_memory is None):
        raise ConfigError("give the memory of one GPU or that of the host (one of the two)")
    memory = gpu_memory if gpu_memory is not None else host_memory
    if not memory > 0:
        raise ConfigError(f"the memory must be > 0 GiB (got {memory})")
    if world_size is not None and world_size < 1:
        raise ConfigError(f"the number of GPUs (processes) must be >= 1 (got {world_size})")
    device = "gpu" if gpu_memory is not None else "cpu"
    backbone = backbone_memory(config, backbone_dtype(config, device), device)

    def available(size: int) -> int:
        return int(memory * GiB) // (1 if device == "gpu" else size)

    smallest = smallest_world_size(config, backbone.total, available)
    size = world_size or smallest or 1
    need = RunMemory(backbone, partial_fc_memory(config, size, 0))
    rows = shard_of(config.num_classes, 0, size).count
    sampled = sampled_per_step(rows, config.sample_rate, config.images_per_step() * size) * \
        config.num_subcenters
    return Plan(
        config, size, device, available(size), need, rows, sampled,
        collectives(config, size, backbone.gradients), backbone_macs(config),
        backbone.gradients // 4, world_size_problems(config, size), smallest)


def world_size_problems(config: Config, world_size: int) -> list[str]:
    """What the trainer refuses at start-up for this world size (e.g. a logits matrix
    past MXNet's 2^31 elements), as its own words."""
    try:
        config.check_world_size(world_size)
    except ConfigError as error:
        return [str(error)]
    return []


def smallest_world_size(config: Config, backbone_bytes: int,
                        available: Callable[[int], int]) -> int | None:
    """The fewest ranks on which rank 0 (the largest shard) fits in `available(ranks)`
    bytes and the trainer accepts the world size. Searched upward one by one: Partial
    FC's memory is not monotonic in the world size (the global batch, and with it the
    sample's floor and the logits, grow with it), so no bisection."""
    for size in range(1, min(config.num_classes, MAX_WORLD_SIZE) + 1):
        room = available(size)
        if backbone_bytes > room:
            return None  # the backbone alone does not fit, and more ranks give no more room
        need = backbone_bytes + partial_fc_memory(config, size, 0).total
        if need <= room and not world_size_problems(config, size):
            return size
    return None


def collectives(config: Config, world_size: int, gradient_bytes: int) -> list[Collective]:
    """Every collective of one optimizer step, in the order a rank calls them
    (partial_fc.py accumulate and _forward_backward, once per micro-batch; train.py's
    gradient allreduce and stop flag; the loader's agreement before the next batch),
    N = the global batch of one micro-batch. tests/test_plan.py holds this list to the
    collectives a real step records."""
    n, d, k = config.batch_size * world_size, config.embedding_size, config.gradient_accumulation
    sums = 4 if config.interclass_filtering_threshold > 0 else 2  # + each row's filtered, scored
    accumulated = [Collective("accumulated batch's labels", "allgather", f"{k * n} x 5 float64",
                              8 * 5 * k * n)] if k > 1 else []
    return accumulated + [
        Collective("labels and checks", "allgather", f"{n} x 5 float64", 8 * 5 * n, k),
        Collective("embeddings", "allgather", f"{n} x {d} float32", 4 * n * d, k),
        Collective("row max of the logits", "allreduce", f"{n} float32", 4 * n, k),
        Collective("exp-sums and target logits", "allreduce", f"{n} x {sums} float32",
                   4 * sums * n, k),
        Collective("embeddings' gradient", "allreduce", f"{n} x {d} float32", 4 * n * d, k),
        Collective("backbone gradients", "allreduce",
                   f"{gradient_bytes // 4:,} float32", gradient_bytes),
        Collective("stop flag", "allreduce", "1 float64", 8),
        Collective("data errors and ends", "allreduce", "2 float64", 16),
    ]


def backbone_macs(config: Config) -> int:
    """Multiply-adds of one 112x112 image through the backbone (`model`'s count)."""
    from ..backbones import get_model
    from ..backbones.summary import count_flops

    net = get_model(config.network, config.embedding_size, config.dropout)
    net.initialize()
    return count_flops(net)[1]


def format_plan(plan: Plan) -> str:
    """The plan as the `plan` command prints it."""
    config, size = plan.config, plan.world_size
    backbone_bits = backbone_dtype(config, plan.device)
    if config.fp16 and plan.device == "cpu" and config.cpu_precision == "auto":
        backbone_bits += (" (fp16=True on a CPU host: bfloat16 where the CPU computes it "
                          "natively, else float32; planned in float32, the larger)")
    where = (f"{size} GPU(s) of {plan.available / GiB:.1f} GiB" if plan.device == "gpu"
             else f"{size} process(es) sharing a host, {plan.available / GiB:.1f} GiB each")
    subcenters = (f" of {config.num_subcenters} sub-centers each"
                  if config.num_subcenters > 1 else "")
    k = config.gradient_accumulation
    accumulated = (f", {k} micro-batches per optimizer step (its sample drawn from all "
                   f"{k * plan.global_batch:,} images)" if k > 1 else "")
    lines = [
        f"{config.network} ({plan.parameters / 1e6:.1f} M parameters, backbone in "
        f"{backbone_bits}, {config.optimizer} optimizer), batch {config.batch_size} per rank "
        f"(global {plan.global_batch:,}){accumulated}; {config.num_classes:,} classes x "
        f"{config.embedding_size}, sample_rate {config.sample_rate:g}, "
        f"{center_dtype(config.fp16_centers)} centers, {config.center_optimizer} for the "
        f"centers; on {where}",
        f"memory of rank 0 (the largest shard: {plan.shard_rows:,} classes"
        f"{subcenters}; it scores {plan.sampled:,} rows per step), the preflight's estimate "
        "(memory.py):",
    ]
    lines += [f"  {name:<34}{size_text(bytes_)}" for name, bytes_ in plan.parts().items()]
    total = plan.memory.total
    verdict = "fits in memory" if total <= plan.available else "does NOT fit in memory"
    if CLOSE * plan.available < total <= plan.available:
        verdict += (f" (close: over {CLOSE:.0%}; the estimate can be tens of percent short "
                    "for some networks)")
    lines.append(f"  {'total':<28}{size_text(total)} of {plan.available / GiB:.2f} GiB: "
                 f"{verdict}")
    lines.append(f"collectives per step (payload: the tensor every rank ends with; sent: "
                 f"what one rank sends, and receives, with a ring algorithm over {size}):")
    for c in plan.collectives:
        calls = f" x {c.calls}" if c.calls > 1 else ""
        lines.append(f"  {c.op} {c.name:<27} {c.shape:<24} payload {size_text(c.payload)}"
                     f"   sent {size_text(c.sent(size))}{calls}")
    lines.append(f"  {'total':<38}{'':<24} payload "
                 f"{size_text(sum(c.payload * c.calls for c in plan.collectives))}   sent "
                 f"{size_text(sum(c.sent(size) * c.calls for c in plan.collectives))}")
    micro = f"{k} x " if k > 1 else ""
    lines.append(
        f"FLOPs per step per rank: Partial FC's 3 GEMMs {micro}3 x 2 x {plan.global_batch:,} x "
        f"{plan.sampled:,} x {config.embedding_size} = {plan.gemm_flops / 1e12:.2f} TFLOP; "
        f"backbone forward + backward 3 x 2 x {plan.backbone_macs / 1e9:.2f} G multiply-adds "
        f"x batch {micro}"
        f"{config.batch_size} = {plan.backbone_flops / 1e12:.2f} TFLOP")
    for problem in plan.problems:
        lines.append(f"PROBLEM: {problem}")
    unit = "GPU(s)" if plan.device == "gpu" else "process(es) on the host"
    verdict = "it fits" if plan.fits else "it does NOT run" + (
        " (a PROBLEM above)" if plan.problems else "")
    if plan.smallest is None:
        fewest = (f"it fits on no number of {unit} up to "
                  f"{min(config.num_classes, MAX_WORLD_SIZE):,}: lower batch_size (the "
                  "activations; or recompute_activations=True) or sample_rate, or use fp16 / "
                  "fp16_centers=True")
    else:
        fewest = f"the fewest {unit} it fits on: {plan.smallest}"
    lines.append(f"on {size} {unit}: {verdict}; {fewest}")
    return "\n".join(lines)


def size_text(size: int) -> str:
    """Bytes in the unit that reads best: GiB, MiB or KiB."""
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:9.2f} {unit}"
    return f"{size:9d} B  "
