"""Budget-driven training: steps stop exactly where the accountant says the budget ends."""

import warnings

import numpy as np
import pytest

from dpcore import PrivateAggregator, flat
from dpcore.accounting import epsilon
from dpcore.budget import BudgetExhaustedError, PrivacyBudget
from dpcore.ledger import Ledger, Step
from dpcore.schedules import ClipSchedule, decreasing

DELTA, TARGET = 1e-5, 2.0


def train_until_spent(agg):
    steps = 0
    while True:
        try:
            agg.begin_step()
        except BudgetExhaustedError as exc:
            return steps, exc
        agg.release_sums({"x": np.zeros(1)})
        steps += 1


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_training_stops_at_the_last_step_that_fits(accountant):
    budget = PrivacyBudget(TARGET, DELTA, accountant=accountant)
    agg = PrivateAggregator(flat(["x"], clip=1.0, noise_multiplier=1.5), n=1000, q=0.05,
                            budget=budget, seed=0)
    taken, exc = train_until_spent(agg)
    assert taken > 0 and "would exceed the budget" in str(exc)
    spent = epsilon(agg.ledger, DELTA, accountant=accountant)
    one_more = epsilon(agg.ledger.steps() + [Step(0.05, 1.5)], DELTA, accountant=accountant)
    assert spent <= TARGET < one_more
    # the refused step left no trace in the ledger
    assert sum(s.count for s in agg.ledger.steps()) == taken
    assert not agg.next_step_fits()


def test_a_decreasing_clip_with_fixed_noise_fits_more_steps():
    def steps_with(schedule):
        agg = PrivateAggregator(flat(["x"], clip=1.0, noise_multiplier=1.5), n=1000, q=0.05,
                                budget=PrivacyBudget(TARGET, DELTA, accountant="rdp"),
                                clipping=schedule, seed=0)
        taken, _ = train_until_spent(agg)
        assert epsilon(agg.ledger, DELTA, accountant="rdp") <= TARGET
        return taken

    plain = steps_with(None)
    decreasing_clip = steps_with(ClipSchedule(decreasing(20), hold="noise_std"))
    assert decreasing_clip > 1.5 * plain


def test_bad_budgets():
    with pytest.raises(ValueError, match="target_epsilon must be finite and >= 0, got -1"):
        PrivacyBudget(-1, 1e-5)
    with pytest.raises(ValueError, match=r"delta must be in \(0, 1\), got 1\.0"):
        PrivacyBudget(1.0, 1.0)


def test_a_budget_over_many_distinct_noise_multipliers_ends_within_its_target():
    """A slowly decreasing clip at fixed noise: z changes at every step, and past 256 distinct
    values the accountant rounds them down onto its grid (1.0009 onto 1.0). The budget prices
    with that rounding too, so the finished ledger is within the target (it was at 2.004)."""
    from dpcore.accounting import guarantee

    agg = PrivateAggregator(flat(["x"], clip=1.0, noise_multiplier=1.0009), n=10_000, q=0.01,
                            budget=PrivacyBudget(2.0, 1e-5, accountant="rdp"),
                            clipping=ClipSchedule(decreasing(1e7), hold="noise_std"), seed=0)
    with pytest.raises(BudgetExhaustedError):
        while True:
            agg.begin_step()
            agg.release_sums({"x": np.zeros(1)})
    final = guarantee(agg.ledger, 1e-5, accountant="rdp")
    assert final.rounded and len(agg.ledger.steps()) > 256
    assert 1.99 < final.epsilon <= 2.0


@pytest.mark.parametrize("target", [1.08, 1.1])
def test_a_budget_counts_the_noise_multipliers_the_ledger_holds(monkeypatch, target):
    """A metric declared as extra but released every other step: the budget priced every
    step with it and counted half as many distinct (q, z) as the ledger held, so the ledger
    crossed the accountant's group limit (and was priced rounded) while the budget priced
    it exactly: 1.0809 for a target of 1.08 (1.602 for 1.6 at the real limit of 256)."""
    from dpcore import Group, Mechanism
    from dpcore.accounting import guarantee, rdp
    from dpcore.schedules import step_decay

    monkeypatch.setattr(rdp, "DEFAULT_MAX_GROUPS", 16)  # reached in 30 steps, not 500
    metric = Mechanism((Group("metric", ("m",), clip=1.0, noise_std=50.0),))
    agg = PrivateAggregator(flat(["x"], clip=1.0, noise_multiplier=1.0009), n=10_000, q=0.01,
                            budget=PrivacyBudget(target, 1e-5, accountant="rdp"), extra=[metric],
                            clipping=ClipSchedule(step_decay(every=2, factor=1 - 1e-7),
                                                  hold="noise_std"), seed=0)
    with pytest.raises(BudgetExhaustedError):
        while True:
            agg.begin_step()
            agg.release_sums({"x": np.zeros(1)})
            if agg.step % 2 == 0:
                agg.release({"m": np.zeros((0, 1))}, mechanism=metric)
    final = guarantee(agg.ledger, 1e-5, accountant="rdp", max_groups=16)
    assert final.rounded and len(agg.ledger.steps()) > 16
    assert final.epsilon <= target


def test_an_unknown_accountant_is_refused_when_the_budget_is_made():
    with pytest.raises(ValueError, match="accountant must be 'pld' or 'rdp', got 'prv'"):
        PrivacyBudget(1.0, 1e-5, accountant="prv")


@pytest.mark.parametrize("q,z,message", [(-0.5, 1.5, "q"),
                                         (0.05, float("nan"), "noise_multiplier")])
def test_a_budget_refuses_a_bad_step_even_within_its_credit(q, z, message):
    budget = PrivacyBudget(2.0, 1e-5)
    ledger = Ledger()
    assert budget.allows(ledger, 0.05, 1.5)  # a credit at (0.05, 1.5)
    with pytest.raises(ValueError, match=message):
        budget.allows(ledger, q, z)
    with pytest.raises(ValueError, match=message):
        budget.spend(q, z)


def test_a_delta_not_below_one_over_n_is_warned_of():
    """delta >= 1/n admits publishing one record in full: accepted silently, it is now
    warned of (below 1/n, nothing is said)."""
    with pytest.warns(UserWarning, match=r"delta=0\.01 is not below 1/n = 0\.01 \(n=100"):
        PrivateAggregator(flat(["w"], 1.0, 1.0), n=100, q=0.1, budget=PrivacyBudget(2.0, 0.01))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PrivateAggregator(flat(["w"], 1.0, 1.0), n=100, q=0.1, budget=PrivacyBudget(2.0, 0.0099))
