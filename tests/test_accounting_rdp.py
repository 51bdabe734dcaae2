"""RDP accountant against dp-accounting (test-only oracle) and high-precision quadrature."""

import itertools
import logging
import math
import warnings

import numpy as np
import pytest

from dpcore.accounting.rdp import (DEFAULT_ORDERS, RDPAccountant,
                                   epsilon_from_rdp, rdp_subsampled_gaussian)
from dpcore.ledger import Step

rdp_oracle = pytest.importorskip("dp_accounting.rdp.rdp_privacy_accountant")
logging.getLogger().setLevel(logging.ERROR)  # dp-accounting logs non-converged orders

QS = [1e-4, 0.004, 0.01, 0.1, 1.0]
ZS = [0.5, 0.8, 1.0, 2.0, 5.0, 10.0]
TS = [1, 100, 10**4, 10**5]
DELTAS = [1e-3, 1e-5, 1e-8]
ORACLE_ORDERS = list(rdp_oracle.DEFAULT_RDP_ORDERS)
INTEGER_ORDERS = [a for a in ORACLE_ORDERS if float(a).is_integer()]


def oracle_epsilon(q, z, T, delta, orders):
    acc = rdp_oracle.RdpAccountant(orders)
    from dp_accounting import dp_event
    acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z)), T)
    return acc.get_epsilon_and_optimal_order(delta)


@pytest.mark.parametrize("q,z", list(itertools.product(QS, ZS)))
def test_grid_matches_dp_accounting_on_integer_orders(q, z):
    """The issue's whole grid: relative 1e-6 with the same (integer) orders."""
    ours = rdp_subsampled_gaussian(q, z, INTEGER_ORDERS)
    for T, delta in itertools.product(TS, DELTAS):
        eps, order = epsilon_from_rdp(INTEGER_ORDERS, T * ours, delta)
        ref, ref_order = oracle_epsilon(q, z, T, delta, INTEGER_ORDERS)
        assert eps == pytest.approx(ref, rel=1e-6), (T, delta)
        assert order == ref_order


@pytest.mark.parametrize("q,z", list(itertools.product(QS, ZS)))
def test_grid_with_dp_accounting_default_orders_never_above(q, z):
    """With dp-accounting's own orders (fractional ones included) we agree on every integer
    order and are never above it overall. dp-accounting's series for fractional orders stops
    early and over-estimates them (see the quadrature test below), so there our epsilon can be
    lower, i.e. tighter, never looser."""
    ours = rdp_subsampled_gaussian(q, z, ORACLE_ORDERS)
    theirs = rdp_oracle._compute_rdp_poisson_subsampled_gaussian(q, z, ORACLE_ORDERS)
    integer = np.array([float(a).is_integer() for a in ORACLE_ORDERS])
    np.testing.assert_allclose(ours[integer], theirs[integer], rtol=1e-6)
    finite = np.isfinite(theirs)
    assert np.all(ours[finite] <= theirs[finite] * (1 + 1e-6))
    for T, delta in itertools.product(TS, DELTAS):
        eps, _ = epsilon_from_rdp(ORACLE_ORDERS, T * ours, delta)
        ref, _ = rdp_oracle.compute_epsilon(ORACLE_ORDERS, T * theirs, delta)
        assert eps <= ref * (1 + 1e-6)


def _rdp_by_quadrature(q, z, alpha):
    mp = pytest.importorskip("mpmath")
    mp.mp.dps = 30
    q, z, alpha = mp.mpf(q), mp.mpf(z), mp.mpf(alpha)

    def integrand(x):
        density = mp.exp(-x * x / (2 * z * z)) / (z * mp.sqrt(2 * mp.pi))
        return density * ((1 - q) + q * mp.exp((2 * x - 1) / (2 * z * z))) ** alpha

    x0 = z * z * mp.log(1 / q - 1) + mp.mpf(1) / 2
    points = sorted({-40 * z, -10 * z, mp.mpf(0), x0, x0 + 5 * z, x0 + alpha + 40 * z})
    return float(mp.log(mp.quad(integrand, [-mp.inf] + points + [mp.inf])) / (alpha - 1))


@pytest.mark.parametrize("q,z,alpha", [
    (0.1, 10, 1.1), (0.01, 1, 1.1), (0.1, 1, 1.6), (0.004, 1, 2.5), (0.1, 0.5, 7.3),
    (0.9, 0.5, 10.9), (0.5, 5, 10.9), (0.01, 0.5, 1.05), (0.1, 0.8, 1.2),
])
def test_fractional_orders_match_quadrature(q, z, alpha):
    ours = rdp_subsampled_gaussian(q, z, [alpha])[0]
    assert ours == pytest.approx(_rdp_by_quadrature(q, z, alpha), rel=1e-8)


def test_dp_accounting_overestimates_a_fractional_order():
    """Evidence for the comment above: at q=0.1, z=10, alpha=1.1 dp-accounting is several
    times too large, while we match the quadrature."""
    exact = _rdp_by_quadrature(0.1, 10, 1.1)
    theirs = rdp_oracle._compute_rdp_poisson_subsampled_gaussian(0.1, 10, [1.1])[0]
    assert theirs > 2 * exact
    assert rdp_subsampled_gaussian(0.1, 10, [1.1])[0] == pytest.approx(exact, rel=1e-8)


