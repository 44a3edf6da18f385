"""What Partial FC needs on one rank, apart from the backbone: its shard of the class
centers and their optimizer states for the whole run, and per step the sampled rows
and the N x n logits. Read by the preflight and `plan` (memory.py) and by `bench pfc`,
which compares it with what a step holds; it needs neither a backbone nor OpenCV."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..pfc.center_optimizers import CenterOptimizer
from ..pfc.center_optimizers.sgd import SGD
from ..pfc.centers import center_dtype, rows_per_block, sampled_per_step, shard_of
from ..pfc.idle_rows import STEP_BYTES


@dataclass(frozen=True)
class PartialFCMemory:
    """Bytes one rank needs for Partial FC, apart from the backbone."""

    weights: int
    """The shard's rows, resident for the whole run."""
    states: int
    """Their optimizer states (and with the exact update, each row's last step),
    resident for the whole run."""
    sampled_rows: int
    """Per step: the sampled rows (weights, their scaled copy v, gradient, states) in
    float32 and the buffers they are gathered through."""
    logits: int
    """Per step: the N x n matrices (the logits, then the probabilities)."""

    @property
    def centers(self) -> int:
        return self.weights + self.states

    @property
    def working(self) -> int:
        return self.sampled_rows + self.logits

    @property
    def total(self) -> int:
        return self.centers + self.working


LOGIT_MATRICES = 2
"""N x n float32 matrices counted per step: the one buffer of the logits (then the
softmax's probabilities, which the backward GEMMs read), and one more as a margin for
MXNet's own temporaries (resident memory measured 0.96x this estimate at N = 1024,
n = 50,000, before the scaled rows v were added to the estimate; docs/benchmarks_history.md)."""


def estimate_memory(
    num_classes: int,
    embedding_size: int,
    world_size: int,
    rank: int,
    sample_rate: float,
    global_batch: int,
    fp16_centers: bool = False,
    optimizer: CenterOptimizer | None = None,
    center_update: str = "lazy",
    subcenters: int = 1,
    filtering: bool = False,
    micro_batches: int = 1,
    gemm_dtype: str = "float32",
) -> PartialFCMemory:
    """`optimizer`: the centers' (default: SGD with momentum, one state as wide as a row);
    `center_update` as PartialFC's ("exact" keeps a step count per row); `subcenters`:
    rows per class (K times the rows, the sampled rows and the logits, and an N x n
    matrix of the classes' logits beside them); `filtering`: the inter-class filter,
    whose MXNet-operator path (a GPU's) keeps an N x n mask (the CPU's kernel none:
    counted anyway); `micro_batches` (gradient accumulation, each of `global_batch`
    rows): one sample for the positives of all of them, the logits of one at a time,
    and the sampled rows' gradient summed over them in one more buffer; `gemm_dtype`
    "bfloat16" (config pfc_gemm): the GEMMs' inputs rounded into 16-bit copies, the
    sampled rows' and an N x n one of the probabilities (kernels/gemm.cc)."""
    optimizer = optimizer or SGD()
    classes = shard_of(num_classes, rank, world_size).count
    rows = classes * subcenters
    dtype = center_dtype(fp16_centers)
    states = optimizer.states(embedding_size, dtype).values()
    state_bytes = sum(width * np.dtype(state_dtype).itemsize for width, state_dtype in states)
    state_bytes += STEP_BYTES * (center_update == "exact")
    sampled_classes = sampled_per_step(classes, sample_rate, global_batch * micro_batches)
    sampled = sampled_classes * subcenters
    fp32 = 4
    # float32 work copies of the sampled rows, their scaled copy (v in partial_fc.py),
    # their gradient and states, and the buffers the rows stored in another dtype are
    # gathered through
    gathered = (embedding_size * np.dtype(dtype).itemsize * (dtype != "float32")
                + sum(width * np.dtype(state_dtype).itemsize
                      for width, state_dtype in states if state_dtype != "float32"))
    # a shard in several blocks joins each block's float32 rows in one more buffer
    joined = embedding_size * fp32 * (rows > rows_per_block(embedding_size))
    summed_gradient = embedding_size * fp32 * (micro_batches > 1)
    sampled_rows = sampled * ((3 * embedding_size + sum(width for width, _ in states)) * fp32
                              + gathered + joined + summed_gradient)
    class_matrices = (subcenters > 1) + filtering
    rounded = 2 * (gemm_dtype == "bfloat16")  # bytes of one rounded input
    return PartialFCMemory(rows * embedding_size * np.dtype(dtype).itemsize, rows * state_bytes,
                          sampled_rows + rounded * (sampled + global_batch) * embedding_size,
                          (LOGIT_MATRICES * sampled * fp32 + class_matrices
                           * sampled_classes * fp32 + rounded * sampled) * global_batch)
