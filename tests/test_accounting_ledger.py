"""Ledger in, epsilon out: guarantee(), epsilon(), delta_for_epsilon(), remaining_steps()."""

import math

import numpy as np
import pytest

from dpcore.accounting import (Guarantee, PLDAccountant, calibrate_noise_multiplier,
                               calibrate_sampling_rate, delta_for_epsilon, epsilon,
                               epsilon_from_rdp, guarantee, make_accountant, remaining_steps)
from dpcore.accounting.guarantee import _largest_true
from dpcore.accounting.rdp import RDPAccountant, _step_rdp, rdp_subsampled_gaussian
from dpcore.accounting.steps import Group, group_steps
from dpcore.ledger import Ledger, LedgerError, Step, SumQueryEvent, read_ledger


def multi_group_ledger(path=None, steps=200):
    ledger = Ledger(path)
    for _ in range(steps):
        ledger.record_sampling(0.01, 10000)
        ledger.record_sum_queries([SumQueryEvent("layer1", 1.0, 2.0),
                                   SumQueryEvent("layer2", 0.5, 1.5),
                                   SumQueryEvent("count", 0.5, 10.0)])
    return ledger


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_multi_group_ledger_equals_one_query_with_eq1_z(accountant):
    z = ((1.0 / 2.0) ** 2 + (0.5 / 1.5) ** 2 + (0.5 / 10.0) ** 2) ** -0.5
    ours = epsilon(multi_group_ledger(), 1e-5, accountant=accountant)
    assert ours == epsilon([(0.01, z, 200)], 1e-5, accountant=accountant)


def test_ledger_file_and_object_agree(tmp_path):
    path = tmp_path / "run.jsonl"
    multi_group_ledger(path).close()
    from_file = guarantee(path, 1e-6)
    from_object = guarantee(read_ledger(path), 1e-6)
    assert from_file == from_object
    assert from_file.steps == 200 and from_file.accountant == "pld"
    assert guarantee(str(path), 1e-6, accountant="rdp").order is not None


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
@pytest.mark.parametrize("copies", [2, 1100])
def test_steps_of_one_kind_past_2_to_the_53_are_refused_in_total(accountant, copies):
    """Each (q, z, 2^53) is accepted alone; their total is refused: summed in int64, 1,100
    of them wrapped to a negative count and RDP reported epsilon 0."""
    with pytest.raises(ValueError, match=r"steps at q=0\.01, z=1\.0: at most 2\^53"):
        epsilon([(0.01, 1.0, 2 ** 53)] * copies, 1e-5, accountant=accountant)


def test_noise_multipliers_a_few_ulps_apart_are_priced_as_one_at_the_smaller():
    z = 1.1
    near = math.nextafter(math.nextafter(z, 2), 2)  # 1.1000000000000003
    far = z * (1 + 1e-9)
    composition = group_steps([(0.01, near, 3), (0.01, z, 2), (0.02, near, 1), (0.01, far, 1),
                               (0.01, math.inf, 4)])
    assert composition.groups == (Group(0.01, z, 5), Group(0.01, far, 1), Group(0.02, z, 1))
    assert composition.steps == 11 and not composition.rounded
    for accountant in ("pld", "rdp"):
        assert epsilon([(0.01, near, 3), (0.01, z, 2)], 1e-5, accountant=accountant) == \
            epsilon([(0.01, z, 5)], 1e-5, accountant=accountant)


def test_steps_that_released_nothing_are_free():
    ledger = Ledger()
    for _ in range(50):
        ledger.record_sampling(0.5, 100)  # sampled, but no sum query released
    assert epsilon(ledger, 1e-5) == 0.0
    ledger.record_sum_queries([SumQueryEvent("g", 1.0, 0.0)])  # a noiseless release
    assert epsilon(ledger, 1e-5) == math.inf
    assert guarantee(ledger, 1e-5).to_json()["epsilon"] == "inf"


def test_accountants_check_the_neighbouring_relation():
    ledger = multi_group_ledger(steps=2)
    ledger.header = _FakeHeader()
    with pytest.raises(LedgerError, match="replace_one"):
        epsilon(ledger, 1e-5)


