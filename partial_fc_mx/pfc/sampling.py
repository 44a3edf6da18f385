"""Uniform negatives for Partial FC: distinct rows drawn without replacement, in
time and memory that scale with the sample, not the shard (10M+ classes)."""

from __future__ import annotations

import numpy as np


def sample_excluding(rng: np.random.Generator, population: int, excluded: np.ndarray,
                     count: int) -> np.ndarray:
    """`count` distinct rows drawn uniformly from range(population) minus `excluded`
    (sorted, distinct): the free rows are numbered 0..free-1, drawn, then mapped back."""
    slots = distinct_uniform(rng, population - len(excluded), count)
    # the k-th free row is k + (the number of excluded rows at or before it)
    return slots + np.searchsorted(excluded - np.arange(len(excluded)), slots, side="right")


def distinct_uniform(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """k distinct ints, every k-subset of range(n) equally likely.

    Memory and time scale with k, not n (numpy's choice permutes all n): draw with
    replacement, keep the distinct values, top up, then keep a random k of them;
    each step is symmetric in the values, so the subset is uniform. Past n / 2 it
    draws the rows to leave out instead, where k is of the order of n anyway.
    """
    if k >= n:
        return np.arange(n)
    if k > n // 2:
        return np.setdiff1d(np.arange(n), distinct_uniform(rng, n, n - k), assume_unique=True)
    chosen = np.empty(0, np.int64)
    while len(chosen) < k:
        missing = k - len(chosen)
        draws = rng.integers(0, n, missing + missing // 8 + 16)
        chosen = np.unique(np.concatenate([chosen, draws]))
    return rng.choice(chosen, size=k, replace=False)
