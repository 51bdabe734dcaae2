"""Adaptive quantile clipping: exact privacy split, the paper's update, convergence."""

import math

import numpy as np
import pytest

from dpcore import PrivateAggregator, flat, per_layer
from dpcore.accounting import epsilon
from dpcore.adaptive import (QuantileClipping, gradient_noise_multiplier, update_clip)
from dpcore.ledger import SamplingEvent, SumQueryEvent

N, Q = 10_000, 0.01  # q n = 100 records a round, default sigma_b = 5


def test_noise_split_gives_back_the_total_multiplier():
    for z, sigma_b, groups in [(1.0, 5.0, 1), (0.7, 2.0, 3), (3.0, 40.0, 2)]:
        z_delta = gradient_noise_multiplier(z, sigma_b, groups)
        assert 1 / z_delta ** 2 + groups / (2 * sigma_b) ** 2 == pytest.approx(1 / z ** 2, rel=1e-12)
    assert gradient_noise_multiplier(0.0, 0.0) == 0.0
    with pytest.raises(ValueError, match=r"1 count\(s\) at sigma_b=0\.4 spend all .*"
                                         r"sigma_b must exceed sqrt\(1\) z / 2 = 0\.5"):
        gradient_noise_multiplier(1.0, 0.4)
    with pytest.raises(ValueError, match="spend all"):
        gradient_noise_multiplier(1.0, 0.0)


@pytest.mark.parametrize("grouping", ["flat", "per_layer"])
def test_ledger_multiplier_of_adaptive_clipping_equals_plain_dpsgd(grouping):
    """Each step of the ledger reduces, by Eq. (1), to exactly the total z: adaptive clipping
    with total multiplier z costs what plain DP-SGD with z costs at the same q and steps."""
    z = 1.1
    if grouping == "flat":
        mechanism = flat(["w", "b"], clip=0.1, noise_multiplier=z)
    else:
        mechanism = per_layer({"w": 6, "b": 2}, total_clip=0.1, noise_multiplier=z)
    agg = PrivateAggregator(mechanism, n=N, q=Q, seed=0, clipping=QuantileClipping())
    rng = np.random.default_rng(0)
    for _ in range(5):
        idx = agg.sample()
        agg.release({"w": rng.normal(size=(len(idx), 6)), "b": rng.normal(size=(len(idx), 2))})
    [step] = agg.ledger.steps()  # one run: the ulps the moving clips add are a tie
    assert step.q == Q and step.count == 5
    assert step.noise_multiplier == pytest.approx(z, rel=1e-12)
    plain = [(Q, z, 5)]
    for accountant in ("rdp", "pld"):
        assert epsilon(agg.ledger, 1e-5, accountant=accountant) == pytest.approx(
            epsilon(plain, 1e-5, accountant=accountant), rel=1e-9)
    counts = [e for e in agg.ledger.events
              if isinstance(e, SumQueryEvent) and e.group.startswith("unclipped_count:")]
    assert len(counts) == 5 * len(mechanism.groups)
    assert all(e.clip == 0.5 and e.noise_std == pytest.approx(Q * N / 20) for e in counts)


def test_sum_uses_the_current_clip_and_the_clip_moves_after():
    config = QuantileClipping(count_noise_std=0.0)
    agg = PrivateAggregator(flat(["x"], clip=0.1, noise_multiplier=0.0), n=100, q=0.5,
                            clipping=config, seed=1)
    agg.begin_step()
    norms = np.array([0.05, 0.2, 0.3, 0.4])  # one of four records unclipped at C = 0.1
    out = agg.release({"x": norms[:, None]})
    assert out["x"][0] == pytest.approx((0.05 + 0.1 * 3) / 50)  # clipped with C_0 = 0.1
    fraction = (1 - 0.5 * 4) / 50 + 0.5  # released centred count / (q n) + 1/2
    expected = 0.1 * math.exp(-0.2 * (fraction - 0.5))
    assert agg.mechanism.groups[0].clip == pytest.approx(0.1)  # the step's own clip
    agg.begin_step()
    assert agg.mechanism.groups[0].clip == pytest.approx(expected)
    agg.release({"x": norms[:, None]})
    first, second = [e for e in agg.ledger.events
                     if isinstance(e, SumQueryEvent) and e.group == "all"]
    assert first.clip == pytest.approx(0.1) and second.clip == pytest.approx(expected)


