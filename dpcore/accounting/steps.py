"""What the accountants price: sequences of Poisson-subsampled Gaussian steps.

Every accountant in :mod:`dpcore.accounting` takes a *source* of steps, which may be

* a :class:`~dpcore.ledger.Ledger` (its header must state the neighbouring relation
  ``add_or_remove_one_record``, the only one these accountants price),
* a path to a ledger file,
* a sequence of :class:`~dpcore.ledger.Step` or of ``(q, z)`` / ``(q, z, count)`` tuples.

Conventions (the same for every accountant):

* ``q = 0`` (nobody sampled) and ``z = inf`` (nothing released) cost nothing;
* ``z = 0`` with ``q > 0`` (a noiseless release) has infinite epsilon;
* the neighbouring relation is add-or-remove one record and sampling is Poisson.

:func:`group_steps` reduces a sequence to distinct ``(q, z)`` with total counts, which is
exact because composition is commutative (noise multipliers equal but for a few ulps of
rounding, :data:`~dpcore.ledger.NOISE_TIE`, are one group at the smaller). With
``noise_resolution`` it first rounds every ``z`` *down* onto the geometric grid
``(1 - noise_resolution)^k``: a step with less noise dominates the step it replaces (adding
more Gaussian noise is post-processing), so the result is an upper bound on the exact one
and few groups remain even when ``z`` changes at every step (a decreasing clip schedule).
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass
from typing import Iterable, Sequence, Union

import numpy as np

from .. import _validation as check
from ..ledger import NEIGHBOURING, NOISE_TIE, Ledger, LedgerError, Step, read_ledger

StepLike = Union[Step, Sequence[float]]
Source = Union[Ledger, str, "os.PathLike[str]", Iterable[StepLike]]
MAX_COUNT = 2 ** 53  # steps of one kind: counts are multiplied in float64


@dataclass(frozen=True)
class Group:
    """``count`` steps with sampling rate ``q`` in (0, 1] and finite noise multiplier
    ``noise_multiplier`` > 0: the only steps that carry a finite, non-zero cost."""

    q: float
    noise_multiplier: float
    count: int


@dataclass(frozen=True)
class Composition:
    """A source reduced to what an accountant needs.

    ``groups`` are the costly steps; ``infinite`` is true when some step was noiseless
    (``z = 0`` with ``q > 0``), which makes epsilon infinite for every delta < 1;
    ``steps`` counts all steps, free ones included; ``rounded`` says whether noise
    multipliers were rounded down onto a grid.
    """

    groups: tuple[Group, ...]
    infinite: bool
    steps: int
    rounded: bool = False


def check_step(q, noise_multiplier, count=1) -> Step:
    """Validate one step: q in [0, 1], z >= 0 (``inf`` allowed), count a non-negative int."""
    q = check.probability("q (sampling rate)", q, allow_zero=True)
    z = check.non_negative("noise_multiplier", noise_multiplier, allow_inf=True)
    return Step(q, z, check_count("steps", count))


def check_count(name: str, value, *, minimum: int = 0) -> int:
    """A count of steps: an integer in [``minimum``, 2^53] (float64 holds it exactly)."""
    value = check.count(name, value, minimum=minimum)
    if value > MAX_COUNT:
        raise ValueError(f"{name} must be at most 2^53 = {MAX_COUNT} (the counts float64 holds "
                         f"exactly), got {value}")
    return value


def as_steps(source: Source) -> list[Step]:
    """The steps of a ledger, ledger path or sequence of steps, validated.

    Raises :class:`~dpcore.ledger.LedgerError` for a ledger stating a neighbouring relation
    other than add-or-remove one record.
    """
    if isinstance(source, (str, os.PathLike)):
        source = read_ledger(source)
    if isinstance(source, Ledger):
        relation = source.header.neighbouring
        if relation != NEIGHBOURING:
            raise LedgerError(f"these accountants price the neighbouring relation "
                              f"{NEIGHBOURING!r}; the ledger states {relation!r}")
        return source.steps()  # validated when the events were made
    if isinstance(source, Step):
        source = [source]
    steps = [item if isinstance(item, Step) else _from_tuple(item) for item in source]
    _check_all(steps)
    return steps


def _from_tuple(item) -> Step:
    try:
        fields = tuple(item)
    except TypeError:
        raise TypeError(f"expected a Step or a (q, z[, count]) tuple, got {item!r}") from None
    if len(fields) not in (2, 3):
        raise TypeError(f"expected a Step or a (q, z[, count]) tuple, got {item!r}")
    return check_step(*fields)


def _check_all(steps: list[Step]) -> None:
    """Validate many steps at once; the first bad one is re-checked for its message."""
    if not steps:
        return
    try:
        q = np.array([s.q for s in steps], dtype=float)
        z = np.array([s.noise_multiplier for s in steps], dtype=float)
        fine = ((q >= 0) & (q <= 1) & (z >= 0)
                & np.array([_count(s.count) and _real(s.q) and _real(s.noise_multiplier)
                            for s in steps]))
    except (TypeError, ValueError):
        fine = np.zeros(len(steps), dtype=bool)
    for i in np.flatnonzero(~fine):
        step = steps[int(i)]
        check_step(step.q, step.noise_multiplier, step.count)  # raises, naming the field


def _count(value) -> bool:
    """An int (not a bool) in [0, MAX_COUNT]."""
    return (isinstance(value, numbers.Integral) and not isinstance(value, bool)
            and 0 <= value <= MAX_COUNT)


def _real(value) -> bool:
    """A real number, not a bool or a string (which numpy would convert)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def round_noise_down(z: float, resolution: float) -> float:
    """The largest grid point ``(1 - resolution)^k`` (k integer) that is <= ``z``."""
    if not 0 < resolution < 1:
        raise ValueError(f"noise_resolution must be in (0, 1), got {resolution!r}")
    ratio = math.log1p(-resolution)
    k = math.ceil(math.log(z) / ratio)
    rounded = math.exp(k * ratio)
    while rounded > z:  # guard against the last ulp of log/exp
        k += 1
        rounded = math.exp(k * ratio)
    return rounded


