"""The backend's sampler: Poisson sampling, whose batch sizes follow Binomial(n, q), with every
record equally likely and empty batches allowed."""

import numpy as np
from scipy import stats

N, Q, DRAWS = 50, 0.1, 4000


def test_batch_sizes_follow_the_binomial_law(backend):
    sampler = backend.poisson_sampler(N, Q, seed=2024)
    samples = [np.asarray(sampler.sample()) for _ in range(DRAWS)]
    sizes = np.array([s.size for s in samples])
    # chi-square goodness of fit to Binomial(50, 0.1), sizes >= 11 pooled (expected count >= 5
    # per bin); fixed-size batches, or a rate 10% off (z ~ 15 on the mean), give p ~ 0.
    observed = np.array([np.sum(sizes == k) for k in range(11)] + [np.sum(sizes >= 11)])
    pmf = stats.binom.pmf(np.arange(11), N, Q)
    expected = DRAWS * np.append(pmf, 1 - pmf.sum())
    assert stats.chisquare(observed, expected).pvalue > 1e-4, (
        f"batch sizes do not follow Binomial({N}, {Q}): mean {sizes.mean():.2f}, "
        f"variance {sizes.var():.2f} (expected {N * Q:.2f}, {N * Q * (1 - Q):.2f})")
    assert np.any(sizes == 0), "no empty batch in 4000 draws (expected about 21)"


def test_every_record_is_equally_likely(backend):
    sampler = backend.poisson_sampler(N, Q, seed=7)
    rows = np.concatenate([np.asarray(sampler.sample()) for _ in range(DRAWS)]).astype(int)
    counts = np.bincount(rows, minlength=N)
    assert counts.size == N, "sampled indices outside range(n)"
    se = np.sqrt(DRAWS * Q * (1 - Q))  # Binomial(DRAWS, Q) per record
    assert np.all(np.abs(counts - DRAWS * Q) < 4.5 * se)


def test_samples_hold_distinct_records(backend):
    sampler = backend.poisson_sampler(N, 0.5, seed=3)
    for _ in range(200):
        s = np.asarray(sampler.sample())
        assert np.unique(s).size == s.size, "a record was sampled twice in one batch"


def test_sampler_seeds_reproduce_and_differ(backend):
    def run(seed):
        sampler = backend.poisson_sampler(N, Q, seed=seed)
        return [np.asarray(sampler.sample()).tolist() for _ in range(30)]

    assert run(5) == run(5)
    assert run(5) != run(6)
