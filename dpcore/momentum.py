"""DP momentum (Yu, Zhang, Chen): m_t = c m_{t-1} + g~_t with m_0 = 0.

Momentum is post-processing of the released noisy gradients, so it costs no privacy; but it
accumulates their noise. With independent noise b_s ~ N(0, sigma^2) per step, the noise in m_t
is n_t = sum_{s=1..t} c^(t-s) b_s, of variance

    Var(n_t) = (1 - c^(2t)) / (1 - c^2) sigma^2  ->  sigma^2 / (1 - c^2)  as t grows.

At the usual c = 0.9 that is about 5.3 sigma^2; the paper found c = 0.6 to 0.7 best under DP
(about 1.6 to 2 sigma^2), and recommends 0.6.
"""

from __future__ import annotations

import math

from . import _validation as check

RECOMMENDED_COEFFICIENT = 0.6


def momentum_noise_variance(coefficient: float, step: int, noise_std: float = 1.0) -> float:
    """Variance of the noise in the momentum m_t after ``step`` (t >= 1) noisy gradients, each
    with noise of standard deviation ``noise_std``, for momentum coefficient c in [0, 1)."""
    c = check.non_negative("coefficient", coefficient)
    if c >= 1:
        raise ValueError(f"coefficient must be in [0, 1), got {coefficient!r}")
    t = check.count("step", step, minimum=1)
    sigma = check.non_negative("noise_std", noise_std)
    if c == 0:
        return sigma ** 2
    return -math.expm1(2 * t * math.log(c)) / (1 - c * c) * sigma ** 2
