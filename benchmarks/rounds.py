"""One round of the side-by-side step timings: a block of consecutive steps of each kind in
turn, the steady state of a training loop (which runs one kind of step), so that drift of the
machine hits all kinds alike while no kind starts its timed steps from another's caches."""

from __future__ import annotations

import time
from typing import Callable, Mapping


def one_round(steps: Mapping[object, Callable[[], object]], timed: int, times=None) -> None:
    """For each kind in ``steps``: one untimed step (caches move over from the previous kind),
    then ``timed`` steps whose durations are appended to ``times[kind]`` (if ``times`` is
    given)."""
    for kind, step in steps.items():
        step()
        for _ in range(timed):
            start = time.perf_counter()
            step()
            if times is not None:
                times[kind].append(time.perf_counter() - start)
