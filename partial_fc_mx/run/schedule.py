"""How long a run is and its learning rate at each point: linear warmup, then
multi-step (the MXNet reference) or polynomial decay to zero, with power 2 by default
(arcface_torch's PolyScheduler until April 2023; its PolynomialLRWarmup since then
decays with power 1 as train_v2.py uses it: config lr_power, docs/parity.md).

Progress is counted in images, not steps: the position of epoch e, i images into
its order, is e * N + i (N images per epoch; the remainder an epoch drops counts as
passed). It does not depend on the number of processes, so a run resumed on
another world size covers the same epochs and its learning rate is the same
function of progress. The config's step counts (max_steps, lr_steps) are steps of
the global batch the run started with (its reference batch), turned into
positions once. The base learning rate is kept when the global batch changes:
the loss is a mean over the global batch, so a step's gradient does not grow with
it; to scale it, pass lr=... when resuming.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    epoch_images: int
    """N: images in one epoch's order."""
    reference_batch: int
    """The global batch the run started with."""
    end: int
    """The position where training stops."""
    warmup: int
    decay_points: tuple = ()
    """Positions where the multi-step schedule divides the rate by 10; () = polynomial."""
    power: float = 2.0
    """Of the polynomial decay."""

    @classmethod
    def of(cls, epoch_images: int, reference_batch: int, num_epoch: int, max_steps: int,
           warmup_epoch: float, lr_steps: list, power: float = 2.0) -> Schedule:
        schedule = cls(epoch_images, reference_batch, 0, round(warmup_epoch * epoch_images))
        end = schedule.after_steps(max_steps) if max_steps else num_epoch * epoch_images
        decay = tuple(sorted(schedule.after_steps(s) for s in lr_steps))
        return cls(epoch_images, reference_batch, end, schedule.warmup, decay, power)

    def position(self, epoch: int, images_in_epoch: int) -> int:
        return epoch * self.epoch_images + images_in_epoch

    def after_steps(self, steps: int) -> int:
        """The position `steps` steps of the reference batch reach from the start."""
        per_epoch = self.epoch_images // self.reference_batch
        epochs, rest = divmod(steps, per_epoch)
        return self.position(epochs, rest * self.reference_batch)

    def done(self, epoch: int, images_in_epoch: int) -> bool:
        return self.position(epoch, images_in_epoch) >= self.end

    def learning_rate(self, base_lr: float, position: int) -> float:
        """The rate of the step that starts at `position`. Warmup counts that step
        (one reference batch) as done, so the first step does not train at rate 0."""
        if position < self.warmup:
            return base_lr * min(1.0, (position + self.reference_batch) / self.warmup)
        if self.decay_points:
            return base_lr * 0.1 ** bisect.bisect_right(self.decay_points, position)
        progress = (position - self.warmup) / max(1, self.end - self.warmup)
        return base_lr * (1 - min(progress, 1.0)) ** self.power

    def steps_left(self, epoch: int, images_in_epoch: int, global_batch: int) -> int:
        """Steps of `global_batch` from this point to the end."""
        steps = 0
        while not self.done(epoch, images_in_epoch):
            batches = (self.epoch_images - images_in_epoch) // global_batch
            left = self.end - self.position(epoch, images_in_epoch)
            if left <= batches * global_batch:
                return steps + math.ceil(left / global_batch)
            steps += batches
            epoch, images_in_epoch = epoch + 1, 0
        return steps
