"""Aggregation kernels on every installed Array API namespace against a float64 NumPy oracle."""

import math

import numpy as np
import pytest

from dpcore import aggregation
from dpcore.queries import Group, Mechanism

SHAPES = {"w": (3, 4), "b": (4,), "m": (2, 2, 2), "s": (5,)}
MECHANISM = Mechanism((
    Group("dense", ("w", "b"), clip=1.0, noise_std=0.5),
    Group("joint", ("m", "s"), clip=2.0, noise_std=1.0, scales=(0.5, 3.0)),
))
LEAVES = MECHANISM.leaves


def records(batch, seed=0):
    """Per-record leaves with norms spread around the clip bounds (some clipped, some not)."""
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.normal(-1.0, 1.0, size=(batch, 1)))
    return {leaf: rng.normal(size=(batch, *shape)) * scale.reshape((batch,) + (1,) * len(shape))
            for leaf, shape in SHAPES.items()}


def oracle_sum(per_record, mechanism, mask=None):
    """One record at a time, float64: scale, concatenate, clip, scale back, sum."""
    batch = next(iter(per_record.values())).shape[0]
    sums = {leaf: np.zeros(v.shape[1:]) for leaf, v in per_record.items()}
    for i in range(batch):
        if mask is not None and not mask[i]:
            continue
        for group in mechanism.groups:
            scaled = np.concatenate([per_record[leaf][i].ravel() / group.scale(leaf)
                                     for leaf in group.leaves])
            norm = np.linalg.norm(scaled)
            factor = 1.0 if norm <= group.clip else group.clip / norm
            for leaf in group.leaves:
                sums[leaf] += factor * per_record[leaf][i]
    return sums


def to_numpy(x):
    return np.from_dlpack(x).astype(np.float64)


def to_xp(xp, per_record):
    return {leaf: xp.asarray(v) for leaf, v in per_record.items()}


def run_kernels(xp, per_record, mask=None, on_nonfinite="raise"):
    arrays = to_xp(xp, per_record)
    sq = aggregation.per_leaf_sq_norms(arrays, LEAVES)
    norms = aggregation.group_norms(sq, MECHANISM, LEAVES)
    xmask = None if mask is None else xp.asarray(mask)
    factors = aggregation.clip_factors(norms, [g.clip for g in MECHANISM.groups], mask=xmask,
                                       on_nonfinite=on_nonfinite)
    zero_rows = None if mask is None and on_nonfinite == "raise" else factors[:, 0] == 0
    sums = aggregation.clipped_sum(arrays, factors, MECHANISM, LEAVES, zero_rows=zero_rows)
    return sq, norms, factors, sums


@pytest.mark.parametrize("batch", [0, 1, 9])
def test_kernels_match_oracle(namespace, batch):
    xp, rtol = namespace
    per_record = records(batch)
    sq, norms, factors, sums = run_kernels(xp, per_record)
    assert sq.shape == (batch, len(LEAVES)) and factors.shape == (batch, 2)
    for j, leaf in enumerate(LEAVES):
        flat = per_record[leaf].reshape(batch, math.prod(SHAPES[leaf]))
        np.testing.assert_allclose(to_numpy(sq)[:, j], (flat ** 2).sum(axis=1), rtol=rtol)
    expected = oracle_sum(per_record, MECHANISM)
    for leaf in LEAVES:
        assert tuple(sums[leaf].shape) == SHAPES[leaf]
        np.testing.assert_allclose(to_numpy(sums[leaf]), expected[leaf], rtol=rtol, atol=rtol)
    if batch:
        assert 0 < to_numpy(factors).min() < 1 and to_numpy(factors).max() == 1  # both regimes


def test_clipped_records_have_norm_at_most_the_bound(namespace):
    xp, rtol = namespace
    per_record = records(50, seed=3)
    _, norms, factors, _ = run_kernels(xp, per_record)
    clipped = to_numpy(norms) * to_numpy(factors)
    bounds = np.array([g.clip for g in MECHANISM.groups])
    assert np.all(clipped <= bounds * (1 + rtol))


def test_padded_rows_are_ignored_even_when_they_hold_nan(namespace):
    xp, rtol = namespace
    per_record = records(6, seed=1)
    mask = np.array([True, False, True, True, False, True])
    for v in per_record.values():
        v[~mask] = np.nan
    _, _, factors, sums = run_kernels(xp, per_record, mask=mask)
    real = {leaf: v[mask] for leaf, v in per_record.items()}
    expected = oracle_sum(real, MECHANISM)
    for leaf in LEAVES:
        np.testing.assert_allclose(to_numpy(sums[leaf]), expected[leaf], rtol=rtol, atol=rtol)
    assert np.all(to_numpy(factors)[~mask] == 0)


