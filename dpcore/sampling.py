"""Poisson sampling of records: each of n records enters a sample independently with
probability q, so the sample size is Binomial(n, q) and may be zero. This is the sampling the
accountants' amplification analysis assumes; shuffled fixed-size batches are not.
"""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np

from . import _validation as check


def steps_per_epoch(q: float) -> int:
    """Steps that visit n records in expectation at rate ``q``: round(1 / q), halves rounded
    up (q = 0.4: 3 steps), and at least 1. Every backend's epochs follow this rule."""
    return max(1, math.floor(1 / check.probability("q", q) + 0.5))


def poisson_sample(n: int, q: float, rng: np.random.Generator) -> np.ndarray:
    """Sorted indices of one Poisson sample of ``range(n)`` with rate ``q``.

    Drawn as a Binomial(n, q) size then a uniform subset of that size, which has exactly the
    distribution of n independent Bernoulli(q) trials at O(size) rather than O(n) cost.
    """
    n = check.count("n", n)
    q = check.probability("q", q)
    size = int(rng.binomial(n, q))
    return np.sort(rng.choice(n, size=size, replace=False, shuffle=False))


class PoissonSampler:
    """An endless (or ``steps``-long) stream of Poisson samples of ``range(n)``.

    ``seed`` fixes the stream for tests; ``None`` draws it from OS entropy. ``expected_size``
    is q n, the public denominator of private averages.
    """

    def __init__(self, n: int, q: float, *, seed: int | np.random.SeedSequence | None = None,
                 steps: int | None = None):
        self.n = check.count("n", n)
        self.q = check.probability("q", q)
        self.steps = None if steps is None else check.count("steps", steps)
        self.seeded = seed is not None  # its stream repeats whenever it is made again
        self._rng = np.random.default_rng(seed)

    @property
    def expected_size(self) -> float:
        return self.q * self.n

    def sample(self) -> np.ndarray:
        return poisson_sample(self.n, self.q, self._rng)

    def __iter__(self) -> Iterator[np.ndarray]:
        taken = 0
        while self.steps is None or taken < self.steps:
            yield self.sample()
            taken += 1

    def __len__(self) -> int:
        if self.steps is None:
            raise TypeError("an endless PoissonSampler has no length; pass steps=")
        return self.steps


class Buckets:
    """Padded sample sizes for compiled steps: multiples of ``granularity`` (at least one
    bucket, even for an empty sample); ``multiple_of`` (a chunk size, the number of
    accumulation steps) divides every bucket.

    A Poisson sample has Binomial(n, q) size: mean q n, standard deviation
    s = sqrt(q n (1 - q)). Compiling one program per realised size would recompile almost every
    step, so each sample is padded up to the next multiple of a granularity k. Sizes stay
    within q n +- 4 s except with probability < 1e-4 per step, so about 8 s / k + 1 buckets
    occur; the default k = ceil(s / 2) (``granularity=None``, rounded up to a multiple of
    ``multiple_of``) gives about 17 shapes at an average padding of k / 2 = s / 4 rows, which
    for q n = 256 is 4 rows (1.5%)."""

    def __init__(self, expected_size: float, q: float = 0.0, *, granularity: int | None = None,
                 multiple_of: int = 1):
        expected_size = check.positive("expected_size", expected_size)
        q = check.probability("q", q, allow_zero=True)
        self.multiple_of = check.count("multiple_of", multiple_of, minimum=1)
        if granularity is None:
            spread = math.sqrt(expected_size * (1.0 - q))
            granularity = max(1, math.ceil(spread / 2))
        granularity = check.count("granularity", granularity, minimum=1)
        self.granularity = math.ceil(granularity / self.multiple_of) * self.multiple_of

    def size_for(self, rows: int) -> int:
        """The bucket for a sample of ``rows`` records: the smallest multiple of the
        granularity that holds them (one granularity for an empty sample)."""
        rows = check.count("rows", rows)
        return max(1, math.ceil(rows / self.granularity)) * self.granularity

    def __repr__(self) -> str:
        return f"Buckets(granularity={self.granularity})"
