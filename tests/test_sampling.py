"""Sharding and sampling of class centers: coverage, exact counts, uniformity."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from partial_fc_mx.pfc.centers import shard_of
from partial_fc_mx.pfc.partial_fc import PartialFC
from partial_fc_mx.pfc.sampling import distinct_uniform, sample_excluding

# chi-square critical values at p = 0.001 (a correct sampler fails 1 run in 1000)
CHI2_CRITICAL_0_001 = {15: 37.70, 19: 43.82, 14: 36.12}


def chi_square(counts: np.ndarray) -> float:
    expected = counts.sum() / len(counts)
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("num_classes", [1, 7, 53, 1000, 93431])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_shards_are_balanced_contiguous_and_cover_every_class(num_classes, world):
    if num_classes < world:
        return
    shards = [shard_of(num_classes, r, world) for r in range(world)]
    assert shards[0].start == 0 and shards[-1].stop == num_classes
    assert all(a.stop == b.start for a, b in zip(shards, shards[1:]))
    assert max(s.count for s in shards) - min(s.count for s in shards) <= 1
    assert [s.count for s in shards] == [num_classes // world + (r < num_classes % world)
                                         for r in range(world)]


def make_pfc(num_classes=1000, rank=0, world=1, sample_rate=0.1, seed=0) -> PartialFC:
    return PartialFC(num_classes, 4, rank=rank, world_size=world, sample_rate=sample_rate,
                     seed=seed)


def test_every_positive_is_sampled_and_the_count_is_exact():
    pfc = make_pfc(num_classes=1000, rank=1, world=2, sample_rate=0.1)  # shard 500..999, n=50
    labels = np.array([3, 500, 501, 501, 999, 720, 10])
    index, target_col = pfc.sample(labels)
    rows = index
    assert len(rows) == 50 and len(np.unique(rows)) == 50 and (np.diff(rows) > 0).all()
    assert {0, 1, 499, 220} <= set(rows.tolist())
    assert (pfc.sampled_classes == rows + 500).all()
    in_shard = labels >= 500
    assert (target_col[~in_shard] == -1).all()
    assert (rows[target_col[in_shard]] == labels[in_shard] - 500).all()


def test_positives_beyond_the_sample_size_are_all_kept():
    pfc = make_pfc(num_classes=1000, sample_rate=0.01)  # n = 10
    labels = np.arange(0, 1000, 40)  # 25 distinct positives
    rows = pfc.sample(labels)[0]
    assert rows.tolist() == labels.tolist()


def test_full_sample_rate_scores_the_whole_shard():
    pfc = make_pfc(num_classes=11, rank=2, world=3, sample_rate=1.0)  # shard 8..10
    index, target_col = pfc.sample(np.array([9, 0, 10]))
    assert index is None and target_col.tolist() == [1, -1, 2]
    assert pfc.sampled_classes.tolist() == [8, 9, 10]


def test_sampling_is_reproducible_and_ranks_draw_independently():
    labels = np.array([1, 2])
    draws = [make_pfc(num_classes=20000, rank=0, world=2, seed=5).sample(labels)[0]
             for _ in range(2)]
    assert (draws[0] == draws[1]).all()
    other_seed = make_pfc(num_classes=20000, rank=0, world=2, seed=6).sample(labels)[0]
    assert not np.array_equal(draws[0], other_seed)
    # ranks 0 and 1 have shards of equal size: their negatives, as shard rows, differ
    rank1 = make_pfc(num_classes=20000, rank=1, world=2, seed=5).sample(labels + 10000)[0]
    assert len(np.intersect1d(draws[0], rank1)) < 0.5 * len(draws[0])


def test_negatives_are_uniform_over_the_non_positive_rows():
    rng = np.random.default_rng(0)
    excluded = np.array([2, 3, 11, 19])
    counts = np.zeros(20)
    for _ in range(4000):
        drawn = sample_excluding(rng, 20, excluded, 6)
        assert len(np.unique(drawn)) == 6 and not np.isin(drawn, excluded).any()
        counts[drawn] += 1
    free = np.setdiff1d(np.arange(20), excluded)
    assert (counts[excluded] == 0).all()
    assert chi_square(counts[free]) < CHI2_CRITICAL_0_001[len(free) - 1]


@pytest.mark.parametrize("n, k", [(6, 3), (6, 4)])  # (6, 4) draws the complement
def test_every_subset_is_equally_likely(n, k):
    rng = np.random.default_rng(1)
    subsets = {s: i for i, s in enumerate(itertools.combinations(range(n), k))}
    counts = np.zeros(len(subsets))
    for _ in range(20000):
        counts[subsets[tuple(sorted(distinct_uniform(rng, n, k).tolist()))]] += 1
    assert chi_square(counts) < CHI2_CRITICAL_0_001[len(subsets) - 1]


def test_sampling_memory_does_not_grow_with_the_shard():
    # a population of 10^12 rows could not be materialized (8 TB); 10^4 draws are instant
    rng = np.random.default_rng(2)
    excluded = np.array([5, 10**11, 10**12 - 1])
    drawn = sample_excluding(rng, 10**12, excluded, 10000)
    assert len(np.unique(drawn)) == 10000 and drawn.max() < 10**12
    assert not np.isin(drawn, excluded).any()
