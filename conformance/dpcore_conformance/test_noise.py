"""The backend's generator: standard-normal noise of the right law (in float32, float64 and
float16, where the backend has arrays of that dtype), fresh at every draw, in an array the
caller owns, seeded streams that reproduce and differ, OS entropy by default.

The law is checked on one draw of N = 2^22 values per dtype, shared by four checks: the sample
standard deviation has relative standard error 1/sqrt(2N) = 0.035% (tolerance 7 of them,
0.24%), the mean standard error 1/sqrt(N) (tolerance 6); the Kolmogorov-Smirnov test has
p > 1e-6; the count of |z| > 4 is Poisson-like with mean N P(|z| > 4) = 265.7 and standard
deviation 16.3 (tolerance 6 of them: [168, 363]; noise truncated at 4 sigma gives 0, as
JAX's float16 normal, drawn from float16 uniforms, did); and no run of 8 consecutive values
occurs twice (a correct generator repeats one with probability below 2^-80; a generator that
cycles with any period below N repeats all of them). The shape checks (normality, tails)
standardise the draw by its own standard deviation, so that noise of the wrong scale fails
the standard-deviation check alone, which names the scale (estimating the scale makes
Kolmogorov-Smirnov's p-values larger, the test more lenient: a correct generator still
fails it with probability below 1e-6).
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
    """Kolmogorov-Smirnov of the draw over its own standard deviation against N(0, 1): a
    correct generator fails with probability below 1e-6; Laplace or uniform noise of any
    scale fails (their distance from the normal is 0.03 or more, 4 million values detect
    0.0015)."""
    distance, p = ks_normal(big_draw / big_draw.std())
    assert p > 1e-6, (f"noise is not Gaussian: Kolmogorov-Smirnov distance {distance:.5f} in {N} "
                      f"draws standardised by their std ({big_draw.std():.4f}), p = {p:.2g} "
                      f"(required > 1e-6)")


def test_noise_has_normal_tails(big_draw):
    """The count of values beyond TAIL of the draw's own standard deviations (see the
    module's docstring)."""
    count = int(np.sum(np.abs(big_draw) > TAIL * big_draw.std()))
    bound = 6 * np.sqrt(TAIL_MEAN)
    assert abs(count - TAIL_MEAN) < bound, (
        f"{count} draws of {N} lie beyond {TAIL} of their standard deviations, expected "
        f"{TAIL_MEAN:.0f} +- {bound:.0f} (truncated or heavy-tailed noise)")


def test_noise_does_not_cycle(big_draw):
    repeat = repeated_run(big_draw, RUN)
    assert repeat is None, (
        f"the {RUN} values at {repeat[0]} reappear at {repeat[1]} of one draw of {N}: the "
        f"generator cycles (period {repeat[1] - repeat[0]}?)")


