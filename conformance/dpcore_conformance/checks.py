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


def matched_fraction(z, drawn, tolerance: float) -> float:
    """The fraction of the values ``z`` that lie within ``tolerance`` of one of ``drawn``."""
    return _matched(np.ravel(z), np.sort(np.ravel(drawn)), tolerance)


def _matched(z, ordered, tolerance: float) -> float:
    if ordered.size == 0:  # nothing was drawn: nothing matches
        return 0.0
    return float(np.mean(np.abs(z - _nearest(z, ordered)) < tolerance))


def _nearest(values, ordered):
    """The value of the sorted array ``ordered`` nearest to each of ``values``."""
    if ordered.size == 1:
        return np.full_like(values, ordered[0])
    at = np.clip(np.searchsorted(ordered, values), 1, ordered.size - 1)
    left, right = ordered[at - 1], ordered[at]
    return np.where(values - left < right - values, left, right)


def scale_of_draws(z, drawn, share: float = 0.99, tolerance: float = 1e-5, probes: int = 64):
    """The factor c for which at least ``share`` of the values z / c lie within ``tolerance``
    of one of the values ``drawn``, or None when there is none: noise that is the draws
    mis-scaled has such a c (1 when it is the draws), noise from another generator, or the
    draws transformed otherwise, has none.

    When z is c times some of the draws, its largest value in magnitude is c times one of
    them, so c is among its ratios to every draw; each ratio c with 1e-3 <= |c| <= 1e3 is
    tried on ``probes`` of the values, the best then refined as the median ratio of the
    matched pairs and checked on all of them. (Trying only the largest draws missed c for a
    small group, whose largest value need not be c times one of the step's largest draws; a
    ratio to a draw near 0 makes every z / c near 0, within the tolerance of a draw near 0.)"""
    z, drawn = np.ravel(z), np.ravel(drawn)
    top = z[np.argmax(np.abs(z))] if z.size else 0.0
    if top == 0 or drawn.size == 0:
        return None
    ordered = np.sort(drawn)
    probe = z[np.linspace(0, z.size - 1, min(z.size, probes)).astype(int)]
    tried = top / drawn[drawn != 0]
    tried = tried[(np.abs(tried) >= 1e-3) & (np.abs(tried) <= 1e3)]
    if tried.size == 0:
        return None
    scaled = probe[None, :] / tried[:, None]  # (candidates, probes)
    near = np.abs(scaled - _nearest(scaled.ravel(), ordered).reshape(scaled.shape)) < tolerance
    shares = near.mean(axis=1)
    if shares.max() < share:
        return None
    partner = _nearest(z / tried[int(np.argmax(shares))], ordered)
    pairs = np.abs(partner) > 0.5  # ratios to large draws: the least rounding
    if not pairs.any():
        pairs = partner != 0
    c = float(np.median(z[pairs] / partner[pairs]))
    return c if _matched(z / c, ordered, tolerance) >= share else None
