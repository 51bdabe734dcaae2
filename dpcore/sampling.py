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
