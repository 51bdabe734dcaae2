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
exact because composition is commutative. With ``noise_resolution`` it first rounds every
``z`` *down* onto the geometric grid ``(1 - noise_resolution)^k``: a step with less noise
dominates the step it replaces (adding more Gaussian noise is post-processing), so the
result is an upper bound on the exact one and few groups remain even when ``z`` changes at
every step (a decreasing clip schedule).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Iterable, Sequence, Union

from .. import _validation as check
from ..ledger import NEIGHBOURING, Ledger, LedgerError, Step, read_ledger

StepLike = Union[Step, Sequence[float]]
Source = Union[Ledger, str, "os.PathLike[str]", Iterable[StepLike]]


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
    count = check.count("steps", count)
    return Step(q, z, count)


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
        return source.steps()
    if isinstance(source, Step):
        source = [source]
    steps = []
    for item in source:
        if isinstance(item, Step):
            steps.append(check_step(item.q, item.noise_multiplier, item.count))
        else:
            try:
                fields = tuple(item)
            except TypeError:
                raise TypeError(f"expected a Step or a (q, z[, count]) tuple, got {item!r}") from None
            if len(fields) not in (2, 3):
                raise TypeError(f"expected a Step or a (q, z[, count]) tuple, got {item!r}")
            steps.append(check_step(*fields))
    return steps


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
    counts: dict[tuple[float, float], int] = {}
    infinite = False
    total = 0
    for step in steps:
        total += step.count
        if step.count == 0 or step.q == 0 or math.isinf(step.noise_multiplier):
            continue
        if step.noise_multiplier == 0:
            infinite = True
            continue
        key = (step.q, step.noise_multiplier)
        counts[key] = counts.get(key, 0) + step.count
    rounded = False
    if noise_resolution is not None and (max_groups is None or len(counts) > max_groups):
        coarse: dict[tuple[float, float], int] = {}
        for (q, z), c in counts.items():
            key = (q, round_noise_down(z, noise_resolution))
            coarse[key] = coarse.get(key, 0) + c
        counts, rounded = coarse, True
    groups = tuple(Group(q, z, c) for (q, z), c in sorted(counts.items()))
    return Composition(groups, infinite, total, rounded)
