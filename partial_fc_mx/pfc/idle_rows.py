"""The exact lazy update (config `center_update = "exact"`): the SGD steps a class center
missed while it was not sampled, applied when it is sampled next, before the forward
reads it, so that every step sees the rows a dense update over the whole shard would
have (arcface_torch's PartialFC_V2 with its dense optimizer) at the cost of the sample.

A row without gradient at step t moves linearly under MXNet's sgd_mom_update
(m <- mu m - eta_t (g + lambda w); w <- w + m, with g = 0):

    [w; m] <- A_t [w; m],   A_t = [[1 - eta_t lambda, mu], [-eta_t lambda, mu]],

the same 2 x 2 for every row. IdleSteps keeps the step each row was last brought
current and the learning rate of every step since all rows last were; a row last
current at step L needs P(L) = A_{t-1} ... A_L. The products are formed in float64
by one backward scan from the current step over the distinct L of the sample
(det A_t = mu, so they stay bounded; prefix products with inverses would not), and
applied to the rows in float32. Every row is brought current before a checkpoint is
written, so checkpoints are the dense run's and hold no history.
"""

from __future__ import annotations

import numpy as np

CENTER_UPDATES = ("lazy", "exact", "dense")
"""How the class centers not sampled in a step take it: not at all (the MXNet
reference), when next sampled (exact, this module), or at once (a dense optimizer)."""


STEP_BYTES = 8
"""Per row of the shard: the step it was last current at (int64), the exact update's
one resident cost beyond the lazy update's (sizing/pfc_memory.py counts it)."""


class IdleSteps:
    """Steps taken, the step each of `rows` rows was last current at, and the learning
    rates since every row last was (`start`)."""

    def __init__(self, rows: int, momentum: float, weight_decay: float) -> None:
        self.momentum, self.weight_decay = momentum, weight_decay
        self.last = np.zeros(rows, np.dtype(f"i{STEP_BYTES}"))
        self.start = self.done = 0
        self.rates: list[float] = []

    def stepped(self, index: np.ndarray | None, lr: float) -> None:
        """One optimizer step at rate `lr` that updated rows `index` (None: all)."""
        self.rates.append(lr)
        self.done += 1
        if index is None:
            self.last[:] = self.done
        else:
            self.last[index] = self.done

    def all_current(self) -> None:
        """Every row has every step: the history so far is no longer needed."""
        self.last[:] = self.done
        self.start = self.done
        self.rates = []

    def coefficients(self, index: np.ndarray) -> np.ndarray | None:
        """(len(index), 4) float64: P(L) = [[a, b], [c, d]] of each row as (a, b, c, d),
        for [w; m] <- P [w; m]; None when every row of `index` is current."""
        lasts = self.last[index]
        behind = np.unique(lasts[lasts < self.done])
        if not len(behind):
            return None
        products = self.products(behind)
        where = np.searchsorted(behind, lasts)
        coefficients = np.tile(np.array([1.0, 0.0, 0.0, 1.0]), (len(index), 1))
        late = lasts < self.done
        coefficients[late] = products[where[late]]
        return coefficients

    def products(self, lasts: np.ndarray) -> np.ndarray:
        """(len(lasts), 4): A_{done-1} ... A_L flattened, for each L of `lasts` (sorted,
        distinct, start <= L < done), by one scan from the newest step back."""
        if lasts[0] < self.start:
            raise ValueError(f"row last current at step {lasts[0]}, before every row was "
                             f"(step {self.start})")
        mu, lam = self.momentum, self.weight_decay
        a, b, c, d = 1.0, 0.0, 0.0, 1.0
        found = np.empty((len(lasts), 4))
        wanted = len(lasts) - 1
        for step in range(self.done - 1, lasts[0] - 1, -1):
            decay = self.rates[step - self.start] * lam
            # [[a, b], [c, d]] @ [[1 - decay, mu], [-decay, mu]]
            a, b, c, d = (a * (1 - decay) - b * decay, (a + b) * mu,
                          c * (1 - decay) - d * decay, (c + d) * mu)
            if step == lasts[wanted]:
                found[wanted] = (a, b, c, d)
                wanted -= 1
        return found