class _FakeHeader:
    neighbouring = "replace_one"


def test_delta_for_epsilon_inverts_epsilon():
    ledger = multi_group_ledger()
    eps = epsilon(ledger, 1e-6)
    assert delta_for_epsilon(ledger, eps) <= 1e-6 * (1 + 1e-9)
    assert delta_for_epsilon(ledger, eps, accountant="rdp") >= delta_for_epsilon(ledger, eps)


def test_remaining_steps_fits_the_budget_exactly():
    past = [Step(0.01, 1.0, 300)]
    k = remaining_steps(past, 0.01, 1.0, 2.0, 1e-5)
    assert epsilon(past + [(0.01, 1.0, k)], 1e-5) <= 2.0
    assert epsilon(past + [(0.01, 1.0, k + 1)], 1e-5) > 2.0
    assert remaining_steps([], 0.01, 1.0, 2.0, 1e-5) == k + 300


def test_remaining_steps_edge_cases():
    spent = [Step(0.5, 0.5, 100)]
    assert remaining_steps(spent, 0.01, 1.0, 1.0, 1e-5) == 0
    assert remaining_steps([], 0.0, 1.0, 1.0, 1e-5, max_steps=1000) == 1000
    assert remaining_steps([], 0.1, math.inf, 1.0, 1e-5, max_steps=77) == 77
    assert remaining_steps([], 0.1, 0.0, 1.0, 1e-5) == 0
    assert remaining_steps([], 1e-6, 50.0, 1.0, 1e-5, max_steps=500) == 500


def test_guarantee_fields():
    g = guarantee([(256 / 60000, 1.1, 14063)], 1e-5, accountant="rdp")
    assert isinstance(g, Guarantee)
    assert g.epsilon == pytest.approx(2.5966, abs=1e-3) and g.order == 8.1 and not g.rounded


