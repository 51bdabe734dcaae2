"""Noise draws that backends add their clipped sums into (dpcore.noise, NumPy backend): the noise
the ledger records, leaf by leaf; the exact sums; only the current step's own draws released."""

import numpy as np
import pytest

from dpcore import Group, Mechanism, PrivateAggregator, QuantileClipping, read_ledger
from dpcore.ledger import SumQueryEvent
from dpcore.noise import SHARED_DRAW, SHARED_TOTAL
from dpcore.numpy_backend import NumpyBackend

MECHANISM = Mechanism((
    Group("dense", ("w", "b", "c", "s"), clip=1.0, noise_std=3.0),
    Group("joint", ("m",), clip=0.5, noise_std=2.0, scales=(4.0,)),
))
# w and m are drawn on their own, b, c and s (below SHARED_DRAW values) share one draw
LIKE = {"w": np.zeros((400, 400)), "b": np.zeros(5000), "c": np.zeros((60, 50)),
        "s": np.zeros(()), "m": np.zeros(2 * SHARED_DRAW)}


def aggregator(mechanism=MECHANISM, **kwargs):
    agg = PrivateAggregator(mechanism, n=1000, q=0.02, seed=0, **kwargs)
    agg.begin_step()
    return agg


def test_every_leaf_gets_the_noise_the_ledger_records_independently(tmp_path):
    agg = PrivateAggregator(MECHANISM, n=1000, q=0.02, ledger=tmp_path / "l.jsonl", seed=0)
    steps = []
    for _ in range(6):
        agg.begin_step()
        steps.append(agg.release_noisy_sums(agg.noise_draws(LIKE)))
    agg.ledger.close()
    recorded = {e.group: e.noise_std for e in read_ledger(tmp_path / "l.jsonl").events
                if isinstance(e, SumQueryEvent)}
    stds = {"w": recorded["dense"], "b": recorded["dense"], "c": recorded["dense"],
            "s": recorded["dense"],
            "m": 4.0 * recorded["joint"]}  # alpha_j sigma~_g
    noise = {leaf: np.stack([s[leaf].ravel() for s in steps]) * agg.expected_size
             for leaf in stds}
    for leaf in ("w", "b", "c", "m"):
        # >= 30,000 draws: the sample std has relative standard error <= 0.41%, so a 3%
        # tolerance is > 7 of those and still catches a 10% error
        assert np.std(noise[leaf]) == pytest.approx(stds[leaf], rel=0.03), leaf
        assert abs(np.mean(noise[leaf])) < 5 * stds[leaf] / np.sqrt(noise[leaf].size), leaf
    scalars = noise["s"].ravel() / stds["s"]  # six standard normals
    assert np.all(np.abs(scalars) < 6) and len(set(scalars)) == 6
    # disjoint pieces of a shared draw, and fresh draws at every step: uncorrelated
    pairs = [(noise["w"][0, :5000], noise["b"][0]), (noise["b"][0, :3000], noise["c"][0]),
             (noise["b"][0], noise["b"][1]),
             (noise["w"][0], noise["w"][1]), (noise["m"][0], noise["m"][1])]
    for a, b in pairs:
        assert abs(np.corrcoef(a, b)[0, 1]) < 5 / np.sqrt(a.size)


def test_released_values_are_the_sums_added_into_the_noise_over_q_n():
    rng = np.random.default_rng(1)
    sums = {leaf: rng.normal(size=like.shape) for leaf, like in LIKE.items()}
    agg = aggregator()
    draws = agg.noise_draws(LIKE)
    noise = {leaf: np.array(draws[leaf], copy=True) for leaf in ("b", "m")}  # drawn now
    for leaf in ("b", "m", "s"):
        draws[leaf] += sums[leaf]
    out = agg.release_noisy_sums(draws)
    assert set(out) == set(LIKE)
    for leaf in ("b", "m"):
        np.testing.assert_allclose(out[leaf], (sums[leaf] + noise[leaf]) / 20.0, rtol=1e-12)
    assert out["s"].shape == () and out["w"].shape == (400, 400)
    # w never accessed: drawn at release, noise only (160,000 draws: 3% is > 6 standard errors)
    assert np.std(out["w"] * 20.0) == pytest.approx(3.0, rel=0.03)


def test_zero_noise_releases_exact_averages_and_draws_nothing():
    mechanism = Mechanism((Group("all", tuple(LIKE), clip=1.0, noise_std=0.0),))
    agg = aggregator(mechanism)
    state = agg.rng.bit_generator.state
    draws = agg.noise_draws(LIKE)
    for leaf, like in LIKE.items():
        draws[leaf] += np.full(like.shape, 3.0)
    out = agg.release_noisy_sums(draws)
    assert agg.rng.bit_generator.state == state
    for leaf, like in LIKE.items():
        np.testing.assert_array_equal(out[leaf], np.full(like.shape, 3.0 / 20.0))