def test_nonfinite_norm_raises_naming_the_record(namespace):
    xp, _ = namespace
    per_record = records(5, seed=2)
    per_record["b"][3, 0] = np.inf
    with pytest.raises(aggregation.NonFiniteNormError, match=r"records \[3\]"):
        run_kernels(xp, per_record)


def test_nonfinite_norm_dropped_on_request(namespace):
    xp, rtol = namespace
    per_record = records(5, seed=2)
    per_record["m"][1, 0, 0, 0] = np.nan
    _, _, factors, sums = run_kernels(xp, per_record, on_nonfinite="drop")
    keep = np.array([True, False, True, True, True])
    expected = oracle_sum({leaf: v[keep] for leaf, v in per_record.items()}, MECHANISM)
    assert np.all(to_numpy(factors)[1] == 0)
    for leaf in LEAVES:
        np.testing.assert_allclose(to_numpy(sums[leaf]), expected[leaf], rtol=rtol, atol=rtol)


def test_group_weights_divide_by_squared_scales():
    weights = aggregation.group_weights(MECHANISM, LEAVES)
    np.testing.assert_array_equal(weights, [[1, 0], [1, 0], [0, 4], [0, 1 / 9]])


def test_leaves_need_a_common_record_dimension():
    per_record = records(4)
    per_record["b"] = per_record["b"][:3]
    with pytest.raises(ValueError, match="leaf 'b' has 3 records"):
        aggregation.per_leaf_sq_norms(per_record, LEAVES)


def test_bad_policy_and_divisor_are_rejected():
    with pytest.raises(ValueError, match="on_nonfinite"):
        aggregation.clip_factors(np.ones((1, 1)), [1.0], on_nonfinite="ignore")
    with pytest.raises(ValueError, match="q\\*n must be > 0, got 0"):
        aggregation.noisy_average({"w": np.ones(2)}, MECHANISM, None, None, 0.0)


def test_joint_clipping_example_of_the_paper():
    """McMahan & Andrew (2018): ||v1|| <= 1, ||v2|| <= 100, one of them zero in every record,
    alpha = (1, 100), sigma_g = 0.01, S = 1: nothing is clipped, v1 gets noise 0.01 and v2
    gets noise 1 on the sum."""
    rng = np.random.default_rng(7)
    batch = 200
    v1 = rng.normal(size=(batch, 10))
    v1 *= rng.uniform(0, 1, size=(batch, 1)) / np.linalg.norm(v1, axis=1, keepdims=True)
    v2 = rng.normal(size=(batch, 10))
    v2 *= rng.uniform(0, 100, size=(batch, 1)) / np.linalg.norm(v2, axis=1, keepdims=True)
    first = rng.random(batch) < 0.5
    v1[~first] = 0
    v2[first] = 0
    mechanism = Mechanism((Group("joint", ("v1", "v2"), clip=1.0, noise_std=0.01,
                                 scales=(1.0, 100.0)),))
    per_record = {"v1": v1, "v2": v2}
    norms = aggregation.group_norms(aggregation.per_leaf_sq_norms(per_record, ("v1", "v2")),
                                    mechanism, ("v1", "v2"))
    factors = aggregation.clip_factors(norms, [1.0])
    assert np.all(factors == 1.0)  # no record clipped
    sums = aggregation.clipped_sum(per_record, factors, mechanism, ("v1", "v2"))
    np.testing.assert_allclose(sums["v1"], v1.sum(axis=0), rtol=1e-12)
    np.testing.assert_allclose(sums["v2"], v2.sum(axis=0), rtol=1e-12)
    assert aggregation.leaf_noise_stds(mechanism) == {"v1": 0.01, "v2": 1.0}
    assert mechanism.noise_multiplier == pytest.approx(0.01)
    # The noise actually drawn has those standard deviations (n = 200,000 draws per leaf: the
    # std estimate's relative standard error is 1/sqrt(2n) = 0.16%; 1% tolerance is 6 of them
    # and far below a 10% error).
    zero = {"v1": np.zeros(200_000), "v2": np.zeros(200_000)}
    _, noisy = aggregation.noisy_average(
        zero, mechanism, np.random.default_rng(0),
        lambda rng, shape, like: (rng, rng.standard_normal(shape)), divisor=1.0)
    assert np.std(noisy["v1"]) == pytest.approx(0.01, rel=0.01)
    assert np.std(noisy["v2"]) == pytest.approx(1.0, rel=0.01)
    assert math.isclose(np.corrcoef(noisy["v1"], noisy["v2"])[0, 1], 0, abs_tol=0.01)


