"""Partial FC: class centers sharded over the ranks, scored on a sample per step.

Rank r of W owns the contiguous rows [start, start + count) of the C x D center
matrix, with count = C // W + (r < C % W): balanced to within one row, and
computable by every rank (and by a resume on another world size) from (C, W) alone.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    start: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.count


def shard_of(num_classes: int, rank: int, world_size: int) -> Shard:
    base, extra = divmod(num_classes, world_size)
    start = rank * base + min(rank, extra)
    return Shard(start, base + (rank < extra))


def num_sample(shard_size: int, sample_rate: float) -> int:
    """Centers a rank scores per step when the batch's positives fit in the sample."""
    return int(sample_rate * shard_size)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank needs for Partial FC, apart from the backbone."""

    centers: int
    """The shard and its momentum, resident for the whole run."""
    working: int
    """Per step: the sampled rows (weights, normalized, gradient, momentum) and logits."""

    @property
    def total(self) -> int:
        return self.centers + self.working


def estimate_memory(
    num_classes: int,
    embedding_size: int,
    world_size: int,
    rank: int,
    sample_rate: float,
    global_batch: int,
    fp16_centers: bool = False,
) -> MemoryEstimate:
    rows = shard_of(num_classes, rank, world_size).count
    center_bytes = 2 if fp16_centers else 4
    sampled = min(rows, max(num_sample(rows, sample_rate), global_batch))
    fp32 = 4
    sampled_rows = 4 * sampled * embedding_size * fp32
    logits = 3 * global_batch * sampled * fp32
    return MemoryEstimate(2 * rows * embedding_size * center_bytes, sampled_rows + logits)