@pytest.mark.parametrize("call,error,message", [
    (lambda: epsilon([(0.1, 1.0, 10)], 0.0), ValueError, r"delta must be in \(0, 1\)"),
    (lambda: epsilon([(0.1, 1.0, 10)], 1.0), ValueError, r"delta must be in \(0, 1\)"),
    (lambda: epsilon([(0.1, 1.0, 10)], 1e-5, accountant="moments"), ValueError,
     "accountant must be one of"),
    (lambda: delta_for_epsilon([(0.1, 1.0, 10)], -1.0), ValueError, "epsilon must be"),
    (lambda: remaining_steps([], 0.1, 1.0, -1.0, 1e-5), ValueError, "target_epsilon must be"),
    (lambda: remaining_steps([], 1.1, 1.0, 1.0, 1e-5), ValueError, "q"),
    (lambda: epsilon([(0.1, 1.0, 2.5)], 1e-5), TypeError, "steps must be an integer"),
    (lambda: epsilon([(0.1, 1.0, 10 ** 19)], 1e-5, accountant="rdp"), ValueError,
     r"steps must be at most 2\^53"),
    (lambda: epsilon([(0.1,)], 1e-5), TypeError, r"\(q, z\[, count\]\)"),
    (lambda: epsilon("/nonexistent/ledger.jsonl", 1e-5), LedgerError, "cannot read ledger"),
])
def test_bad_input(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_make_accountant_passes_options():
    acc = make_accountant([(0.01, 1.0, 10)], "rdp", orders=[2, 4, 8])
    assert list(acc.orders) == [2, 4, 8]


@pytest.mark.parametrize("step", [Step(True, 1.0, 10), Step("0.01", 1.0, 10),
                                  Step(0.01, "1.0", 10)])
def test_a_step_object_gets_the_type_checks_a_tuple_gets(step):
    """numpy would read True as q = 1 and "0.01" as 0.01."""
    with pytest.raises(TypeError, match="must be a real number"):
        epsilon([step], 1e-5)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_remaining_steps_after_many_noise_levels_fits_the_budget_exactly(accountant):
    # a clip schedule's ledger: every step its own z; the PLD search starts from RDP's count
    past = [Step(0.05, float(z), 1) for z in np.linspace(1.0, 1.5, 12)]
    k = remaining_steps(past, 0.05, 1.5, 2.0, 1e-5, accountant=accountant)
    assert epsilon(past + [(0.05, 1.5, k)], 1e-5, accountant=accountant) <= 2.0
    assert epsilon(past + [(0.05, 1.5, k + 1)], 1e-5, accountant=accountant) > 2.0


def test_the_search_finds_the_largest_fitting_count_from_any_guess():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        limit = int(rng.choice([1, 2, 3, 10, 100, 10**9]))
        answer = int(rng.integers(0, limit + 1))
        for guess in (None, 0, 1, answer, max(answer - 3, 0), answer + 5, 2 * limit + 1,
                      int(rng.integers(0, limit + 1))):
            probes = []

            def fits(k):
                assert 0 <= k <= limit, f"probe {k} outside [0, {limit}]"
                probes.append(k)
                return k <= answer

            assert _largest_true(fits, limit, guess) == answer, (limit, answer, guess)
            assert len(probes) <= 4 * math.log2(limit + 2) + 4, (limit, answer, guess, probes)


def test_rdp_of_a_step_is_kept_read_only():
    kept = _step_rdp(0.01, 1.0, (2.0, 3.5))
    with pytest.raises(ValueError, match="read-only"):
        kept[0] = 0.0
    acc = RDPAccountant([(0.01, 1.0, 10)], orders=[2.0, 3.5])
    acc.rdp[0] = 1e9  # a copy
    np.testing.assert_array_equal(acc.rdp, 10 * rdp_subsampled_gaussian(0.01, 1.0, [2.0, 3.5]))


def test_tiny_q_with_small_z_keeps_the_fine_grid():
    # a narrow composed bulk with a heavy tail: Chernoff t on the bulk's scale alone bounded
    # the window so loosely that the grid was coarsened to h = 26 and 26.2 was reported;
    # dp_accounting's pessimistic PLD at h = 1e-4 gives 0.000297 (RDP 3.29)
    assert 0.000296 < epsilon([(1e-10, 0.3, 10**6)], 1e-6) < 0.000300
    assert 0.1267 < epsilon([(1e-6, 0.4, 10**4)], 1e-6) < 0.1269  # dp_accounting 0.126782


def test_delta_below_the_pld_resolution_comes_from_rdp_as_epsilon_does():
    source = [(0.01, 1.0, 1000)]
    for delta in (1e-14, 1e-16, 1e-20):  # PLD resolves 1e-14; below it epsilon() uses RDP
        assert delta_for_epsilon(source, epsilon(source, delta)) <= delta * (1 + 1e-6)


@pytest.mark.parametrize("call,error,message", [
    (lambda: epsilon([Step(0.01, 1.0, 2**60)], 1e-5, accountant="rdp"), ValueError,
     r"steps must be at most 2\^53"),
    (lambda: epsilon([Step(0.01, 1.0, 2**64)], 1e-5), ValueError, r"steps must be at most 2\^53"),
    (lambda: remaining_steps([], 0.01, 1.0, 1.0, 1e-5, max_steps=2**60), ValueError,
     r"max_steps must be at most 2\^53"),
    (lambda: PLDAccountant([(0.01, 1.0, 10)], tail_mass=1.0), ValueError,
     r"tail_mass must be in \(0, 1\)"),
    (lambda: calibrate_noise_multiplier(1.0, 1e-5, 0.01, 100, rtol=math.nan), ValueError,
     "rtol must be a number"),
    (lambda: calibrate_sampling_rate(1.0, 1e-5, 1.0, 100, rtol=0.0), ValueError,
     r"rtol must be in \(0, 1\)"),
    (lambda: epsilon_from_rdp([2.0, 3.0], [1.0], 1e-5), ValueError, "1 RDP values for 2 orders"),
])
def test_accounting_refuses_bad_arguments_with_a_message(call, error, message):
    with pytest.raises(error, match=message):
        call()
