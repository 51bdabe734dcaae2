"""Mechanism specs: which vectors are clipped together, with what bound and what noise.

A *record* (one example, one microbatch or one user) contributes vectors v_1..v_m, the
*leaves* (layers' gradients, metrics, statistics), each named. Leaves are partitioned into
groups. A group is a Gaussian sum query with privacy tuple (S_g, sigma~_g):

* **separate clipping** (``scales=None``): the group's leaves are one concatenated vector,
  clipped to L2 norm S_g; N(0, sigma~_g^2) is added to every coordinate of the sum;
* **joint clipping** (``scales=(alpha_1, ..., alpha_k)``): the scaled vector
  (v_1/alpha_1, ..., v_k/alpha_k) is clipped to S_g and scaled back, and leaf j receives
  N(0, (alpha_j sigma~_g)^2), so only the *scaled* vector needs a common bound.

By Eq. (1) of McMahan & Andrew (2018), the groups together are one Gaussian sum query with
noise multiplier z = (sum_g (S_g / sigma~_g)^2)^(-1/2); that is what the accountant prices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType
from typing import Iterable, Mapping, Sequence

from . import _validation as check

RECORD_UNITS = ("example", "microbatch", "user")


def check_record(record: str, microbatch_size: int | None) -> None:
    """The unit of privacy: one of :data:`RECORD_UNITS`; ``microbatch_size`` (>= 1) exactly
    when the record is a microbatch."""
    if record not in RECORD_UNITS:
        raise ValueError(f"record must be one of {RECORD_UNITS}, got {record!r}")
    if record == "microbatch":
        check.count("microbatch_size", microbatch_size, minimum=1)
    elif microbatch_size is not None:
        raise ValueError(f"microbatch_size is only meaningful for record='microbatch', got "
                         f"record={record!r} and microbatch_size={microbatch_size!r}")


def effective_noise_multiplier(tuples: Iterable[tuple[float, float]]) -> float:
    """Eq. (1): privacy tuples (S_g, sigma~_g) -> z = (sum_g (S_g / sigma~_g)^2)^(-1/2).

    No tuple gives ``inf`` (nothing released); any noiseless group (sigma~_g = 0) gives 0.
    """
    total = 0.0
    for clip, noise_std in tuples:
        if noise_std == 0:
            return 0.0
        ratio = clip / noise_std
        total += ratio * ratio  # inf past 1.3e154 (where ** 2 would raise): z = 0
    return math.inf if total == 0 else total ** -0.5


def noise_multiplier_left(total: float, others: Iterable[float], spent_by: str,
                          advice: str) -> float:
    """The multiplier z_left of one more query of a step whose other queries (on the same
    sample) have multipliers ``others``, so that the step's multiplier is ``total`` by Eq. (1):
    1/z_left^2 = 1/total^2 - sum_m 1/z_m^2. ``total`` 0 gives 0 (a non-private run); others
    leaving nothing raise ValueError, naming them (``spent_by``) and what to do (``advice``)."""
    total = check.non_negative("noise_multiplier", total)
    if total == 0:
        return 0.0
    spent = sum(_precision(check.non_negative("noise_multiplier", z, allow_inf=True))
                for z in others)
    left = _precision(total) - spent
    if not left > 0:
        raise ValueError(f"{spent_by} spend all of the step's noise multiplier {total:.4g} "
                         f"(1/z^2 = {_precision(total):.4g} against {spent:.4g} for them): "
                         f"{advice}")
    return left ** -0.5


def _precision(z: float) -> float:
    """1 / z^2, ``inf`` for 0 and for z so small that z^2 underflows."""
    squared = z * z
    return math.inf if squared == 0 else 1 / squared


SCALE_RANGE = (1e-12, 1e12)  # alpha_j whose 1/alpha_j^2 float32 holds with room to spare


@dataclass(frozen=True)
class Group:
    """Leaves clipped together to L2 norm ``clip`` (S_g), with noise of standard deviation
    ``noise_std`` (sigma~_g) added to their *sum*; ``scales`` (alpha_j, one per leaf) make it a
    joint group."""

    name: str
    leaves: tuple[str, ...]
    clip: float
    noise_std: float
    scales: tuple[float, ...] | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"group name must be a non-empty string, got {self.name!r}")
        # a set's order is its hashes' (a dict's leaves would be its keys, its values lost)
        if isinstance(self.leaves, (set, frozenset, dict)):
            raise TypeError(f"group {self.name!r}: leaves must be ordered (a list or tuple), "
                            f"got a {type(self.leaves).__name__}: a scale, and the order of "
                            f"the noise, follow the leaves' order")
        leaves = (self.leaves,) if isinstance(self.leaves, str) else tuple(self.leaves)
        if not leaves:
            raise ValueError(f"group {self.name!r}: leaves must be non-empty")
        for leaf in leaves:
            if not isinstance(leaf, str) or not leaf:
                raise ValueError(f"group {self.name!r}: leaf names must be non-empty strings, "
                                 f"got {leaf!r}")
        repeated = sorted({leaf for leaf in leaves if leaves.count(leaf) > 1})
        if repeated:
            raise ValueError(f"group {self.name!r}: leaves {repeated} appear more than once")
        object.__setattr__(self, "leaves", leaves)
        object.__setattr__(self, "clip", check.positive(f"group {self.name!r} clip", self.clip))
        object.__setattr__(self, "noise_std",
                           check.non_negative(f"group {self.name!r} noise_std", self.noise_std))
        if self.scales is not None:
            if not isinstance(self.scales, (list, tuple)):
                raise TypeError(f"group {self.name!r}: scales must be a list or tuple of one "
                                f"scale per leaf, got {self.scales!r}")
            if len(self.scales) != len(leaves):
                raise ValueError(f"group {self.name!r}: {len(self.scales)} scales for "
                                 f"{len(leaves)} leaves; give one scale per leaf")
            scales = tuple(check.positive(f"group {self.name!r} scale of {leaf!r}", a)
                           for leaf, a in zip(leaves, self.scales))
            for leaf, a in zip(leaves, scales):
                if not SCALE_RANGE[0] <= a <= SCALE_RANGE[1]:
                    raise ValueError(
                        f"group {self.name!r}: the scale of {leaf!r} must lie in "
                        f"[{SCALE_RANGE[0]:g}, {SCALE_RANGE[1]:g}], got {a!r}: its weight "
                        f"1/alpha^2 in a float32 norm would round to 0 (the leaf then escapes "
                        f"the clip) or overflow")
            object.__setattr__(self, "scales", scales)

    @property
    def privacy_tuple(self) -> tuple[float, float]:
        return (self.clip, self.noise_std)

    @property
    def noise_multiplier(self) -> float:
        return self.noise_std / self.clip

    def scale(self, leaf: str) -> float:
        """alpha_j of ``leaf`` (1 under separate clipping)."""
        return 1.0 if self.scales is None else self.scales[self.leaves.index(leaf)]

    def leaf_noise_std(self, leaf: str) -> float:
        """Standard deviation of the noise added to the sum of ``leaf``: alpha_j sigma~_g."""
        return self.scale(leaf) * self.noise_std


@dataclass(frozen=True)
class Mechanism:
    """A partition of the leaves into groups, and the unit of privacy (the record).

    ``record`` is ``"example"``, ``"microbatch"`` (a record is the mean of
    ``microbatch_size`` examples) or ``"user"`` (all data of one user).
    """

    groups: tuple[Group, ...]
    record: str = "example"
    microbatch_size: int | None = None

    def __post_init__(self):
        groups = (self.groups,) if isinstance(self.groups, Group) else tuple(self.groups)
        if not groups:
            raise ValueError("a mechanism needs at least one group")
        for group in groups:
            if not isinstance(group, Group):
                raise TypeError(f"groups must be Group objects, got {group!r}")
        names = [g.name for g in groups]
        dup_names = sorted({n for n in names if names.count(n) > 1})
        if dup_names:
            raise ValueError(f"group names must be unique; repeated: {dup_names}")
        owner: dict[str, str] = {}
        for group in groups:
            for leaf in group.leaves:
                if leaf in owner:
                    raise ValueError(f"groups overlap: leaf {leaf!r} is in both group "
                                     f"{owner[leaf]!r} and group {group.name!r}")
                owner[leaf] = group.name
        check_record(self.record, self.microbatch_size)
        object.__setattr__(self, "groups", groups)

    def __getstate__(self) -> dict:  # the fields only, not the cached properties below
        return {"groups": self.groups, "record": self.record,
                "microbatch_size": self.microbatch_size}

    # derived once per (immutable) mechanism: steps read them every time
    @cached_property
    def leaves(self) -> tuple[str, ...]:
        """All leaf names, group by group."""
        return tuple(leaf for g in self.groups for leaf in g.leaves)

    @cached_property
    def group_index(self) -> Mapping[str, int]:
        """{leaf: index of its group in ``groups``} (read-only)."""
        return MappingProxyType({leaf: g for g, group in enumerate(self.groups)
                                 for leaf in group.leaves})

    @property
    def noise_multiplier(self) -> float:
        """z of Eq. (1) for all groups together."""
        return effective_noise_multiplier(g.privacy_tuple for g in self.groups)

    def group_of(self, leaf: str) -> Group:
        for group in self.groups:
            if leaf in group.leaves:
                return group
        raise KeyError(f"leaf {leaf!r} is in no group")

    def check_leaves(self, names: Iterable[str]) -> None:
        """Raise unless ``names`` are exactly the mechanism's leaves (none missing, none extra)."""
        names = set(names)
        if names == self.group_index.keys():
            return
        ours = set(self.leaves)
        extra, missing = sorted(names - ours), sorted(ours - names)
        if extra or missing:
            parts = []
            if extra:
                parts.append(f"leaves in no group: {extra}")
            if missing:
                parts.append(f"leaves the groups name but the record lacks: {missing}")
            raise ValueError("the record's leaves do not match the mechanism's groups; "
                             + "; ".join(parts))

    def with_noise(self, noise_stds: Mapping[str, float] | Sequence[float]) -> "Mechanism":
        """The same groups with new sigma~_g (by group name, or in group order)."""
        if not isinstance(noise_stds, Mapping):
            noise_stds = dict(zip([g.name for g in self.groups], noise_stds, strict=True))
        return Mechanism(tuple(Group(g.name, g.leaves, g.clip, noise_stds[g.name], g.scales)
                               for g in self.groups), self.record, self.microbatch_size)