def test_draws_without_noise_are_zeros_and_record_the_noise_another_process_adds():
    """A process of several whose sums another's noise covers: its draws are zeros, its
    generator does not move, and its ledger records the same events as the one drawing."""
    drawing, silent = aggregator(), aggregator()
    state = silent.rng.bit_generator.state
    draws = silent.noise_draws(LIKE, noise=False)
    draws["b"] += np.full(5000, 3.0)
    out = silent.release_noisy_sums(draws)
    assert silent.rng.bit_generator.state == state
    np.testing.assert_array_equal(out["b"], np.full(5000, 3.0 / 20.0))
    for leaf, like in LIKE.items():
        if leaf != "b":
            np.testing.assert_array_equal(out[leaf], np.zeros(like.shape))
    drawing.release_noisy_sums(drawing.noise_draws(LIKE))
    assert silent.ledger.events == drawing.ledger.events and len(silent.ledger.events) == 3


def test_ledger_records_the_same_events_as_release_sums(tmp_path):
    events = []
    for name, release in (("sums", lambda a: a.release_sums(dict(LIKE))),
                          ("draws", lambda a: a.release_noisy_sums(a.noise_draws(LIKE)))):
        agg = PrivateAggregator(MECHANISM, n=1000, q=0.02, ledger=tmp_path / f"{name}.jsonl")
        agg.begin_step()
        release(agg)
        agg.ledger.close()
        events.append(read_ledger(tmp_path / f"{name}.jsonl").events)
    assert events[0] == events[1] and len(events[0]) == 3


def test_only_this_steps_own_draws_are_released_once():
    agg = aggregator()
    with pytest.raises(TypeError, match="NoiseDraws"):
        agg.release_noisy_sums({leaf: np.zeros(like.shape) for leaf, like in LIKE.items()})
    with pytest.raises(TypeError, match="NoiseDraws"):
        agg.release_noisy_sums(aggregator().noise_draws(LIKE))
    stale = agg.noise_draws(LIKE)
    agg.begin_step()
    with pytest.raises(ValueError, match="belong to step 0.*current step is 1"):
        agg.release_noisy_sums(stale)
    draws = agg.noise_draws(LIKE)
    agg.release_noisy_sums(draws)
    with pytest.raises(ValueError, match="released already"):
        agg.release_noisy_sums(draws)
    with pytest.raises(ValueError, match="leaves"):
        agg.noise_draws({"w": LIKE["w"]})
    with pytest.raises(RuntimeError, match="begin_step"):
        PrivateAggregator(MECHANISM, n=10, q=0.5).noise_draws(LIKE)


class ReadOnlyNoise(NumpyBackend):
    def standard_normal(self, rng, shape, like):
        rng, out = super().standard_normal(rng, shape, like)
        out.flags.writeable = False
        return rng, out


def test_read_only_arrays_are_refused():
    agg = PrivateAggregator(MECHANISM, n=1000, q=0.02, backend=ReadOnlyNoise())
    agg.begin_step()
    with pytest.raises(TypeError, match="writeable"):
        agg.noise_draws(LIKE)["w"]


def test_adaptive_clipping_learns_the_quantile_through_the_draws():
    """As tests/test_adaptive.py's linear-update case, released through noise draws."""
    norms = np.random.default_rng(5).uniform(0, 2, size=1000)
    config = QuantileClipping(target_quantile=0.9, learning_rate=0.05, update="linear",
                              count_noise_std=0.0)
    mechanism = Mechanism((Group("all", ("x",), clip=0.1, noise_std=0.0),))
    agg = PrivateAggregator(mechanism, n=1000, q=0.05, clipping=config, seed=6)
    agg.begin_step()
    with pytest.raises(ValueError, match="clip factors"):
        agg.release_noisy_sums(agg.noise_draws({"x": np.zeros(1)}))
    for _ in range(300):
        batch = norms[agg.sample(), None]
        factors = agg.clip_factors(batch ** 2)
        draws = agg.noise_draws({"x": np.zeros(1)})
        draws["x"] += factors[:, 0] @ batch
        agg.release_noisy_sums(draws, factors=factors)
    assert agg.mechanism.groups[0].clip == pytest.approx(1.8, rel=0.10)


def test_small_leaves_share_draws_of_bounded_size(monkeypatch):
    """Leaves below SHARED_DRAW values share one generator call per group of at most
    SHARED_TOTAL values, in the mechanism's order; the first access draws only its group."""
    size = SHARED_DRAW - 1
    per_group = SHARED_TOTAL // size
    like = {f"l{k}": np.zeros(size) for k in range(per_group + 2)}
    agg = aggregator(Mechanism((Group("all", tuple(like), clip=1.0, noise_std=1.0),)))
    calls = []
    draw = agg.standard_normal

    def counted(rng, shape, like_):
        calls.append(shape)
        return draw(rng, shape, like_)

    monkeypatch.setattr(agg, "standard_normal", counted)
    draws = agg.noise_draws(like)
    first = np.array(draws["l0"], copy=True)
    assert calls == [(per_group * size,)]
    draws[f"l{per_group - 1}"]  # the same group: nothing drawn
    assert calls == [(per_group * size,)]
    draws[f"l{per_group + 1}"]
    assert calls == [(per_group * size,), (2 * size,)]
    out = agg.release_noisy_sums(draws)
    assert len(calls) == 2 and np.allclose(out["l0"] * agg.expected_size, first)


def test_a_draw_cannot_be_replaced():
    draws = aggregator().noise_draws(LIKE)
    draws["b"] += 1.0  # in place: allowed
    with pytest.raises(TypeError, match="drop its noise"):
        draws["b"] = np.zeros(5000)
    with pytest.raises(TypeError, match="drop its noise"):
        draws["w"] = np.zeros((400, 400))  # not drawn yet
