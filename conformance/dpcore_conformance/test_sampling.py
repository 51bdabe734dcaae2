"""The backend's sampler: Poisson sampling, whose batch sizes follow Binomial(n, q), with every
record in every batch independently with probability q (so equally likely, never twice in a
batch, and independently of the other batches), empty batches allowed."""

import numpy as np
import pytest
from scipy import stats

N, Q, DRAWS = 50, 0.1, 4000


def draws(backend, seed, n=N, q=Q, count=DRAWS):
    sampler = backend.poisson_sampler(n, q, seed=seed)
    return [np.asarray(sampler.sample()).astype(int) for _ in range(count)]


def test_batch_sizes_follow_the_binomial_law(backend):
    sizes = np.array([s.size for s in draws(backend, 2024)])
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
    """Each record's count in DRAWS batches is Binomial(DRAWS, Q), independently: the sum of
    their squared standardised deviations is chi-square with N degrees of freedom, checked
    two-sided (p > 1e-6 either way): too uneven counts, or too even ones, as when batches are
    cut from a shuffled epoch (each record once per epoch)."""
    counts = np.bincount(np.concatenate(draws(backend, 7)), minlength=N)
    assert counts.size == N, "sampled indices outside range(n)"
    statistic = np.sum((counts - DRAWS * Q) ** 2) / (DRAWS * Q * (1 - Q))
    p = 2 * min(stats.chi2.cdf(statistic, N), stats.chi2.sf(statistic, N))
    assert p > 1e-6, (
        f"per-record counts in {DRAWS} batches have variance {counts.var():.1f}, expected "
        f"{DRAWS * Q * (1 - Q):.0f} (chi-square {statistic:.1f} on {N} degrees of freedom, "
        f"two-sided p = {p:.2g})")


def test_consecutive_batches_are_independent(backend):
    """Two independent Poisson samples share Binomial(N, Q^2) records: the total overlap of
    DRAWS - 1 consecutive pairs has mean (DRAWS - 1) N Q^2 = 2000 and standard deviation at
    most sqrt((DRAWS - 1) N Q^2 (1 + 2 Q)) = 49 (neighbouring pairs share a batch); the
    tolerance is 6 of them. Batches cut from a shuffled epoch never overlap within it."""
    samples = draws(backend, 11)
    overlap = sum(np.intersect1d(a, b).size for a, b in zip(samples, samples[1:]))
    mean = (DRAWS - 1) * N * Q ** 2
    bound = 6 * np.sqrt(mean * (1 + 2 * Q))
    assert abs(overlap - mean) < bound, (
        f"consecutive batches share {overlap} records in all, expected {mean:.0f} +- "
        f"{bound:.0f}: batches are not drawn independently")


def test_records_are_sampled_independently_of_each_other(backend):
    """Neighbouring records i and i + 1 are in a batch together with probability Q^2: over
    DRAWS batches the count of such pairs has mean DRAWS (N - 1) Q^2 = 1960 and standard
    deviation 48 (overlapping pairs included); the tolerance is 6 of them. A contiguous run of
    records (a window at a random start) gives about 8 times as many."""
    pairs = sum(int(np.sum(np.diff(s) == 1)) for s in draws(backend, 13))
    mean = DRAWS * (N - 1) * Q ** 2
    sd = np.sqrt(DRAWS * ((N - 1) * Q ** 2 * (1 - Q ** 2) + 2 * (N - 2) * (Q ** 3 - Q ** 4)))
    assert abs(pairs - mean) < 6 * sd, (
        f"neighbouring records were sampled together {pairs} times, expected {mean:.0f} +- "
        f"{6 * sd:.0f}: records are not sampled independently")


@pytest.mark.parametrize("q, count", [(0.3, 500), (0.37, 500), (0.016, 2000), (0.0125, 8000)])
def test_the_sampling_rate_is_q(backend, q, count):
    """Mean batch size of ``count`` samples of 1000 records, within 6 standard errors
    sqrt(1000 q (1 - q) / count) (0.13% of q n at q = 0.3, 3.3% at q = 0.016, 1.9% at
    q = 0.0125) of q n: a rate rounded to 1/round(1/q) is 10% off, 0.016 rounded to 0.02 25%,
    and q n = 12.5, the only expected size that is not a whole number, rounded to 12 or 13
    (a rate taken as round(q n) / n) 4%, 12.7 standard errors."""
    sizes = np.array([s.size for s in draws(backend, 5, n=1000, q=q, count=count)])
    se = np.sqrt(1000 * q * (1 - q) / count)
    assert abs(sizes.mean() - 1000 * q) < 6 * se, (
        f"mean batch size {sizes.mean():.2f} at q = {q}, n = 1000, expected {1000 * q:g} "
        f"+- {6 * se:.2f}")


def test_samples_hold_distinct_records(backend):
    for s in draws(backend, 3, q=0.5, count=200):
        assert np.unique(s).size == s.size, "a record was sampled twice in one batch"


def test_sampler_seeds_reproduce_and_differ(backend):
    def run(seed):
        return [s.tolist() for s in draws(backend, seed, count=30)]

    assert run(5) == run(5), "two samplers with seed 5 drew different batches"
    assert run(5) != run(6), "samplers with seeds 5 and 6 drew the same batches"


def test_sampler_seeds_of_the_aggregator_reproduce_and_differ(backend):
    """The aggregator passes a NumPy SeedSequence (spawned from its seed, or from OS entropy
    when it has none): a sampler that seeds itself only from an int fell back to a fixed
    default, and every unseeded run drew the same batches."""
    def run(seed):
        return [s.tolist() for s in draws(backend, seed, count=30)]

    sequence = np.random.SeedSequence
    assert run(sequence(5)) == run(sequence(5)), "SeedSequence(5) twice drew different batches"
    assert run(sequence(5)) != run(sequence(6)), "SeedSequences 5 and 6 drew the same batches"
    assert run(None) != run(None), "two unseeded samplers drew the same batches"
    assert run(sequence()) != run(sequence()), (
        "two samplers seeded from OS entropy (SeedSequence()) drew the same batches")
