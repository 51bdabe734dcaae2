"""Argument checks shared by the core: each error names the field, the value and what was expected."""

from __future__ import annotations

import math
import numbers
import warnings


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} must be a number, got NaN")
    return value


def positive(name: str, value, *, allow_inf: bool = False) -> float:
    """``value > 0`` (finite unless ``allow_inf``)."""
    value = _number(name, value)
    if not value > 0 or (math.isinf(value) and not allow_inf):
        expected = "> 0" if allow_inf else "finite and > 0"
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return value


def non_negative(name: str, value, *, allow_inf: bool = False) -> float:
    """``value >= 0`` (finite unless ``allow_inf``)."""
    value = _number(name, value)
    if not value >= 0 or (math.isinf(value) and not allow_inf):
        expected = ">= 0" if allow_inf else "finite and >= 0"
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return value


def probability(name: str, value, *, allow_zero: bool = False) -> float:
    """A sampling rate in (0, 1], or [0, 1] with ``allow_zero``."""
    value = _number(name, value)
    low_ok = value >= 0 if allow_zero else value > 0
    if not (low_ok and value <= 1):
        interval = "[0, 1]" if allow_zero else "(0, 1]"
        raise ValueError(f"{name} must be in {interval}, got {value!r}")
    return value


def delta(name: str, value) -> float:
    """A delta of an (epsilon, delta) guarantee, in (0, 1)."""
    value = _number(name, value)
    if not 0 < value < 1:
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")
    return value


def warn_unless_below_one_over_n(delta_: float, n: int) -> None:
    """Warn when a target ``delta_`` is not below 1/n: publishing one record of the ``n``,
    chosen at random, in full is (0, 1/n)-DP, so such a delta admits it."""
    if delta_ >= 1 / n:
        warnings.warn(f"delta={delta_:g} is not below 1/n = {1 / n:g} (n={n} records): it "
                      f"would allow publishing a random record in full; take delta well "
                      f"below 1/n (1e-5 for n = 60,000 is customary)", UserWarning,
                      stacklevel=3)


def count(name: str, value, *, minimum: int = 0) -> int:
    """An integer ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value
