r"""Rényi differential privacy (the moments accountant) for Poisson-subsampled Gaussian steps.

One step samples each record with probability q and adds N(0, z^2) noise to a sum of
sensitivity 1. Under add-or-remove-one neighbouring its Rényi divergence of order alpha is
at most (Mironov, Talwar, Zhang 2019, "Rényi Differential Privacy of the Sampled Gaussian
Mechanism")

.. math::  \mathrm{RDP}(\alpha) = \frac{\log A_\alpha}{\alpha - 1}, \qquad
           A_\alpha = \mathbb{E}_{x \sim \mu_0}\bigl[((1-q) + q\,\mu_1(x)/\mu_0(x))^\alpha\bigr],

with mu_0 = N(0, z^2), mu_1 = N(1, z^2). RDP adds up over steps, and a total RDP r at order
alpha gives (epsilon, delta)-DP with (Canonne, Kamath, Steinke 2020, Prop. 12; Asoodeh et
al. 2020)

.. math::  \varepsilon = r + \log(1 - 1/\alpha) - \frac{\log\delta + \log\alpha}{\alpha - 1},

minimised over the orders; and, since the KL divergence is at most r and the total
variation distance at most sqrt(1 - e^{-KL}) (Bretagnolle-Huber), epsilon = 0 whenever
delta^2 > 1 - e^{-r}.

Numerics (all in log space):

* integer alpha: A_alpha - 1 = sum_{k>=2} C(alpha, k) q^k (1-q)^{alpha-k} (e^{k(k-1)/(2z^2)} - 1),
  a sum of positive terms, so tiny RDP values keep full relative precision;
* fractional alpha: the two series of Mironov et al. (Sec. 3.3), split at
  x0 = z^2 log(1/q - 1) + 1/2. Their tails alternate with shrinking terms, so the partial
  sum is bracketed by consecutive partial sums; we stop when the last term is below
  ``1e-12`` of the sum and report the *upper* bracket. A series that has not converged
  after ``MAX_SERIES_TERMS`` terms makes that order's cost infinite (never zero);
* q = 1: RDP(alpha) = alpha / (2 z^2) exactly; q = 0 or z = inf: 0; z = 0: infinite.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from scipy import special

from .. import _validation as check
from .steps import Source, group_steps

DEFAULT_ORDERS = tuple(
    [1 + k / 20 for k in range(1, 20)]            # 1.05 ... 1.95
    + [2 + k / 10 for k in range(0, 90)]          # 2.0 ... 10.9
    + list(range(11, 64))
    + [64, 80, 96, 128, 160, 192, 256, 384, 512, 768, 1024]
)
"""Default orders: fractional orders below 11 (denser near 1 for large epsilon), integers up
to 63, then a sparse tail up to 1024 for tiny epsilon. More orders can only lower epsilon."""

MAX_SERIES_TERMS = 1 << 16
_SERIES_RTOL = 1e-12
DEFAULT_NOISE_RESOLUTION = 1e-3
DEFAULT_MAX_GROUPS = 256


def _log_expm1(y: np.ndarray) -> np.ndarray:
    """log(e^y - 1) for y > 0, accurate for tiny and huge y."""
    y = np.asarray(y, dtype=float)
    with np.errstate(divide="ignore"):
        return np.where(y > 1.0, y + np.log1p(-np.exp(-np.minimum(y, 1e300))),
                        np.log(np.expm1(np.minimum(y, 1.0))))


def _log_a_integer(q: float, z: float, alphas: np.ndarray) -> np.ndarray:
    """log A_alpha for integer alphas >= 2 and 0 < q < 1, via A - 1 (a sum of positive terms)."""
    k = np.arange(2, int(alphas.max()) + 1, dtype=float)[None, :]
    a = alphas[:, None]
    with np.errstate(invalid="ignore"):
        log_binom = special.gammaln(a + 1) - special.gammaln(k + 1) - special.gammaln(a - k + 1)
        terms = (log_binom + k * math.log(q) + (a - k) * math.log1p(-q)
                 + _log_expm1(k * (k - 1) / (2 * z * z)))
    terms = np.where(k <= a, terms, -np.inf)
    return np.logaddexp(0.0, special.logsumexp(terms, axis=1))


def _log_abs_expm1(y: np.ndarray) -> np.ndarray:
    """log |e^y - 1|, accurate for any real y (``-inf`` at y = 0)."""
    with np.errstate(divide="ignore"):
        negative = np.log(-np.expm1(np.minimum(y, 0.0)))
    return np.where(y > 0, _log_expm1(np.maximum(y, 1e-300)), negative)


def _log_a_fractional(q: float, z: float, alphas: np.ndarray) -> np.ndarray:
    """log A_alpha for non-integer alphas > 1 and 0 < q < 1; ``inf`` where the series does
    not converge within ``MAX_SERIES_TERMS`` terms.

    For q < 1/2 the series sums A - 1 rather than A: the binomial series
    sum_k C(alpha, k) (1-q)^{alpha-k} q^k = 1 converges there and is subtracted term by term
    from the first series, each term as (1-q)^{alpha-k} q^k C(alpha, k) expm1(...), so a tiny
    RDP keeps its relative precision.
    """
    out = np.full(alphas.shape, math.inf)
    pending = np.arange(alphas.size)
    x0 = z * z * math.log(1 / q - 1) + 0.5
    log_q, log_1mq = math.log(q), math.log1p(-q)
    minus_one = q < 0.5
    size = 128
    while pending.size and size <= MAX_SERIES_TERMS:
        a = alphas[pending][:, None]
        k = np.arange(size, dtype=float)[None, :]
        j = a - k
        n_positive = np.floor(a) + 1  # C(alpha, k) > 0 for k <= n_positive, then alternates
        sign = np.where((k <= n_positive) | ((k - n_positive) % 2 == 0), 1.0, -1.0)
        log_binom = special.gammaln(a + 1) - special.gammaln(k + 1) - special.gammaln(j + 1)
        # integral over x < x0, expanding in the small ratio q mu_1 / ((1-q) mu_0)
        exponent = k * (k - 1) / (2 * z * z) + special.log_ndtr((x0 - k) / z)
        if minus_one:
            low = log_binom + k * log_q + j * log_1mq + _log_abs_expm1(exponent)
            low_sign = np.where(exponent >= 0, 1.0, -1.0)
        else:
            low = log_binom + k * log_q + j * log_1mq + exponent
            low_sign = 1.0
        # integral over x > x0, expanding in the small ratio (1-q) mu_0 / (q mu_1)
        high = (log_binom + j * log_q + k * log_1mq + j * (j - 1) / (2 * z * z)
                + special.log_ndtr((j - x0) / z))
        scale = np.maximum(low.max(axis=1), high.max(axis=1))[:, None]
        terms = sign * (low_sign * np.exp(low - scale) + np.exp(high - scale))
        total = terms.sum(axis=1)
        last = np.abs(terms[:, -3:])
        reference = np.abs(terms).max(axis=1)
        done = ((last[:, 2] <= last[:, 1]) & (last[:, 1] <= last[:, 0])
                & (last[:, 2] <= _SERIES_RTOL * reference))
        # an alternating tail with shrinking terms: the true sum lies between the last two
        # partial sums; report the upper one
        upper = total + np.maximum(0.0, -terms[:, -1])
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            log_upper = np.log(np.maximum(upper, 0.0)) + scale[:, 0]
            if minus_one:  # upper is (A - 1) / e^scale, and A >= 1
                value = np.logaddexp(0.0, log_upper)
            else:
                value = np.where(upper > 0, log_upper, math.inf)
        out[pending[done]] = value[done]
        pending = pending[~done]
        size *= 4
    return out


def rdp_subsampled_gaussian(q: float, noise_multiplier: float, orders=DEFAULT_ORDERS) -> np.ndarray:
    """RDP of one Poisson-subsampled Gaussian step at each of ``orders`` (all > 1).

    ``q = 0`` or ``z = inf`` cost 0; ``z = 0`` (with q > 0) costs ``inf``; ``q = 1`` is the
    plain Gaussian mechanism, alpha / (2 z^2), which also bounds (subsampling does not add
    privacy loss) ``z >= 1e100``, where the series' z^2 terms overflow and every order costs
    under 1e-197.
    """
    q = check.probability("q (sampling rate)", q, allow_zero=True)
    z = check.non_negative("noise_multiplier", noise_multiplier, allow_inf=True)
    orders = _check_orders(orders)
    if q == 0 or math.isinf(z):
        return np.zeros_like(orders)
    if z == 0:
        return np.full_like(orders, math.inf)
    if q == 1 or z >= 1e100:
        return orders / (2 * z * z)
    integer = orders == np.floor(orders)
    log_a = np.empty_like(orders)
    # integer orders in buckets of similar size, so short sums are not padded to long ones
    bucket = np.ceil(np.log2(orders))
    for b in np.unique(bucket[integer]):
        chosen = integer & (bucket == b)
        log_a[chosen] = _log_a_integer(q, z, orders[chosen])
    if not integer.all():
        log_a[~integer] = _log_a_fractional(q, z, orders[~integer])
    return log_a / (orders - 1)


@functools.lru_cache(maxsize=4096)
def _step_rdp(q: float, z: float, orders: tuple) -> np.ndarray:
    """:func:`rdp_subsampled_gaussian`, kept (read-only): a budget's search prices the same
    ledger's groups again at every probe, and a group of fractional orders takes ~30 ms."""
    rdp = rdp_subsampled_gaussian(q, z, orders)
    rdp.flags.writeable = False
    return rdp


