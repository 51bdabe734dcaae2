"""How far one more record moves each group's clipped sum, in units of the group's clip (the
clipping tests under autocast add identical records one at a time)."""

import math


def group_moves(mechanism, out, last) -> dict:
    """``{group name: ||out - last|| over the group's leaves / its clip}``."""
    return {g.name: math.sqrt(sum(float((out[leaf] - last[leaf]).square().sum())
                                  for leaf in g.leaves)) / g.clip
            for g in mechanism.groups}
