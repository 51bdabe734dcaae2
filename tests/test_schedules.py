"""Clip schedules: the ledger records the clip and noise actually used at every step."""

import math

import numpy as np
import pytest

from dpcore import PrivateAggregator, flat
from dpcore.ledger import SumQueryEvent
from dpcore.schedules import ClipSchedule, decreasing, exponential, step_decay


def run(schedule, steps=5):
    agg = PrivateAggregator(flat(["x"], clip=8.0, noise_multiplier=1.5), n=100, q=0.1, seed=0,
                            clipping=schedule)
    for _ in range(steps):
        idx = agg.sample()
        agg.release({"x": np.full((len(idx), 3), 10.0)})
    return [e for e in agg.ledger.events if isinstance(e, SumQueryEvent)], agg


def test_decreasing_clip_of_the_momentum_paper():
    f = decreasing(1000)
    assert [f(0), f(500), f(1000), f(5000)] == [1.0, pytest.approx(1 / 1.5), 0.5, 0.5]


def test_noise_std_held_fixed_makes_later_steps_cheaper():
    events, agg = run(ClipSchedule(decreasing(2), hold="noise_std"))
    assert [e.clip for e in events] == pytest.approx([8 / min(2, 1 + t / 2) for t in range(5)])
    assert all(e.noise_std == pytest.approx(12.0) for e in events)
    multipliers = [s.noise_multiplier for s in agg.ledger.steps()]
    assert multipliers == pytest.approx([1.5, 1.5 * 1.5, 3.0])  # the last three steps merged
    assert agg.ledger.steps()[-1].count == 3


def test_noise_multiplier_held_fixed():
    events, agg = run(ClipSchedule(exponential(0.1), hold="noise_multiplier"))
    assert [e.clip for e in events] == pytest.approx([8 * math.exp(-0.1 * t) for t in range(5)])
    assert [e.noise_std / e.clip for e in events] == pytest.approx([1.5] * 5)
    assert [s.noise_multiplier for s in agg.ledger.steps()] == pytest.approx([1.5] * len(agg.ledger.steps()))


def test_the_sum_is_clipped_at_the_scheduled_bound():
    schedule = ClipSchedule(step_decay(every=2, factor=0.5), hold="noise_multiplier")
    agg = PrivateAggregator(flat(["x"], clip=1.0, noise_multiplier=0.0), n=10, q=1.0,
                            clipping=schedule)
    outs = []
    for _ in range(4):
        agg.sample()
        outs.append(agg.release({"x": np.full((10, 1), 5.0)})["x"][0])
    assert outs == pytest.approx([1.0, 1.0, 0.5, 0.5])  # 10 records clipped to C_t, / (q n)


def test_bad_schedules():
    with pytest.raises(ValueError, match=r"clip schedule factor at step 0 must be finite and > 0, got 0\.0"):
        run(ClipSchedule(lambda t: 0.0), steps=1)
    events, agg = run(ClipSchedule(step_decay(1, 2.0), hold="noise_multiplier"), steps=1021)
    assert events[-1].clip == 8.0 * 2.0 ** 1020
    with pytest.raises(ValueError, match=r"factor at step 1021 = 2\.247.*e\+307: group 'all' "
                                         r"clip must be finite and > 0, got inf"):
        agg.begin_step()  # 8 * 2^1021 overflows
    assert agg.ledger.samplings == 1021  # nothing of the refused step recorded
    policy = ClipSchedule(step_decay(1, 2.0)).bind(flat(["x"], 1e-300, 1.0), 10.0)
    assert policy.mechanism(1023).groups[0].clip == 1e-300 * 2.0 ** 1023
    with pytest.raises(ValueError, match=r"clip schedule factor at step 1024 overflowed"):
        policy.mechanism(1024)  # 2.0 ** 1024 is no float
    with pytest.raises(ValueError, match="hold must be one of"):
        ClipSchedule(decreasing(10), hold="clip")
    with pytest.raises(TypeError, match="clipping must be a ClipSchedule or a QuantileClipping"):
        PrivateAggregator(flat(["x"], 1.0, 1.0), n=10, q=0.5, clipping="adaptive")
    with pytest.raises(TypeError, match="factor must be callable"):
        ClipSchedule(0.5)
    with pytest.raises(ValueError, match="horizon must be finite and > 0"):
        decreasing(0)
