r"""Classical composition and amplification theorems for (epsilon, delta)-DP mechanisms.

These are the textbook results of the course notes (``lecture-private-learning-dpsgd-pate``):
useful for reasoning and for mechanisms the numerical accountants do not model, but much
looser than :class:`~dpcore.accounting.rdp.RDPAccountant` or
:class:`~dpcore.accounting.pld.PLDAccountant` for Gaussian steps. Every function checks
the conditions its theorem needs and says which one failed.
"""

from __future__ import annotations

import math
from typing import Sequence

from .. import _validation as check


def _epsilon_delta(epsilon, delta, index=None) -> tuple[float, float]:
    suffix = "" if index is None else f"[{index}]"
    epsilon = check.non_negative(f"epsilon{suffix}", epsilon)
    delta = check.probability(f"delta{suffix}", delta, allow_zero=True)
    return epsilon, delta


def basic_composition(epsilons: Sequence[float], deltas: Sequence[float]) -> tuple[float, float]:
    r"""Basic composition: running mechanisms that are (eps_i, delta_i)-DP, even adaptively,
    is (sum_i eps_i, sum_i delta_i)-DP. "Total privacy loss is the sum of privacy losses."

    Raises ``ValueError`` when the lists differ in length or the total delta reaches 1
    (a vacuous guarantee).
    """
    epsilons, deltas = list(epsilons), list(deltas)
    if len(epsilons) != len(deltas):
        raise ValueError(f"need one delta per epsilon, got {len(epsilons)} epsilons and "
                         f"{len(deltas)} deltas")
    pairs = [_epsilon_delta(e, d, i) for i, (e, d) in enumerate(zip(epsilons, deltas))]
    total_delta = math.fsum(d for _, d in pairs)
    if total_delta >= 1:
        raise ValueError(f"the deltas add up to {total_delta!r} >= 1: the composed guarantee "
                         "is vacuous")
    return math.fsum(e for e, _ in pairs), total_delta


def advanced_composition(epsilon: float, delta: float, k: int,
                         delta_prime: float) -> tuple[float, float]:
    r"""Advanced composition (Dwork & Roth, Theorem 3.20): the k-fold adaptive composition of
    (eps, delta)-DP mechanisms is (eps', k delta + delta')-DP for any delta' > 0, with

    .. math:: \varepsilon' = \sqrt{2k\ln(1/\delta')}\,\varepsilon + k\varepsilon(e^\varepsilon - 1).

    Requires eps >= 0, delta in [0, 1], k >= 1 an integer, delta' in (0, 1) and
    k delta + delta' < 1. Better than basic composition only when eps is small and k large;
    :func:`best_composition` picks the better of the two.
    """
    epsilon, delta = _epsilon_delta(epsilon, delta)
    k = check.count("k", k, minimum=1)
    delta_prime = check.delta("delta_prime", delta_prime)
    total_delta = k * delta + delta_prime
    if total_delta >= 1:
        raise ValueError(f"k * delta + delta_prime = {total_delta!r} >= 1: the composed "
                         "guarantee is vacuous")
    eps = math.sqrt(2 * k * math.log(1 / delta_prime)) * epsilon + k * epsilon * math.expm1(epsilon)
    return eps, total_delta


def best_composition(epsilon: float, delta: float, k: int,
                     delta_prime: float) -> tuple[float, float]:
    """The smaller epsilon of basic composition, (k eps, k delta), and advanced composition,
    (eps', k delta + delta'); each is a valid guarantee."""
    advanced = advanced_composition(epsilon, delta, k, delta_prime)
    basic = basic_composition([epsilon] * k, [delta] * k)
    return basic if basic[0] <= advanced[0] else advanced


def amplify_by_subsampling(epsilon: float, delta: float, q: float) -> tuple[float, float]:
    r"""Amplification by Poisson subsampling: if A is (eps, delta)-DP under add-or-remove-one
    neighbouring, running A on a sample that contains each record independently with
    probability q is (eps', q delta)-DP with

    .. math:: \varepsilon' = \log(1 + q(e^\varepsilon - 1)).

    The notes' Lemma 3 proves the pure case: given record i, the output distribution is a
    (1-q, q) mixture of "i not sampled" (identical on both datasets) and "i sampled"
    (within e^{±eps}), so p_x(S) <= (1 + q(e^eps - 1)) p_x'(S) and
    p_x(S) >= (1 - q(1 - e^{-eps})) p_x'(S); the second ratio is never the larger one. For
    eps <= 1 this gives eps' <= 2 q eps, the notes' statement. The delta part is the
    standard extension (Balle, Barthe, Gaboardi 2018, Thm. 8).
    """
    epsilon, delta = _epsilon_delta(epsilon, delta)
    q = check.probability("q (sampling rate)", q, allow_zero=True)
    return math.log1p(q * math.expm1(epsilon)), q * delta
