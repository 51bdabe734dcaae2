"""Statistics shared by the checks, fast enough for the millions of values they test, and a
probe of a secure aggregator's draws (used by the project's own tests too)."""

import numpy as np
from scipy import special, stats


def ks_normal(x) -> tuple[float, float]:
    """Kolmogorov-Smirnov distance of the sample ``x`` from N(0, 1) and its p-value (exact,
    two-sided: scipy's ``kstest(x, "norm")``, several times faster on millions of values)."""
    cdf = special.ndtr(np.sort(np.ravel(x)))
    n = cdf.size
    distance = max(np.max(np.arange(1, n + 1) / n - cdf), np.max(cdf - np.arange(n) / n))
    return float(distance), float(stats.kstwo.sf(distance, n))


def repeated_run(x, length: int):
    """Start indices ``(i, j)``, i < j, of two equal runs of ``length`` consecutive values of
    the float64 array ``x``, or None: every run hashed, equal hashes compared value by value."""
    bits = x.view(np.uint64)
    bits = bits ^ (bits >> np.uint64(29))  # float32 and float16 values have zero low bits
    count = x.size - length + 1
    hashes = np.zeros(count, np.uint64)
    for k in range(length):  # arithmetic modulo 2^64
        hashes = hashes * np.uint64(0x9E3779B97F4A7C15) + bits[k:k + count]
    ordered = np.sort(hashes)
    for value in np.unique(ordered[1:][ordered[1:] == ordered[:-1]]):
        starts = np.flatnonzero(hashes == value)
        for j in starts[1:]:
            if np.array_equal(x[starts[0]:starts[0] + length], x[j:j + length]):
                return int(starts[0]), int(j)
    return None


def record_secure_draws(aggregator) -> list:
    """The list the secure ``aggregator``'s generator appends each draw of N(0, 1) values to
    as it hands them out."""
    draws, draw = [], aggregator.rng.standard_normal

    def recorded(size):
        values = draw(size)
        draws.append(np.array(values, dtype=np.float64))  # a copy: the backend may scale its own
        return values

    aggregator.rng.standard_normal = recorded
    return draws