def test_noise_values_are_uncorrelated_within_a_draw(big_draw):
    """Correlation of the draw with itself shifted by 1, 2 and N/2 values, each within 6
    standard errors 6/sqrt(N) (0.3%) of 0: values made from their neighbours (correlation
    0.5 acts like noise of a 1.7 times smaller standard deviation) or a second half that
    mirrors the first (which cancels in a sum) fail."""
    bound = 6 / np.sqrt(N)
    for lag in (1, 2, N // 2):
        corr = float(np.mean(big_draw[:-lag] * big_draw[lag:]))
        assert abs(corr) < bound, (
            f"noise values {lag} apart have correlation {corr:.4f}, expected 0 +- {bound:.4f}")


def test_noise_has_the_precision_of_its_dtype(big_draw, request):
    """Noise drawn in a coarser dtype and converted lies on that dtype's grid, which shows
    the sum it was added to: float64 noise exactly a float32, float32 noise exactly a float16
    (bfloat16 values of N(0, 1) draws are float16 values too). A correct generator puts about
    N 2^-29 (float64) or N 2^-13 = 512 (float32) values there; the bound is 1% of them."""
    coarser = {"float64": np.float32, "float32": np.float16}.get(request.node.callspec.params[
        "big_draw"])
    if coarser is None:
        pytest.skip("no coarser dtype to check float16 noise against")
    with np.errstate(over="ignore"):
        on_grid = float(np.mean(big_draw.astype(coarser).astype(np.float64) == big_draw))
    assert on_grid < 0.01, (
        f"{on_grid:.1%} of the noise values are exactly {np.dtype(coarser).name} values: the "
        f"noise was drawn in a coarser dtype than its own")


def test_generators_keep_streams_of_their_own(backend, convert):
    """Two generators drawn from in turn give what each gives alone: a generator that keeps
    its state in the framework's global one (re-seeding it) is disturbed by any other draw,
    and by the user's own global seeding."""
    def alone(seed):
        rng, out = backend.rng(seed), []
        for _ in range(3):
            rng, noise = backend.standard_normal(rng, (100,), convert(np.zeros(1)))
            out.append(convert.numpy(noise))
        return out

    rngs, turns = [backend.rng(21), backend.rng(22)], {21: [], 22: []}
    for _ in range(3):
        for k, seed in enumerate((21, 22)):
            rngs[k], noise = backend.standard_normal(rngs[k], (100,), convert(np.zeros(1)))
            turns[seed].append(convert.numpy(noise))
    for seed in (21, 22):
        np.testing.assert_array_equal(np.concatenate(turns[seed]), np.concatenate(alone(seed)),
                                      err_msg=f"generator {seed} drew otherwise while another "
                                      f"generator drew in turn with it")


def test_shaped_draws_have_the_law_in_every_row(backend, convert):
    """A (512, 512) draw (the core draws shaped arrays for large leaves): standard deviation
    within 7 standard errors (0.97%), no two rows equal, rows uncorrelated (6/sqrt(512))."""
    _, noise = backend.standard_normal(backend.rng(31), (512, 512), convert(np.zeros((1, 1))))
    rows = convert.numpy(noise).reshape(512, 512)
    assert abs(rows.std() - 1) < 7 / np.sqrt(2 * rows.size), (
        f"a (512, 512) draw has standard deviation {rows.std():.4f}")
    assert np.unique(rows, axis=0).shape[0] == 512, "rows of a shaped draw repeat"
    corr = float(np.mean(rows[:-1] * rows[1:]))
    assert abs(corr) < 6 / np.sqrt(rows.size), (
        f"neighbouring rows of a shaped draw have correlation {corr:.4f}")


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


SMALL_DRAWS, SMALL = 4096, 8


def test_no_small_draw_repeats(backend, convert, seed=98):
    """SMALL_DRAWS draws of SMALL values from one generator, concatenated: no run of SMALL
    consecutive values occurs twice (found by hashing every run). A generator that hands out
    a pool of draws per shape, or cycles, with any period below SMALL_DRAWS draws (4,095 of
    them) repeats a whole draw; ten draws of a large shape see periods up to 9 only. A
    correct generator repeats a run of 8 float32 values among 32,761 with probability below
    2^-160."""
    rng, draws = backend.rng(seed), []
    like = convert(np.zeros(1))
    for _ in range(SMALL_DRAWS):
        rng, noise = backend.standard_normal(rng, (SMALL,), like)
        draws.append(convert.numpy(noise))
    x = np.concatenate(draws)
    repeat = repeated_run(x, SMALL)
    assert repeat is None, (
        f"draws of shape ({SMALL},) repeat: the {SMALL} values at {repeat[0]} reappear at "
        f"{repeat[1]} of {SMALL_DRAWS} draws concatenated (a pool or cycle of "
        f"{(repeat[1] - repeat[0]) / SMALL:g} draws?)")


def test_seeds_reproduce_and_differ(backend, convert):
    np.testing.assert_array_equal(draw(backend, convert, 7, 1000), draw(backend, convert, 7, 1000),
                                  err_msg="the same seed gave different noise")
    assert not np.array_equal(draw(backend, convert, 7, 1000), draw(backend, convert, 8, 1000)), (
        "different seeds gave the same noise")


def test_unseeded_generators_differ(backend, convert):
    a, b = draw(backend, convert, None, 1000), draw(backend, convert, None, 1000)
    assert not np.array_equal(a, b), "rng(None) must draw its seed from OS entropy"
