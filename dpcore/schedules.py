"""Clip schedules: the clip bound of every group follows C_t = C * f(t) over the steps t.

The user chooses what stays fixed while the clip moves (Yu, Zhang, Chen, "momentum and
decreasing clip"):

* ``hold="noise_std"``: sigma~_g stays as in the base mechanism, so z_t = sigma~ / C_t grows as
  C_t shrinks and each later step costs less privacy: more steps fit in the budget;
* ``hold="noise_multiplier"``: sigma~_g,t = z_g C_t, so every step costs the same.

Whatever happens, the ledger records the clip and noise actually used at every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from . import _validation as check
from .queries import Group, Mechanism

HOLDS = ("noise_std", "noise_multiplier")


def decreasing(horizon: float) -> Callable[[int], float]:
    """f(t) = 1 / min(2, 1 + t / T): the clip falls smoothly to half by step T (Yu et al.)."""
    horizon = check.positive("horizon", horizon)
    return lambda t: 1.0 / min(2.0, 1.0 + t / horizon)


def step_decay(every: int, factor: float) -> Callable[[int], float]:
    """f(t) = factor ** floor(t / every)."""
    every = check.count("every", every, minimum=1)
    factor = check.positive("factor", factor)
    return lambda t: factor ** (t // every)


def exponential(rate: float) -> Callable[[int], float]:
    """f(t) = exp(-rate t)."""
    rate = check.non_negative("rate", rate)
    return lambda t: math.exp(-rate * t)


@dataclass(frozen=True)
class ClipSchedule:
    """Scale every group's clip by ``factor(step)``; ``hold`` says what stays fixed."""

    factor: Callable[[int], float]
    hold: str = "noise_std"

    def __post_init__(self):
        if not callable(self.factor):
            raise TypeError(f"factor must be callable step -> scale, got {self.factor!r}")
        if self.hold not in HOLDS:
            raise ValueError(f"hold must be one of {HOLDS}, got {self.hold!r}")

    def bind(self, base: Mechanism, expected_size: float) -> "ScheduledClipping":
        return ScheduledClipping(base, self)


class ScheduledClipping:
    """The mechanism in force at each step under a :class:`ClipSchedule`."""

    count_groups: tuple[Group, ...] = ()

    def __init__(self, base: Mechanism, schedule: ClipSchedule):
        self.base, self.schedule = base, schedule

    def mechanism(self, step: int) -> Mechanism:
        name = f"clip schedule factor at step {step}"
        try:
            factor = self.schedule.factor(step)
        except OverflowError as exc:  # e.g. step_decay(1, 2.0) past step 1023
            raise ValueError(f"{name} overflowed ({exc}); expected a positive finite "
                             f"number") from None
        scale = check.positive(name, factor)
        groups = []
        for g in self.base.groups:
            clip = g.clip * scale
            noise = g.noise_std if self.schedule.hold == "noise_std" else g.noise_multiplier * clip
            try:
                groups.append(Group(g.name, g.leaves, clip, noise, g.scales))
            except ValueError as exc:  # the scaled clip or noise overflowed
                raise ValueError(f"{name} = {scale!r}: {exc}") from None
        return Mechanism(tuple(groups), self.base.record, self.base.microbatch_size)