def test_mnist_example():
    acc = RDPAccountant([(256 / 60000, 1.1, 14063)], orders=ORACLE_ORDERS)
    eps, order = acc.epsilon_and_order(1e-5)
    assert eps == pytest.approx(2.597, abs=5e-4)
    assert order == 8.1
    # our default orders are a superset-like denser set: never worse here
    assert RDPAccountant([(256 / 60000, 1.1, 14063)]).epsilon(1e-5) <= eps + 1e-9


def test_conventions():
    orders = DEFAULT_ORDERS
    assert np.all(rdp_subsampled_gaussian(0.0, 1.0, orders) == 0)
    assert np.all(rdp_subsampled_gaussian(0.3, math.inf, orders) == 0)
    assert np.all(np.isinf(rdp_subsampled_gaussian(0.3, 0.0, orders)))
    np.testing.assert_allclose(rdp_subsampled_gaussian(1.0, 2.0, [2, 3.5]), [2 / 8, 3.5 / 8])
    assert RDPAccountant([(0.0, 1.0, 100)]).epsilon(1e-5) == 0
    assert RDPAccountant([(0.5, math.inf, 100)]).epsilon(1e-5) == 0
    assert RDPAccountant([(0.5, 0.0, 1)]).epsilon(1e-5) == math.inf
    assert RDPAccountant([(0.5, 0.0, 1)]).delta(10.0) == 1.0
    assert RDPAccountant([]).epsilon(1e-5) == 0


@pytest.mark.parametrize("z", [1e100, 1e154, 1e300])
def test_a_huge_noise_multiplier_costs_at_most_the_plain_gaussians_without_warnings(z):
    """z^2 overflowed in the series: NumPy warned (invalid value in subtract) on every call."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        values = rdp_subsampled_gaussian(0.01, z, DEFAULT_ORDERS)
    assert np.all(values >= 0) and np.all(values <= np.asarray(DEFAULT_ORDERS) / (2 * z * z))


@pytest.mark.parametrize("q,z", [(1e-9, 0.3), (1e-6, 100.0), (0.999999, 0.2), (0.5, 1e-3),
                                 (1e-4, 1e4), (0.999, 50.0)])
def test_extreme_arguments_are_finite_and_non_negative(q, z):
    rdp = rdp_subsampled_gaussian(q, z)
    assert not np.any(np.isnan(rdp))
    assert np.all(rdp >= 0)
    gaussian = rdp_subsampled_gaussian(1.0, z)
    assert np.all(rdp <= gaussian * (1 + 1e-9))  # subsampling never costs more


def test_monotone_in_q_and_z():
    qs = [1e-4, 1e-3, 0.01, 0.1, 0.5, 0.9, 1.0]
    for z in [0.5, 1.0, 3.0]:
        rows = [rdp_subsampled_gaussian(q, z) for q in qs]
        assert all(np.all(a <= b * (1 + 1e-9)) for a, b in zip(rows, rows[1:]))
    zs = [0.5, 0.7, 1.0, 2.0, 8.0]
    rows = [rdp_subsampled_gaussian(0.01, z) for z in zs]
    assert all(np.all(a >= b * (1 - 1e-9)) for a, b in zip(rows, rows[1:]))


def test_non_convergent_order_is_infinite_not_zero(monkeypatch):
    from dpcore.accounting import rdp
    monkeypatch.setattr(rdp, "MAX_SERIES_TERMS", 16)
    values = rdp.rdp_subsampled_gaussian(0.1, 0.5, [1.1, 2.0])
    assert values[0] == math.inf
    assert 0 < values[1] < math.inf


def test_delta_and_epsilon_are_consistent():
    acc = RDPAccountant([(0.01, 1.0, 1000)])
    for delta in [1e-3, 1e-6, 1e-10]:
        eps = acc.epsilon(delta)
        assert acc.delta(eps) <= delta * (1 + 1e-9)
        assert acc.delta(eps * 0.99) > delta
    ref_delta, _ = rdp_oracle.compute_delta(
        list(DEFAULT_ORDERS), list(acc.rdp), 2.0)
    assert acc.delta(2.0) == pytest.approx(ref_delta, rel=1e-9)


def test_steps_accumulate():
    one = RDPAccountant([Step(0.01, 1.0, 300), Step(0.02, 2.0, 100)])
    two = RDPAccountant([(0.02, 2.0, 100)]).compose([(0.01, 1.0, 100)]).compose([(0.01, 1.0, 200)])
    np.testing.assert_allclose(one.rdp, two.rdp, rtol=1e-12)
    assert one.steps == two.steps == 400


@pytest.mark.parametrize("bad,message", [
    (dict(q=1.5), "q"), (dict(q=-0.1), "q"), (dict(z=-1.0), "noise_multiplier"),
    (dict(count=-3), "steps"),
])
def test_bad_steps_are_rejected(bad, message):
    args = dict(q=0.1, z=1.0, count=10) | bad
    with pytest.raises(ValueError, match=message):
        RDPAccountant([(args["q"], args["z"], args["count"])])


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5, 2.0])
def test_bad_delta(delta):
    with pytest.raises(ValueError, match="delta must be in \\(0, 1\\)"):
        RDPAccountant([(0.1, 1.0, 10)]).epsilon(delta)


def test_bad_epsilon_and_orders():
    with pytest.raises(ValueError, match="epsilon must be"):
        RDPAccountant([(0.1, 1.0, 10)]).delta(-1.0)
    with pytest.raises(ValueError, match="orders"):
        RDPAccountant(orders=[0.5, 2])