@pytest.mark.parametrize("count_noise_std", [0.0, None], ids=["no noise", "default noise"])
def test_geometric_estimate_reaches_the_quantile_from_far_below(count_noise_std):
    """Log-normal record norms; from C0 = 0.1 the geometric update reaches the true gamma-quantile
    within 10% in 200 rounds (the paper's claim), without and with the default count noise."""
    gamma, mu, s = 0.5, 0.5, 0.6
    true_quantile = math.exp(mu)  # the median of log-normal(mu, s)
    rng = np.random.default_rng(3)
    norms = np.exp(rng.normal(mu, s, size=N))
    config = QuantileClipping(target_quantile=gamma, count_noise_std=count_noise_std)
    z = 0.0 if count_noise_std == 0.0 else 1.0
    agg = PrivateAggregator(flat(["x"], clip=0.1, noise_multiplier=z), n=N, q=Q,
                            clipping=config, seed=4)
    for _ in range(200):
        idx = agg.sample()
        agg.release({"x": norms[idx, None]})
    assert agg.mechanism.groups[0].clip == pytest.approx(true_quantile, rel=0.10)


def test_other_quantiles_and_linear_update():
    rng = np.random.default_rng(5)
    norms = rng.uniform(0, 2, size=N)
    config = QuantileClipping(target_quantile=0.9, learning_rate=0.05, update="linear",
                              count_noise_std=0.0)
    agg = PrivateAggregator(flat(["x"], clip=0.1, noise_multiplier=0.0), n=N, q=0.05,
                            clipping=config, seed=6)
    for _ in range(300):
        idx = agg.sample()
        agg.release({"x": norms[idx, None]})
    assert agg.mechanism.groups[0].clip == pytest.approx(1.8, rel=0.10)


def test_update_rules():
    geometric = QuantileClipping()
    assert update_clip(1.0, 0.7, geometric) == pytest.approx(math.exp(-0.2 * 0.2))
    linear = QuantileClipping(update="linear", learning_rate=1.0, min_clip=0.01)
    assert update_clip(1.0, 0.7, linear) == pytest.approx(0.8)
    assert update_clip(0.1, 1.0, linear) == 0.01  # never below min_clip


@pytest.mark.parametrize("kwargs, message", [
    (dict(target_quantile=1.5), r"target_quantile must be in \[0, 1\], got 1\.5"),
    (dict(learning_rate=0.0), r"learning_rate must be finite and > 0, got 0\.0"),
    (dict(count_noise_std=-1.0), r"count_noise_std must be finite and >= 0, got -1\.0"),
    (dict(update="cubic"), r"update must be one of \('geometric', 'linear'\), got 'cubic'"),
])
def test_bad_configuration(kwargs, message):
    with pytest.raises(ValueError, match=message):
        QuantileClipping(**kwargs)


def test_release_sums_needs_factors_under_adaptive_clipping():
    agg = PrivateAggregator(flat(["x"], clip=0.1, noise_multiplier=1.0), n=N, q=Q,
                            clipping=QuantileClipping())
    agg.begin_step()
    with pytest.raises(ValueError, match="needs the step's clip factors"):
        agg.release_sums({"x": np.zeros(1)})
    factors = np.ones((3, 1))
    with pytest.raises(ValueError, match=r"booleans or 0/1 .* got \[nan\]"):
        agg.release_sums({"x": np.zeros(1)}, factors=factors, mask=np.array([1, np.nan, 0]))
    assert agg.ledger.events[-1] == SamplingEvent(Q, N)  # nothing released


