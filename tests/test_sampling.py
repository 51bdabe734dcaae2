"""Poisson sampling: sizes follow Binomial(n, q), every record is equally likely, empties occur."""

import numpy as np
import pytest
from scipy import stats

from dpcore.sampling import Buckets, PoissonSampler, poisson_sample, steps_per_epoch


def test_sample_sizes_follow_the_binomial_law():
    n, q, draws = 50, 0.1, 4000
    sampler = PoissonSampler(n, q, seed=1234, steps=draws)
    samples = list(sampler)
    sizes = np.array([len(s) for s in samples])
    # Chi-square goodness of fit of the size histogram to Binomial(50, 0.1); bins with small
    # expected counts are pooled into the tail. A fixed-size sampler (all sizes 5) gives
    # p ~ 0, and so does a rate 10% off (mean 5.5 instead of 5: z ~ 15 at 4000 draws).
    edges = np.arange(0, 12)
    observed = np.array([np.sum(sizes == k) for k in edges[:-1]] + [np.sum(sizes >= 11)])
    pmf = stats.binom.pmf(edges[:-1], n, q)
    expected = draws * np.append(pmf, 1 - pmf.sum())
    assert stats.chisquare(observed, expected).pvalue > 1e-3
    assert np.sum(sizes == 0) > 0  # empty samples happen (P = 0.9^50 = 0.5%) and are legal
    # each record enters with probability q: per-record inclusion counts ~ Binomial(draws, q)
    counts = np.bincount(np.concatenate(samples), minlength=n)
    se = np.sqrt(draws * q * (1 - q))
    assert np.all(np.abs(counts - draws * q) < 4.5 * se)


def test_samples_are_sorted_unique_and_in_range():
    rng = np.random.default_rng(0)
    for _ in range(100):
        s = poisson_sample(30, 0.5, rng)
        assert np.all(np.diff(s) > 0) and (s.size == 0 or (s[0] >= 0 and s[-1] < 30))
    assert poisson_sample(0, 0.5, rng).size == 0
    assert poisson_sample(7, 1.0, rng).tolist() == list(range(7))


def test_seeds_reproduce_and_differ():
    a = [s.tolist() for s in PoissonSampler(100, 0.2, seed=5, steps=20)]
    b = [s.tolist() for s in PoissonSampler(100, 0.2, seed=5, steps=20)]
    c = [s.tolist() for s in PoissonSampler(100, 0.2, seed=6, steps=20)]
    assert a == b and a != c
    assert len(PoissonSampler(10, 0.5, steps=3)) == 3
    assert PoissonSampler(200, 0.05).expected_size == pytest.approx(10.0)


@pytest.mark.parametrize("n, q, message", [
    (10, 0.0, r"q must be in \(0, 1\], got 0\.0"),
    (10, 1.5, r"q must be in \(0, 1\], got 1\.5"),
    (-1, 0.5, r"n must be an integer >= 0, got -1"),
    (10, float("nan"), r"q must be a number, got NaN"),
])
def test_bad_arguments(n, q, message):
    with pytest.raises(ValueError, match=message):
        PoissonSampler(n, q)
    with pytest.raises(ValueError, match=message):
        poisson_sample(n, q, np.random.default_rng())


def test_steps_per_epoch_rounds_halves_up():
    assert [steps_per_epoch(q) for q in (1.0, 0.9, 0.4, 0.3, 0.25, 1 / 3.5, 0.001)] == \
        [1, 1, 3, 3, 4, 4, 1000]
    with pytest.raises(ValueError, match="q"):
        steps_per_epoch(0.0)


def test_buckets():
    buckets = Buckets(256.0, 0.0256)
    assert buckets.granularity == 8
    assert [buckets.size_for(r) for r in (0, 1, 8, 9, 256, 257)] == [8, 8, 8, 16, 256, 264]
    assert Buckets(256.0, granularity=5, multiple_of=4).granularity == 8
    with pytest.raises(ValueError, match="expected_size must be finite and > 0"):
        Buckets(0.0)
