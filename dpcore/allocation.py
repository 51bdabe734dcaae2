"""Allocation strategies: split a total clip bound S* and a target noise multiplier z over groups.

Clip splits (McMahan & Andrew 2018, section 2), each keeping sum_g S_g^2 = S*^2 so a record's
whole contribution stays within S*:

* ``"equal"``: S_g = S* / sqrt(G) (with one group per layer, "per-layer clipping");
* ``"dimension"``: S_g = S* sqrt(d_g / D), where d_g is the group's dimension and D = sum d_g.

Noise allocations for a target z (section 4), each satisfying Eq. (1) exactly, i.e.
sum_g (S_g / sigma~_g)^2 = 1 / z^2:

* ``"proportional"``: sigma~_g = z sqrt(G) S_g;
* ``"dimension"``: sigma~_g = z sqrt(D / d_g) S_g (equal noise per coordinate relative to the
  root-mean-square value a coordinate of the group can take).
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from . import _validation as check
from .queries import Group, Mechanism

CLIP_SPLITS = ("equal", "dimension")
NOISE_SPLITS = ("proportional", "dimension")


def _sizes(sizes: Sequence[int]) -> list[int]:
    sizes = [check.count("group dimension", d, minimum=1) for d in sizes]
    if not sizes:
        raise ValueError("need at least one group")
    return sizes


def split_clip(total_clip: float, sizes: Sequence[int], how: str = "equal") -> list[float]:
    """Per-group clip bounds S_g with sum_g S_g^2 = total_clip^2."""
    total_clip = check.positive("total_clip", total_clip)
    sizes = _sizes(sizes)
    if how == "equal":
        return [total_clip / math.sqrt(len(sizes))] * len(sizes)
    if how == "dimension":
        total = sum(sizes)
        return [total_clip * math.sqrt(d / total) for d in sizes]
    raise ValueError(f"clip split must be one of {CLIP_SPLITS}, got {how!r}")


def allocate_noise(clips: Sequence[float], sizes: Sequence[int], noise_multiplier: float,
                   how: str = "proportional") -> list[float]:
    """Per-group noise standard deviations sigma~_g whose Eq. (1) multiplier is exactly z."""
    z = check.non_negative("noise_multiplier", noise_multiplier)
    clips = [check.positive("clip", s) for s in clips]
    sizes = _sizes(sizes)
    if len(clips) != len(sizes):
        raise ValueError(f"{len(clips)} clips for {len(sizes)} group dimensions")
    if how == "proportional":
        return [z * math.sqrt(len(clips)) * s for s in clips]
    if how == "dimension":
        total = sum(sizes)
        return [z * math.sqrt(total / d) * s for s, d in zip(clips, sizes)]
    raise ValueError(f"noise split must be one of {NOISE_SPLITS}, got {how!r}")


def flat(leaves: Sequence[str], clip: float, noise_multiplier: float, *, name: str = "all",
         record: str = "example", microbatch_size: int | None = None) -> Mechanism:
    """Flat clipping: all leaves one vector, clipped to ``clip``, noise ``noise_multiplier * clip``."""
    clip = check.positive("clip", clip)
    z = check.non_negative("noise_multiplier", noise_multiplier)
    leaves = (leaves,) if isinstance(leaves, str) else tuple(leaves)  # one leaf, named
    return Mechanism((Group(name, leaves, clip, z * clip),), record, microbatch_size)


def grouped(groups: Mapping[str, Sequence[str]], leaf_sizes: Mapping[str, int], total_clip: float,
            noise_multiplier: float, *, clip_split: str = "equal",
            noise_split: str = "proportional", record: str = "example",
            microbatch_size: int | None = None) -> Mechanism:
    """Separate clipping of each group in ``groups`` (name -> leaves), with the total clip and
    the target z split by the chosen strategies. ``leaf_sizes`` maps leaf -> number of entries."""
    if not groups:
        raise ValueError("need at least one group")
    groups = {name: (leaves,) if isinstance(leaves, str) else tuple(leaves)  # one leaf, named
              for name, leaves in groups.items()}
    missing = sorted({leaf for leaves in groups.values() for leaf in leaves} - set(leaf_sizes))
    if missing:
        raise ValueError(f"leaf_sizes lacks the size of leaves {missing}")
    counts = {leaf: check.count(f"the size of leaf {leaf!r}", size)  # Python ints: no
              for leaf, size in leaf_sizes.items()}                # wrap-around in a sum
    sizes = [sum(counts[leaf] for leaf in leaves) for leaves in groups.values()]
    empty = [name for name, size in zip(groups, sizes) if size == 0]
    if empty:
        raise ValueError(f"groups {empty} hold no values (leaves of size 0: "
                         f"{[leaf for name in empty for leaf in groups[name]]}); leave those "
                         f"leaves out, as they have nothing to release")
    clips = split_clip(total_clip, sizes, clip_split)
    noise = allocate_noise(clips, sizes, noise_multiplier, noise_split)
    return Mechanism(tuple(Group(name, tuple(leaves), s, sigma)
                           for (name, leaves), s, sigma in zip(groups.items(), clips, noise)),
                     record, microbatch_size)


def per_layer(leaf_sizes: Mapping[str, int], total_clip: float, noise_multiplier: float,
              **kwargs) -> Mechanism:
    """Each leaf its own group (per-layer clipping); options as in :func:`grouped`."""
    return grouped({leaf: (leaf,) for leaf in leaf_sizes}, leaf_sizes, total_clip,
                   noise_multiplier, **kwargs)