def test_processes_add_up_their_counts_and_move_the_clips_from_the_sum():
    """Two processes' shares of one sample released with observe=False (the noise, counts'
    included, drawn by one) and added up give the one-process release, and moving the clips
    from the sum (observe_counts) gives the one-process clip."""
    config = QuantileClipping(count_noise_std=2.0)

    def aggregator():
        return PrivateAggregator(flat(["x"], clip=0.1, noise_multiplier=1.0), n=100, q=0.5,
                                 clipping=config, seed=3)

    norms = np.array([0.05, 0.2, 0.08, 0.4, 0.01])
    whole = aggregator()
    whole.begin_step()
    factors = whole.clip_factors(norms[:, None] ** 2)
    draws = whole.noise_draws({"x": np.zeros(1)})
    draws["x"] += (norms * factors[:, 0]).sum(keepdims=True)
    expected = whole.release_noisy_sums(draws, factors=factors)
    shares, total = (norms[:2], norms[2:]), {}
    processes = (aggregator(), aggregator())
    for rank, (agg, share) in enumerate(zip(processes, shares)):
        agg.begin_step()
        factors = agg.clip_factors(share[:, None] ** 2)
        draws = agg.noise_draws({"x": np.zeros(1)}, noise=rank == 0)
        draws["x"] += (share * factors[:, 0]).sum(keepdims=True)
        out = agg.release_noisy_sums(draws, factors=factors, observe=False)
        assert set(out) == {"x", agg.count_groups[0].name}
        assert agg.mechanism.groups[0].clip == 0.1  # not moved yet
        for name, value in out.items():
            total[name] = total.get(name, 0) + value
    np.testing.assert_allclose(total["x"], expected["x"], rtol=1e-12)
    whole.begin_step()
    assert whole.mechanism.groups[0].clip != 0.1
    for agg in processes:
        agg.observe_counts(total)
        agg.begin_step()
        assert agg.mechanism.groups[0].clip == pytest.approx(whole.mechanism.groups[0].clip,
                                                             rel=1e-12)


def test_counts_without_noise_do_not_move_the_clips():
    """Draws with noise=False give counts without noise: moving the clips from them would
    show the exact count in the next step's clip. Refused unless observe=False, before
    anything is recorded."""
    agg = PrivateAggregator(flat(["x"], clip=0.1, noise_multiplier=1.0), n=100, q=0.5,
                            clipping=QuantileClipping(), seed=3)
    agg.begin_step()
    factors = agg.clip_factors(np.array([[0.01], [0.04]]))
    draws = agg.noise_draws({"x": np.zeros(1)}, noise=False)
    with pytest.raises(ValueError, match="release with observe=False"):
        agg.release_noisy_sums(draws, factors=factors)
    assert not any(isinstance(e, SumQueryEvent) for e in agg.ledger.events)
    assert agg.mechanism.groups[0].clip == 0.1


def test_a_negative_number_of_count_groups_is_refused():
    with pytest.raises(ValueError, match="groups must be an integer >= 0, got -1"):
        gradient_noise_multiplier(1.0, 5.0, groups=-1)


def test_a_group_whose_records_are_all_zero_keeps_its_clip_above_min_clip():
    """Every record unclipped, the geometric update shrank the clip by exp(-eta/2) a step,
    into subnormal floats where clip * z_g kept a few bits: the step's z drifted from 1 to
    0.966 and the ledger held 273 distinct values."""
    config = QuantileClipping(learning_rate=5.0)
    assert update_clip(1e-300, 1.0, config) == config.min_clip
    agg = PrivateAggregator(per_layer({"w": 4, "dead": 4}, 1.0, 1.0), n=1000, q=0.1, seed=0,
                            clipping=config)
    rng = np.random.default_rng(0)
    for _ in range(300):
        rows = len(agg.sample())
        agg.release({"w": rng.normal(size=(rows, 4)), "dead": np.zeros((rows, 4))})
    assert agg.mechanism.groups[1].clip == config.min_clip
    assert {round(s.noise_multiplier, 12) for s in agg.ledger.steps()} == {1.0}


def test_a_nan_count_moves_no_clip_and_is_refused():
    """max(min_clip, NaN) set the linear update's clip to 1e-6; the geometric one stored NaN,
    refused only at the next sample() with the ledger a sampling event ahead of the step."""
    for update in ("linear", "geometric"):
        agg = PrivateAggregator(per_layer({"a": 2, "b": 2}, 1.0, 1.0), n=1000, q=0.1, seed=0,
                                clipping=QuantileClipping(update=update))
        clips = list(agg._policy.clips)
        with pytest.raises(FloatingPointError, match=r"counts \['unclipped_count:b'\] are NaN"):
            agg.observe_counts({"unclipped_count:a": np.array([0.1]),
                                "unclipped_count:b": np.array([np.nan])})
        assert agg._policy.clips == clips

