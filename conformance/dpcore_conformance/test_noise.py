"""The backend's generator: standard-normal noise of the right law, fresh at every draw, seeded
streams that reproduce and differ, OS entropy by default.

Tolerances are derived from the sample size N = 200,000: the sample standard deviation of N
standard normals has relative standard error 1/sqrt(2N) = 0.16%, the mean has standard error
1/sqrt(N) = 0.0022, and the correlation of two independent samples has standard error
1/sqrt(N). A 2% tolerance on the standard deviation is 12 standard errors (no false alarm with a
fixed seed) and a 10% error is 63 of them.
"""

import numpy as np
import pytest
from scipy import stats

N = 200_000


def draw(backend, convert, rng, n=N):
    rng, noise = backend.standard_normal(rng, (n,), convert(np.zeros(1)))
    return rng, convert.numpy(noise)


def test_noise_has_unit_standard_deviation_and_zero_mean(backend, convert):
    _, x = draw(backend, convert, backend.rng(1234))
    assert x.std() == pytest.approx(1.0, rel=0.02), "noise standard deviation is not 1"
    assert abs(x.mean()) < 5 / np.sqrt(N), "noise mean is not 0"


def test_noise_is_normal(backend, convert):
    _, x = draw(backend, convert, backend.rng(4321))
    # Kolmogorov-Smirnov against N(0, 1): a correct generator fails with probability 1e-6.
    assert stats.kstest(x, "norm").pvalue > 1e-6


def test_noise_has_the_requested_shape_dtype_and_device(backend, convert):
    like = convert(np.zeros((2, 3)))
    _, noise = backend.standard_normal(backend.rng(0), (4, 5, 2), like)
    assert tuple(noise.shape) == (4, 5, 2)
    assert noise.dtype == like.dtype


def test_fresh_noise_at_every_draw(backend, convert):
    rng, a = draw(backend, convert, backend.rng(99))
    rng, b = draw(backend, convert, rng)
    assert not np.array_equal(a, b), "the generator returned the same noise twice"
    assert abs(np.corrcoef(a, b)[0, 1]) < 5 / np.sqrt(N), "consecutive draws are correlated"


def test_seeds_reproduce_and_differ(backend, convert):
    _, a = draw(backend, convert, backend.rng(7), 1000)
    _, b = draw(backend, convert, backend.rng(7), 1000)
    _, c = draw(backend, convert, backend.rng(8), 1000)
    np.testing.assert_array_equal(a, b, err_msg="the same seed gave different noise")
    assert not np.array_equal(a, c), "different seeds gave the same noise"


def test_unseeded_generators_differ(backend, convert):
    _, a = draw(backend, convert, backend.rng(None), 1000)
    _, b = draw(backend, convert, backend.rng(None), 1000)
    assert not np.array_equal(a, b), "rng(None) must draw its seed from OS entropy"