def group_steps(source: Source, *, noise_resolution: float | None = None,
                max_groups: int | None = None) -> Composition:
    """Reduce ``source`` to distinct (q, z) groups with total counts.

    ``noise_resolution`` (relative, e.g. 1e-3) rounds every finite z down onto a geometric
    grid before grouping; with ``max_groups`` it is applied only when there are more than
    ``max_groups`` distinct (q, z) pairs. Rounding down never lowers the reported epsilon.
    """
    steps = as_steps(source)
    total = sum(s.count for s in steps)
    if not steps:
        return Composition((), False, 0)
    q = np.array([s.q for s in steps], dtype=float)
    z = np.array([s.noise_multiplier for s in steps], dtype=float)
    c = np.array([s.count for s in steps], dtype=np.int64)
    costly = (c > 0) & (q > 0) & np.isfinite(z)
    infinite = bool(np.any(costly & (z == 0)))
    costly &= z > 0
    q, z, c = q[costly], z[costly], c[costly]
    z = _untie(z)
    rounded = False
    if (noise_resolution is not None and z.size
            and (max_groups is None or np.unique(q + 1j * z).size > max_groups)):
        z = _round_down(z, noise_resolution)
        rounded = True
    keys, inverse = np.unique(q + 1j * z, return_inverse=True)  # (q, z) as one sortable key
    counts = np.zeros(keys.size, dtype=np.int64)
    np.add.at(counts, inverse.reshape(-1), c)
    near = np.zeros(keys.size)  # the same sums in float64, where int64 could wrap past 2^63
    np.add.at(near, inverse.reshape(-1), c.astype(float))
    if near.size and near.max() > MAX_COUNT:
        k = int(near.argmax())
        raise ValueError(f"{near[k]:.4g} steps at q={keys[k].real}, z={keys[k].imag}: at most "
                         f"2^53 = {MAX_COUNT} steps of one kind are priced (float64 holds "
                         f"such counts exactly)")
    groups = tuple(Group(float(k.real), float(k.imag), int(n)) for k, n in zip(keys, counts))
    return Composition(groups, infinite, total, rounded)


def _untie(z: np.ndarray) -> np.ndarray:
    """``z`` with values tied in the sense of :data:`~dpcore.ledger.NOISE_TIE` (each within
    it of the next larger distinct value) replaced by the smallest of their chain."""
    values = np.unique(z)
    if values.size < 2:
        return z
    starts = np.concatenate([[True], np.diff(values) > NOISE_TIE * values[1:]])
    smallest = values[starts][np.cumsum(starts) - 1]
    return smallest[np.searchsorted(values, z)]


def _round_down(z: np.ndarray, resolution: float) -> np.ndarray:
    """Vectorised :func:`round_noise_down`."""
    if not 0 < resolution < 1:
        raise ValueError(f"noise_resolution must be in (0, 1), got {resolution!r}")
    ratio = math.log1p(-resolution)
    k = np.ceil(np.log(z) / ratio)
    rounded = np.exp(k * ratio)
    for _ in range(3):  # guard against the last ulp of log/exp
        over = rounded > z
        if not over.any():
            break
        k = np.where(over, k + 1, k)
        rounded = np.exp(k * ratio)
    return rounded
