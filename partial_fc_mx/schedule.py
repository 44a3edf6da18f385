"""Learning rate per step: linear warmup, then multi-step (the MXNet reference) or
polynomial decay to zero with power 2 (arcface_torch)."""

from __future__ import annotations

import bisect


def learning_rate(base_lr: float, step: int, total_steps: int, warmup_steps: int,
                  lr_steps: list) -> float:
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if lr_steps:
        return base_lr * 0.1 ** bisect.bisect_right(sorted(lr_steps), step)
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return base_lr * (1 - progress) ** 2