def _check_orders(orders) -> np.ndarray:
    orders = np.asarray(orders, dtype=float).reshape(-1)
    if orders.size == 0 or not np.all(orders > 1) or not np.all(np.isfinite(orders)):
        raise ValueError(f"RDP orders must be finite numbers > 1, got {orders.tolist()!r}")
    return orders


def _check_rdp(orders, rdp) -> tuple[np.ndarray, np.ndarray]:
    orders, rdp = _check_orders(orders), np.asarray(rdp, dtype=float)
    if rdp.shape != orders.shape:
        raise ValueError(f"{rdp.size} RDP values for {orders.size} orders: give one per order")
    return orders, rdp


def epsilon_from_rdp(orders, rdp, delta: float) -> tuple[float, float]:
    """(epsilon, optimal order) for total RDP ``rdp`` at ``orders`` and a target ``delta``.

    epsilon = min_alpha [r + log(1 - 1/alpha) - (log delta + log alpha) / (alpha - 1)], and 0
    for an order with delta^2 > 1 - e^{-r}. Infinite RDP gives an infinite epsilon there.
    """
    delta = check.delta("delta", delta)
    orders, rdp = _check_rdp(orders, rdp)
    with np.errstate(over="ignore", invalid="ignore"):
        eps = rdp + np.log1p(-1 / orders) - (math.log(delta) + np.log(orders)) / (orders - 1)
        eps = np.where(delta * delta > -np.expm1(-rdp), 0.0, eps)
    eps = np.where(np.isnan(eps) | np.isposinf(rdp), math.inf, eps)
    best = int(np.argmin(eps))
    return max(0.0, float(eps[best])), float(orders[best])


