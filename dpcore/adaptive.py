"""Adaptive quantile clipping (Andrew, Thakkar, McMahan, Ramaswamy 2021).

Each group's clip C_t tracks the gamma-quantile of the records' norms. Every sampled record
also reports the bit b_i = 1[||x_i|| <= C_t]; the server releases

    b_bar = (sum_i (b_i - 1/2) + N(0, sigma_b^2)) / (q n) + 1/2

and updates C_{t+1} = C_t exp(-eta (b_bar - gamma)) (geometric) or C_t - eta (b_bar - gamma)
(linear). The sum uses C_t, the clip actually applied; C moves afterwards. The centred bits have
sensitivity 1/2, so each count is one more group in the ledger, (S, sigma~) = (1/2, sigma_b).
With G groups (one threshold each), Eq. (1) gives the step's multiplier

    1 / z^2 = 1 / z_delta^2 + G / (2 sigma_b)^2,

so for a chosen total z the gradient groups get z_delta = (1/z^2 - G/(4 sigma_b^2))^(-1/2):
adaptive clipping at total z costs exactly what plain DP-SGD at z costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from array_api_compat import array_namespace

from . import _validation as check
from .queries import Group, Mechanism, noise_multiplier_left

UPDATES = ("geometric", "linear")
COUNT_PREFIX = "unclipped_count:"


@dataclass(frozen=True)
class QuantileClipping:
    """Adaptive clipping to the ``target_quantile`` of record norms; the paper's defaults.

    The base mechanism gives the groups, their initial clips C_0 (the paper starts from 0.1)
    and the total noise multiplier z. ``count_noise_std`` is sigma_b (default q n / 20);
    no update takes a clip below ``min_clip`` (a group whose records are all zero, every one
    unclipped, shrank its clip geometrically into subnormal floats, where clip * z_g keeps
    a few bits and the step's z drifted below the configured one).
    """

    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_noise_std: float | None = None
    update: str = "geometric"
    min_clip: float = 1e-6

    def __post_init__(self):
        gamma = check.probability("target_quantile", self.target_quantile, allow_zero=True)
        object.__setattr__(self, "target_quantile", gamma)
        object.__setattr__(self, "learning_rate", check.positive("learning_rate", self.learning_rate))
        if self.count_noise_std is not None:
            object.__setattr__(self, "count_noise_std",
                               check.non_negative("count_noise_std", self.count_noise_std))
        if self.update not in UPDATES:
            raise ValueError(f"update must be one of {UPDATES}, got {self.update!r}")
        object.__setattr__(self, "min_clip", check.positive("min_clip", self.min_clip))

    def bind(self, base: Mechanism, expected_size: float) -> "AdaptiveClipping":
        return AdaptiveClipping(base, self, expected_size)


def gradient_noise_multiplier(total: float, count_noise_std: float, groups: int = 1) -> float:
    """z_delta such that the gradient groups and ``groups`` counts together have multiplier
    ``total``: 1/z_delta^2 = 1/total^2 - groups/(2 sigma_b)^2."""
    sigma_b = check.non_negative("count_noise_std", count_noise_std)
    groups = check.count("groups", groups)
    return noise_multiplier_left(
        total, [2 * sigma_b] * groups, f"{groups} count(s) at sigma_b={sigma_b!r}",
        f"sigma_b must exceed sqrt({groups}) z / 2 = {math.sqrt(groups) * total / 2!r}")


def update_clip(clip: float, unclipped_fraction: float, config: QuantileClipping) -> float:
    """C_{t+1} from C_t and the released fraction b_bar of unclipped records."""
    error = unclipped_fraction - config.target_quantile
    if config.update == "geometric":
        return max(config.min_clip, clip * math.exp(-config.learning_rate * error))
    return max(config.min_clip, clip - config.learning_rate * error)


class AdaptiveClipping:
    """The state of adaptive clipping in one run: current clips, and the count groups."""

    def __init__(self, base: Mechanism, config: QuantileClipping, expected_size: float):
        self.base, self.config = base, config
        sigma_b = (expected_size / 20 if config.count_noise_std is None
                   else config.count_noise_std)
        total = base.noise_multiplier
        z_delta = gradient_noise_multiplier(total, sigma_b, len(base.groups))
        # each gradient group keeps its share of the noise, scaled from z to z_delta
        ratio = 0.0 if total == 0 else z_delta / total
        self.multipliers = [g.noise_multiplier * ratio for g in base.groups]
        self.clips = [g.clip for g in base.groups]
        self.count_groups = tuple(Group(COUNT_PREFIX + g.name, (COUNT_PREFIX + g.name,), 0.5,
                                        sigma_b) for g in base.groups)

    def mechanism(self, step: int) -> Mechanism:
        groups = tuple(Group(g.name, g.leaves, clip, clip * m, g.scales)
                       for g, clip, m in zip(self.base.groups, self.clips, self.multipliers))
        return Mechanism(groups, self.base.record, self.base.microbatch_size)

    def count_sums(self, factors, mask=None) -> dict:
        """sum_i (b_ig - 1/2) over the real records, b_ig = 1 when group g was not clipped:
        its factor min(1, S / norm) is 1 to within a few units of rounding (PyTorch forms
        S / x as S * (1 / x), which gives 0.99999994 for x = S in float32)."""
        xp = array_namespace(factors)
        unclipped = xp.astype(factors >= 1 - 4 * xp.finfo(factors.dtype).eps, factors.dtype)
        real = (xp.ones_like(factors[:, 0]) if mask is None
                else xp.astype(xp.astype(mask, xp.bool), factors.dtype))
        centred = (unclipped - 0.5) * real[:, None]
        totals = xp.sum(centred, axis=0)
        return {group.name: xp.reshape(totals[g], (1,))
                for g, group in enumerate(self.count_groups)}

    def observe(self, released: dict) -> None:
        """Update the clips from the released noisy averages of the centred bits (all or
        none: a NaN or infinite count is refused before any clip moves)."""
        fractions = [float(released[group.name][0]) + 0.5 for group in self.count_groups]
        bad = [g.name for g, f in zip(self.count_groups, fractions) if not math.isfinite(f)]
        if bad:
            raise FloatingPointError(f"the released counts {bad} are NaN or infinite: the clips "
                                     f"were not moved")
        self.clips = [update_clip(clip, f, self.config) for clip, f in zip(self.clips, fractions)]
