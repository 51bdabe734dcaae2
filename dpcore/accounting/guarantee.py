"""Ledger in, epsilon out: the (epsilon, delta) guarantee of a ledger, and the budget left.

``source`` is everywhere a :class:`~dpcore.ledger.Ledger`, a ledger path, or a sequence of
steps (:mod:`dpcore.accounting.steps`). ``accountant`` is ``"pld"`` (the default: tightest)
or ``"rdp"``; extra keyword arguments go to the accountant's constructor.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .. import _validation as check
from .pld import PLDAccountant, reusing_step_plds
from .rdp import RDPAccountant
from .steps import Source, as_steps, check_count

ACCOUNTANTS = {"pld": PLDAccountant, "rdp": RDPAccountant}
MAX_STEPS = 10**9


@dataclass(frozen=True)
class Guarantee:
    """An (epsilon, delta)-DP guarantee under add-or-remove-one-record neighbouring.

    ``order`` is the optimal RDP order (RDP accountant only); ``rounded`` says whether noise
    multipliers were rounded down onto a grid (conservatively) before accounting."""

    epsilon: float
    delta: float
    accountant: str
    steps: int
    order: float | None = None
    rounded: bool = False

    def to_json(self) -> dict:
        d = asdict(self)
        if math.isinf(self.epsilon):
            d["epsilon"] = "inf"  # JSON has no infinity
        return d


def make_accountant(source: Source = (), accountant: str = "pld", **options):
    """A fresh accountant of kind ``accountant`` holding the steps of ``source``."""
    try:
        cls = ACCOUNTANTS[accountant]
    except (KeyError, TypeError):
        raise ValueError(f"accountant must be one of {sorted(ACCOUNTANTS)}, got "
                         f"{accountant!r}") from None
    return cls(source, **options)


def guarantee(source: Source, delta: float, *, accountant: str = "pld", **options) -> Guarantee:
    """The smallest epsilon the chosen accountant certifies for ``source`` at ``delta``."""
    delta = check.delta("delta", delta)
    acc = make_accountant(source, accountant, **options)
    steps, rounded = acc.steps, acc.rounded
    if isinstance(acc, PLDAccountant):
        eps, accountant = acc.epsilon_and_accountant(delta)  # "rdp" below its resolution
        if accountant == RDPAccountant.name:
            acc = acc.rdp()
    if isinstance(acc, RDPAccountant):
        eps, order = acc.epsilon_and_order(delta)
    else:
        order = None
    return Guarantee(eps, delta, accountant, steps, order, rounded)


def epsilon(source: Source, delta: float, *, accountant: str = "pld", **options) -> float:
    """Epsilon of ``source`` at ``delta`` (an upper bound: never under-reported).

    z = 0 (a noiseless step) gives ``inf``; q = 0 and z = inf steps cost nothing."""
    return guarantee(source, delta, accountant=accountant, **options).epsilon


def delta_for_epsilon(source: Source, epsilon: float, *, accountant: str = "pld",
                      **options) -> float:
    """Delta of ``source`` at ``epsilon`` (an upper bound)."""
    epsilon = check.non_negative("epsilon", epsilon)
    return make_accountant(source, accountant, **options).delta(epsilon)


def remaining_steps(source: Source, q: float, noise_multiplier: float, target_epsilon: float,
                    delta: float, *, accountant: str = "pld", max_steps: int = MAX_STEPS,
                    **options) -> int:
    """How many more steps at (q, z) fit in the budget (target_epsilon, delta) after the
    steps of ``source``: the largest k <= ``max_steps`` with epsilon(source + k steps) <=
    target_epsilon (0 if the budget is already spent). Returns ``max_steps`` when the steps
    are free (q = 0 or z = inf)."""
    target_epsilon = check.non_negative("target_epsilon", target_epsilon)
    delta = check.delta("delta", delta)
    q = check.probability("q (sampling rate)", q, allow_zero=True)
    z = check.non_negative("noise_multiplier", noise_multiplier, allow_inf=True)
    max_steps = check_count("max_steps", max_steps)
    past = as_steps(source)

    def fits(k: int, kind: str = accountant, kind_options: dict = options) -> bool:
        steps = past + ([(q, z, k)] if k else [])
        return make_accountant(steps, kind, **kind_options).epsilon(delta) <= target_epsilon

    with reusing_step_plds():
        if not fits(0):
            return 0
        if q == 0 or math.isinf(z):
            return max_steps
        if z == 0:
            return 0
        guess = None
        if accountant != RDPAccountant.name:  # RDP's count, cheap, is near PLD's
            shared = {k: options[k] for k in ("noise_resolution", "max_groups") if k in options}
            guess = _largest_true(lambda k: fits(k, RDPAccountant.name, shared), max_steps)
        return _largest_true(fits, max_steps, guess)


def _largest_true(fits, limit: int, guess: int | None = None) -> int:
    """The largest k in [0, limit] with fits(k), given fits(0) and fits monotone (true up to
    some k, false after). A ``guess`` near the answer saves probes: the search gallops from
    it in steps of guess / 8, doubling, before it bisects."""
    lo, hi = 0, None
    if guess:
        guess = min(guess, limit)
        step = max(1, guess // 8)
        if fits(guess):
            lo = guess
            while lo < limit and fits(min(lo + step, limit)):
                lo, step = min(lo + step, limit), 2 * step
            if lo == limit:
                return limit
            hi = min(lo + step, limit)
        else:
            hi = guess
            while hi - step > 0 and not fits(hi - step):
                hi, step = hi - step, 2 * step
            lo = max(hi - step, 0)
    else:
        hi = 1
        while hi <= limit and fits(hi):
            lo, hi = hi, hi * 2
        if hi > limit:
            if fits(limit):
                return limit
            hi = limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