def delta_from_rdp(orders, rdp, epsilon: float) -> tuple[float, float]:
    """(delta, optimal order) for total RDP ``rdp`` at ``orders`` and a target ``epsilon``:
    the smallest of e^{(alpha-1)(r - epsilon + log(1 - 1/alpha))} / alpha and sqrt(1 - e^{-r})."""
    epsilon = check.non_negative("epsilon", epsilon)
    orders, rdp = _check_rdp(orders, rdp)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        log_delta = (orders - 1) * (rdp - epsilon + np.log1p(-1 / orders)) - np.log(orders)
        log_kl = 0.5 * np.log(-np.expm1(-rdp))
        log_delta = np.fmin(log_delta, log_kl)
    log_delta = np.where(np.isposinf(rdp) | np.isnan(log_delta), 0.0, log_delta)
    best = int(np.argmin(log_delta))
    return min(1.0, math.exp(float(log_delta[best]))), float(orders[best])


class RDPAccountant:
    """Adds up the RDP of Poisson-subsampled Gaussian steps and converts it to (epsilon, delta).

    ``source`` is a ledger, a ledger path or a sequence of steps (see
    :mod:`dpcore.accounting.steps`). When there are more than ``max_groups`` distinct (q, z)
    pairs, every z is first rounded *down* onto a geometric grid of relative resolution
    ``noise_resolution`` (conservative; set ``noise_resolution=None`` to disable).
    """

    name = "rdp"

    def __init__(self, source: Source = (), *, orders=DEFAULT_ORDERS,
                 noise_resolution: float | None = DEFAULT_NOISE_RESOLUTION,
                 max_groups: int = DEFAULT_MAX_GROUPS):
        self.orders = _check_orders(orders)
        self.noise_resolution = noise_resolution
        self.max_groups = max_groups
        self._rdp = np.zeros_like(self.orders)
        self.steps = 0
        self.rounded = False
        self.compose(source)

    def compose(self, source: Source) -> "RDPAccountant":
        """Add the steps of ``source`` to the total (returns ``self``)."""
        composition = group_steps(source, noise_resolution=self.noise_resolution,
                                  max_groups=self.max_groups)
        self.steps += composition.steps
        self.rounded = self.rounded or composition.rounded
        if composition.infinite:
            self._rdp = np.full_like(self.orders, math.inf)
        for group in composition.groups:
            self._rdp = self._rdp + group.count * _step_rdp(
                group.q, group.noise_multiplier, tuple(self.orders))
        return self

    @property
    def rdp(self) -> np.ndarray:
        """Total RDP at each order (a copy)."""
        return self._rdp.copy()

    def epsilon_and_order(self, delta: float) -> tuple[float, float]:
        return epsilon_from_rdp(self.orders, self._rdp, delta)

    def epsilon(self, delta: float) -> float:
        """Smallest epsilon this accountant certifies at ``delta``."""
        return self.epsilon_and_order(delta)[0]

    def delta(self, epsilon: float) -> float:
        """Smallest delta this accountant certifies at ``epsilon``."""
        return delta_from_rdp(self.orders, self._rdp, epsilon)[0]
