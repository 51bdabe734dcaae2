"""The momentum noise-variance formula against a simulation of the recursion."""

import numpy as np
import pytest

from dpcore.momentum import RECOMMENDED_COEFFICIENT, momentum_noise_variance


@pytest.mark.parametrize("c", [0.0, RECOMMENDED_COEFFICIENT, 0.9])
@pytest.mark.parametrize("t", [1, 3, 50])
def test_formula_matches_the_recursion(c, t):
    rng = np.random.default_rng(0)
    trials, sigma = 200_000, 2.0
    m = np.zeros(trials)
    for _ in range(t):
        m = c * m + rng.normal(0, sigma, size=trials)
    # sample variance of 200,000 normals: relative standard error sqrt(2/N) = 0.32%
    assert m.var() == pytest.approx(momentum_noise_variance(c, t, sigma), rel=0.02)


def test_limits_and_errors():
    assert momentum_noise_variance(0.9, 10_000) == pytest.approx(1 / (1 - 0.81))
    assert momentum_noise_variance(0.6, 1, 3.0) == pytest.approx(9.0)
    with pytest.raises(ValueError, match=r"coefficient must be in \[0, 1\), got 1\.0"):
        momentum_noise_variance(1.0, 5)
    with pytest.raises(ValueError, match="step must be an integer >= 1, got 0"):
        momentum_noise_variance(0.5, 0)
