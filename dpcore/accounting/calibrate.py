"""Calibration: solve for the noise multiplier, the sampling rate or the number of steps that
meets a target (epsilon, delta), given the other two.

Epsilon decreases in z and increases in q and in T, so each is a one-dimensional search
(bisection). Every result is *checked* with the accountant before it is returned: the
returned value never gives an epsilon above the target (the search keeps the feasible end
of its bracket). ``accountant`` and extra options are as in
:func:`dpcore.accounting.guarantee.epsilon`.
"""

from __future__ import annotations

import math

from scipy import optimize

from .. import _validation as check
from .guarantee import MAX_STEPS, _largest_true, make_accountant
from .pld import MIN_NOISE_MULTIPLIER
from .steps import check_count


def _epsilon(q: float, z: float, steps: int, delta: float, accountant: str, options) -> float:
    return make_accountant([(q, z, steps)], accountant, **options).epsilon(delta)


def _solve(excess, feasible: float, infeasible: float, rtol: float) -> float:
    """A point x with excess(x) <= 0 within relative ``rtol`` of the boundary, given a
    bracket with excess(feasible) <= 0 < excess(infeasible) and excess monotone. Brent's
    method on log x, then the feasible end of the final bracket."""
    def g(log_x: float) -> float:
        value = excess(math.exp(log_x))
        return min(value, 1e300)

    a, b = math.log(feasible), math.log(infeasible)
    root = optimize.brentq(g, a, b, xtol=rtol / 4, rtol=4 * 2.0**-52, maxiter=200)
    step = (b - a) / abs(b - a) * rtol / 4  # towards the infeasible side
    x = root - step
    while g(x) > 0:  # make sure we stand on the feasible side
        x -= step
    return math.exp(x)


def _target(target_epsilon, delta) -> tuple[float, float]:
    return (check.positive("target_epsilon", target_epsilon, allow_inf=False),
            check.delta("delta", delta))


def calibrate_noise_multiplier(target_epsilon: float, delta: float, q: float, steps: int, *,
                               accountant: str = "pld", rtol: float = 1e-4,
                               **options) -> float:
    """The smallest noise multiplier z (to relative precision ``rtol``, rounded up) such that
    ``steps`` steps at sampling rate ``q`` are (target_epsilon, delta)-DP."""
    target_epsilon, delta = _target(target_epsilon, delta)
    q = check.probability("q (sampling rate)", q)
    steps = check.count("steps", steps, minimum=1)
    rtol = check.delta("rtol", rtol)

    def excess(z: float) -> float:
        return _epsilon(q, z, steps, delta, accountant, options) - target_epsilon

    hi = 1.0
    while excess(hi) > 0:
        hi *= 2
        if hi > 1e8:
            raise ValueError(f"no noise multiplier up to 1e8 reaches epsilon {target_epsilon} "
                             f"at delta {delta}")
    # the smallest z tried: PLD's grids hold no smaller one, but price q = 1 in closed form
    floor = MIN_NOISE_MULTIPLIER if accountant == "pld" and q < 1 else 1e-6
    lo = hi / 2
    while excess(lo) <= 0:
        if lo == floor:
            if floor == MIN_NOISE_MULTIPLIER:
                raise ValueError(
                    f"epsilon {target_epsilon} at delta {delta} needs a noise multiplier below "
                    f"{floor:.4g}, the smallest the PLD accountant prices; use "
                    f"accountant='rdp'")
            return lo
        hi, lo = lo, max(lo / 2, floor)
    return _solve(excess, hi, lo, rtol)


def calibrate_sampling_rate(target_epsilon: float, delta: float, noise_multiplier: float,
                            steps: int, *, accountant: str = "pld", rtol: float = 1e-4,
                            **options) -> float:
    """The largest sampling rate q in (0, 1] (to relative precision ``rtol``, rounded down)
    such that ``steps`` steps with noise multiplier z are (target_epsilon, delta)-DP."""
    target_epsilon, delta = _target(target_epsilon, delta)
    z = check.positive("noise_multiplier", noise_multiplier)
    steps = check.count("steps", steps, minimum=1)
    rtol = check.delta("rtol", rtol)

    def excess(q: float) -> float:
        return _epsilon(q, z, steps, delta, accountant, options) - target_epsilon

    if excess(1.0) <= 0:
        return 1.0
    hi, lo = 1.0, 0.5
    while excess(lo) > 0:
        hi, lo = lo, lo / 2
        if lo < 1e-12:
            raise ValueError(f"no sampling rate down to 1e-12 reaches epsilon "
                             f"{target_epsilon} at delta {delta} with z={z}, {steps} steps")
    return _solve(excess, lo, hi, rtol)


def calibrate_steps(target_epsilon: float, delta: float, q: float, noise_multiplier: float, *,
                    accountant: str = "pld", max_steps: int = MAX_STEPS, **options) -> int:
    """The largest number of steps (at most ``max_steps``; 0 if even one step is too many)
    at (q, z) that is (target_epsilon, delta)-DP."""
    target_epsilon, delta = _target(target_epsilon, delta)
    q = check.probability("q (sampling rate)", q)
    z = check.positive("noise_multiplier", noise_multiplier)
    max_steps = check_count("max_steps", max_steps, minimum=1)
    return _largest_true(
        lambda t: t == 0 or _epsilon(q, z, t, delta, accountant, options) <= target_epsilon,
        max_steps)
