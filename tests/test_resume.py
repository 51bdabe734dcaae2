"""A resumed run (an aggregator on a ledger that holds steps) continues the run: its steps are
numbered on, clip schedules go on, seeded draws are new, adaptive clips come back from a
checkpoint, and a checkpoint the ledger does not cover is refused."""

import json
import shutil

import numpy as np
import pytest

from dpcore import Ledger, PrivateAggregator, flat
from dpcore.adaptive import QuantileClipping
from dpcore.schedules import ClipSchedule, step_decay

N, Q = 1000, 0.05
MECHANISM = flat(["v"], clip=1.0, noise_multiplier=1.0)


def run(agg: PrivateAggregator, steps: int, rng=None) -> list[tuple[np.ndarray, np.ndarray]]:
    """``steps`` steps of ``agg`` on records of norm about 2 (zeros without ``rng``): each
    step's sample and release."""
    out = []
    for _ in range(steps):
        idx = agg.sample()
        rows = (np.zeros((len(idx), 3)) if rng is None
                else rng.normal(size=(len(idx), 3)) * 2 / np.sqrt(3))
        out.append((idx, agg.release({"v": rows})["v"]))
    return out


def test_steps_and_clip_schedules_continue_from_the_ledger(tmp_path):
    path = tmp_path / "run.jsonl"
    schedule = ClipSchedule(step_decay(1, 0.5), hold="noise_multiplier")
    first = PrivateAggregator(MECHANISM, n=N, q=Q, ledger=path, clipping=schedule)
    assert (first.start_step, first.step, first.begun) == (0, -1, False)
    run(first, 3)
    assert first.state_dict() == {"steps": 3}
    first.ledger.close()

    resumed = PrivateAggregator(MECHANISM, n=N, q=Q, ledger=path, clipping=schedule)
    assert (resumed.start_step, resumed.step, resumed.begun) == (3, 2, False)
    with pytest.raises(RuntimeError, match="no sample to release from"):
        resumed.release({"v": np.zeros((1, 3))})  # not into the last run's last step
    run(resumed, 2)
    assert resumed.step == 4
    clips = [e.clip for e in resumed.ledger.events if hasattr(e, "clip")]
    assert clips == [1.0, 0.5, 0.25, 0.125, 0.0625]  # not 1.0, 0.5 again
    assert resumed.ledger.samplings == 5
    resumed.ledger.close()


def test_a_resumed_seeded_run_draws_new_samples_and_noise(tmp_path):
    """The same seed must not repeat the steps it continues: the same noise on two steps
    cancels in the difference of their releases. Resuming the same ledger twice draws
    alike (the seed still reproduces)."""
    path = tmp_path / "run.jsonl"
    agg = PrivateAggregator(MECHANISM, n=N, q=Q, ledger=path, seed=7)
    before = run(agg, 3)
    agg.ledger.close()
    shutil.copy(path, tmp_path / "copy.jsonl")
    after = []
    for name in ("run.jsonl", "copy.jsonl"):
        resumed = PrivateAggregator(MECHANISM, n=N, q=Q, ledger=tmp_path / name, seed=7)
        after.append(run(resumed, 3))
        resumed.ledger.close()
    for (idx, noise), (idx2, noise2) in zip(*after):
        assert np.array_equal(idx, idx2) and np.array_equal(noise, noise2)
    for idx, noise in after[0]:
        for old_idx, old_noise in before:
            assert not np.array_equal(idx, old_idx)
            assert not np.any(np.isclose(noise, old_noise, rtol=0, atol=1e-12))


def test_adaptive_clips_come_back_from_a_checkpoint(tmp_path):
    """Three steps, a checkpoint, then a resumed aggregator: its next clip is the one the
    uninterrupted run (same seed, same records) used at that step; without the
    checkpoint's state it would start again from the initial clip."""
    clipping = QuantileClipping(target_quantile=0.9, learning_rate=0.5)
    whole = PrivateAggregator(MECHANISM, n=N, q=Q, seed=3, clipping=clipping)
    run(whole, 4, np.random.default_rng(0))
    want = [e.clip for e in whole.ledger.events if getattr(e, "group", "") == "all"][3]

    path = tmp_path / "run.jsonl"
    first = PrivateAggregator(MECHANISM, n=N, q=Q, ledger=path, seed=3, clipping=clipping)
    run(first, 3, np.random.default_rng(0))
    state = json.loads(json.dumps(first.state_dict()))  # a checkpoint's round trip
    first.ledger.close()
    assert state["steps"] == 3 and len(state["clips"]) == 1

    resumed = PrivateAggregator(MECHANISM, n=N, q=Q, ledger=path, clipping=clipping)
    assert resumed.mechanism.groups[0].clip == 1.0  # the initial clip, until loaded
    resumed.load_state_dict(state)
    assert want != 1.0 and resumed.mechanism.groups[0].clip == pytest.approx(want, rel=1e-12)
    resumed.sample()
    assert resumed.mechanism.groups[0].clip == pytest.approx(want, rel=1e-12)
    resumed.ledger.close()


def test_a_checkpoint_the_ledger_does_not_cover_is_refused(tmp_path):
    """Resuming with a new ledger (a forgotten path) would leave the checkpoint's steps
    unaccounted."""
    agg = PrivateAggregator(MECHANISM, n=N, q=Q)
    with pytest.raises(ValueError, match=r"after 5 steps, but the ledger holds 0"):
        agg.load_state_dict({"steps": 5})
    with pytest.raises(ValueError, match="lacks adaptive clipping's clips"):
        PrivateAggregator(MECHANISM, n=N, q=Q, clipping=QuantileClipping()).load_state_dict(
            {"steps": 0})
    with pytest.raises(ValueError, match="has adaptive clipping's clips"):
        agg.load_state_dict({"steps": 0, "clips": [1.0]})
    with pytest.raises(TypeError, match="steps must be an integer"):
        agg.load_state_dict({})
    agg.load_state_dict({"steps": 0})  # an earlier checkpoint of this ledger: fine
    agg.sample()
    with pytest.raises(RuntimeError, match="before the first step"):
        agg.load_state_dict({"steps": 0})


def test_an_earlier_checkpoint_than_the_ledger_continues_at_the_ledger_s_step(tmp_path):
    """A crash after the checkpoint: the ledger holds the steps taken since (they were
    released), and the run's numbering goes on from there."""
    ledger = Ledger()
    agg = PrivateAggregator(MECHANISM, n=N, q=Q, ledger=ledger)
    run(agg, 2)
    state = agg.state_dict()
    run(agg, 3)
    resumed = PrivateAggregator(MECHANISM, n=N, q=Q, ledger=ledger)
    resumed.load_state_dict(state)
    resumed.sample()
    assert resumed.step == 5 and ledger.samplings == 6


def test_a_failed_aggregator_leaves_its_ledger_file_unlocked(tmp_path):
    """Bad settings are refused before the file is opened, or the file is closed again: a
    traceback that keeps the failed constructor's frame (a notebook) must not keep its lock,
    so the corrected call can open the ledger."""
    path = tmp_path / "run.jsonl"
    with pytest.raises(ValueError, match="takes no seed"):
        PrivateAggregator(MECHANISM, n=N, q=Q, ledger=path, secure=True, seed=1)
    assert not path.exists()
    with pytest.raises(ValueError, match="clip schedule factor at step 0"):
        PrivateAggregator(MECHANISM, n=N, q=Q, ledger=path,
                          clipping=ClipSchedule(lambda step: -1.0))
    PrivateAggregator(MECHANISM, n=N, q=Q, ledger=path).ledger.close()