def test_noisy_average_on_every_namespace_keeps_shapes_dtypes_and_stds(namespace):
    xp, _ = namespace
    n = 40_000
    sums = {"w": xp.zeros((200, 100)), "b": xp.zeros((n,)), "m": xp.zeros((n,)),
            "s": xp.zeros((n,))}
    rng = np.random.default_rng(0)

    def standard_normal(state, shape, like):
        return state, xp.asarray(state.standard_normal(shape).astype(np.float32),
                                 dtype=like.dtype)

    _, out = aggregation.noisy_average(sums, MECHANISM, rng, standard_normal, divisor=4.0)
    for leaf, total in sums.items():
        assert tuple(out[leaf].shape) == tuple(total.shape) and out[leaf].dtype == total.dtype
    stds = aggregation.leaf_noise_stds(MECHANISM)
    draws = {leaf: to_numpy(v).ravel() for leaf, v in out.items()}
    for leaf, x in draws.items():
        # 20,000+ draws: the sample std has relative standard error <= 0.5%; 3% is 6 of them
        assert x.std() == pytest.approx(stds[leaf] / 4.0, rel=0.03), leaf
    assert abs(np.corrcoef(draws["b"], draws["m"])[0, 1]) < 5 / np.sqrt(n)  # disjoint pieces


@pytest.mark.parametrize("size", [3, aggregation.PER_LEAF_ADD + 1],
                         ids=["concatenated", "leaf-by-leaf"])
def test_noisy_average_values_equal_a_float64_oracle(namespace, size):
    """Non-zero sums, both ways of adding them to the draw (small leaves are concatenated,
    large ones added in place leaf by leaf): every value is (sum + alpha sigma~ z) / divisor
    with z the draw's piece for that leaf, in leaf order."""
    xp, rtol = namespace
    data = np.random.default_rng(5)
    sums = {"w": data.normal(size=(2, size)), "b": data.normal(size=(size,)),
            "m": data.normal(size=(size,)), "s": data.normal(size=(size, 1))}
    z = np.random.default_rng(9).standard_normal(sum(v.size for v in sums.values()))

    def standard_normal(state, shape, like):
        assert shape == z.shape
        return state, xp.asarray(z.copy(), dtype=like.dtype)  # the caller's to modify

    _, out = aggregation.noisy_average(to_xp(xp, sums), MECHANISM, None, standard_normal,
                                       divisor=3.0)
    stds, start = aggregation.leaf_noise_stds(MECHANISM), 0
    for leaf, total in sums.items():
        piece = z[start:start + total.size].reshape(total.shape)
        start += total.size
        np.testing.assert_allclose(to_numpy(out[leaf]), (total + stds[leaf] * piece) / 3.0,
                                   rtol=rtol, atol=rtol)


def test_noisy_average_keeps_scalar_and_higher_rank_leaves(namespace):
    """A 0-d leaf (a scalar parameter) and a 3-d leaf are cut from the draw and shaped back:
    values against a float64 oracle."""
    xp, rtol = namespace
    mechanism = Mechanism(Group("g", ("scalar", "cube"), 1.0, 0.5))
    sums = {"scalar": np.asarray(2.0), "cube": np.arange(24.0).reshape(2, 3, 4)}
    z = np.random.default_rng(3).standard_normal(25)
    _, out = aggregation.noisy_average(to_xp(xp, sums), mechanism, None,
                                       lambda r, shape, like: (r, xp.asarray(z.copy(),
                                                                             dtype=like.dtype)),
                                       divisor=2.0)
    assert tuple(out["scalar"].shape) == () and tuple(out["cube"].shape) == (2, 3, 4)
    np.testing.assert_allclose(to_numpy(out["scalar"]), (2.0 + 0.5 * z[0]) / 2.0, rtol=rtol)
    np.testing.assert_allclose(to_numpy(out["cube"]),
                               (sums["cube"] + 0.5 * z[1:].reshape(2, 3, 4)) / 2.0, rtol=rtol,
                               atol=rtol)


def test_noisy_average_with_leaves_of_two_dtypes():
    sums = {"w": np.ones(3, dtype=np.float32), "b": np.ones(2, dtype=np.float64),
            "m": np.ones(2, dtype=np.float32), "s": np.ones(1, dtype=np.float64)}
    rng = np.random.default_rng(1)
    _, out = aggregation.noisy_average(
        sums, MECHANISM.with_noise([0.0, 0.0]), rng,
        lambda r, shape, like: (r, r.standard_normal(shape).astype(like.dtype)), divisor=2.0)
    assert {k: v.dtype for k, v in out.items()} == {k: v.dtype for k, v in sums.items()}
    assert all(np.all(v == 0.5) for v in out.values())
