"""The backend's generator: standard-normal noise of the right law (in float32, float64 and
float16, where the backend has arrays of that dtype), fresh at every draw, in an array the
caller owns, seeded streams that reproduce and differ, OS entropy by default.

The law is checked on one draw of N = 2^22 values per dtype, shared by four checks: the sample
standard deviation has relative standard error 1/sqrt(2N) = 0.035% (tolerance 7 of them,
0.24%), the mean standard error 1/sqrt(N) (tolerance 6); the Kolmogorov-Smirnov test has
p > 1e-6; the count of |z| > 4 is Poisson-like with mean N P(|z| > 4) = 265.7 and standard
deviation 16.3 (tolerance 6 of them: [168, 363]; noise truncated at 4 sigma gives 0, as
JAX's float16 normal, drawn from float16 uniforms, did); and no run of 8 consecutive values occurs twice (a correct generator repeats
one with probability below 2^-80; a generator that cycles with any period below N repeats all
of them).
"""

import numpy as np
import pytest
from scipy import stats

from .checks import ks_normal, repeated_run
from .plugin import converter

N = 1 << 22
DTYPES = ("float32", "float64", "float16")
TAIL = 4.0
TAIL_MEAN = N * 2 * stats.norm.sf(TAIL)
RUN = 8


@pytest.fixture(scope="module", params=DTYPES)
def big_draw(request, backend):
    return draw(backend, converter(backend, request.param), 1234)


def draw(backend, convert, seed, size=N):
    """``size`` values from ``backend.rng(seed)`` in ``convert``'s dtype, as float64 NumPy."""
    _, noise = backend.standard_normal(backend.rng(seed), (size,), convert(np.zeros(1)))
    return convert.numpy(noise)


def test_noise_has_unit_standard_deviation_and_zero_mean(big_draw):
    std, mean = big_draw.std(), big_draw.mean()
    tolerance = 7 / np.sqrt(2 * N)
    assert abs(std - 1) < tolerance, (
        f"noise standard deviation {std:.5f}, expected 1 +- {tolerance:.4f}")
    assert abs(mean) < 6 / np.sqrt(N), (
        f"noise mean {mean:.5f}, expected 0 +- {6 / np.sqrt(N):.4f}")


def test_noise_is_normal(big_draw):
    # Kolmogorov-Smirnov against N(0, 1): a correct generator fails with probability 1e-6
    distance, p = ks_normal(big_draw)
    assert p > 1e-6, (f"noise is not N(0, 1): Kolmogorov-Smirnov distance {distance:.5f} in {N} "
                      f"draws, p = {p:.2g} (required > 1e-6)")


def test_noise_has_normal_tails(big_draw):
    count = int(np.sum(np.abs(big_draw) > TAIL))
    bound = 6 * np.sqrt(TAIL_MEAN)
    assert abs(count - TAIL_MEAN) < bound, (
        f"{count} draws of {N} have |z| > {TAIL}, expected {TAIL_MEAN:.0f} +- {bound:.0f} "
        f"(truncated or heavy-tailed noise)")


def test_noise_does_not_cycle(big_draw):
    repeat = repeated_run(big_draw, RUN)
    assert repeat is None, (
        f"the {RUN} values at {repeat[0]} reappear at {repeat[1]} of one draw of {N}: the "
        f"generator cycles (period {repeat[1] - repeat[0]}?)")


@pytest.mark.parametrize("dtype", DTYPES)
def test_noise_has_the_requested_shape_dtype_and_device(backend, dtype):
    convert = converter(backend, dtype)
    like = convert(np.zeros((2, 3)))
    _, noise = backend.standard_normal(backend.rng(0), (4, 5, 2), like)
    assert tuple(noise.shape) == (4, 5, 2), f"noise of shape {tuple(noise.shape)}, asked (4, 5, 2)"
    assert noise.dtype == like.dtype, f"noise of dtype {noise.dtype}, asked {like.dtype}"
    device = getattr(like, "device", None)  # the Array API's attribute, where arrays have it
    assert getattr(noise, "device", None) == device, (
        f"noise on device {getattr(noise, 'device', None)}, asked {device}")
    values = np.random.default_rng(0).normal(size=50).astype(dtype)
    back = np.asarray(backend.to_numpy(backend.asarray(values, dtype=dtype)))
    np.testing.assert_array_equal(back, values, err_msg=f"{dtype} values changed by asarray and "
                                  f"to_numpy")


DRAWS, SIZE = 10, 50_000


def test_fresh_noise_at_every_draw(backend, convert, seed=99):
    """DRAWS draws of SIZE values from one generator: no two equal, every pair's correlation
    below 6 standard errors 6/sqrt(SIZE) (45 pairs: a correct generator exceeds it with
    probability 1e-7), and the first draw's array unchanged by the later ones."""
    rng, arrays, draws = backend.rng(seed), [], []
    for _ in range(DRAWS):
        rng, noise = backend.standard_normal(rng, (SIZE,), convert(np.zeros(1)))
        arrays.append(noise)
        draws.append(convert.numpy(noise))
    np.testing.assert_array_equal(convert.numpy(arrays[0]), draws[0], err_msg=(
        "a later draw overwrote the first draw's array: each draw must be a new array"))
    corr = np.corrcoef(draws)
    bound = 6 / np.sqrt(SIZE)
    for i in range(DRAWS):
        for j in range(i + 1, DRAWS):
            assert not np.array_equal(draws[i], draws[j]), f"draws {i} and {j} are equal"
            assert abs(corr[i, j]) < bound, (
                f"draws {i} and {j} have correlation {corr[i, j]:.4f}, expected 0 +- {bound:.4f}")


def test_seeds_reproduce_and_differ(backend, convert):
    np.testing.assert_array_equal(draw(backend, convert, 7, 1000), draw(backend, convert, 7, 1000),
                                  err_msg="the same seed gave different noise")
    assert not np.array_equal(draw(backend, convert, 7, 1000), draw(backend, convert, 8, 1000)), (
        "different seeds gave the same noise")


def test_unseeded_generators_differ(backend, convert):
    a, b = draw(backend, convert, None, 1000), draw(backend, convert, None, 1000)
    assert not np.array_equal(a, b), "rng(None) must draw its seed from OS entropy"
