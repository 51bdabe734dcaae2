"""Basic and advanced composition and amplification by subsampling (the course notes)."""

import math

import pytest

from dpcore.accounting import (advanced_composition, amplify_by_subsampling,
                               basic_composition, best_composition)


def test_basic_composition_adds_up():
    assert basic_composition([0.1, 0.2, 0.3], [1e-6, 0, 2e-6]) == pytest.approx((0.6, 3e-6))
    assert basic_composition([], []) == (0.0, 0.0)


def test_advanced_composition_formula():
    eps, delta = advanced_composition(0.1, 1e-6, 100, 1e-5)
    expected = math.sqrt(2 * 100 * math.log(1e5)) * 0.1 + 100 * 0.1 * math.expm1(0.1)
    assert eps == pytest.approx(expected)
    assert delta == pytest.approx(100 * 1e-6 + 1e-5)


def test_advanced_beats_basic_only_for_small_epsilon_and_many_steps():
    assert advanced_composition(0.01, 0, 10000, 1e-6)[0] < 0.01 * 10000
    assert advanced_composition(1.0, 0, 3, 1e-6)[0] > 3.0
    assert best_composition(1.0, 0, 3, 1e-6) == (3.0, 0.0)
    assert best_composition(0.01, 0, 10000, 1e-6)[0] < 100


def test_amplification_by_subsampling():
    eps, delta = amplify_by_subsampling(1.0, 1e-5, 0.01)
    assert eps == pytest.approx(math.log(1 + 0.01 * (math.e - 1)))
    assert delta == pytest.approx(1e-7)
    # the notes' Lemma 3: a 1-DP algorithm on a q-subsample is 2q-DP (q <= 1)
    for q in [1e-4, 0.01, 0.3, 1.0]:
        assert amplify_by_subsampling(1.0, 0.0, q)[0] <= 2 * q
    assert amplify_by_subsampling(2.0, 0.1, 1.0) == pytest.approx((2.0, 0.1))
    assert amplify_by_subsampling(2.0, 0.1, 0.0) == (0.0, 0.0)


@pytest.mark.parametrize("call,message", [
    (lambda: basic_composition([0.1], []), "one delta per epsilon"),
    (lambda: basic_composition([-0.1], [0.0]), r"epsilon\[0\] must be"),
    (lambda: basic_composition([0.1, 0.1], [0.6, 0.6]), "vacuous"),
    (lambda: advanced_composition(0.1, 0.0, 0, 1e-5), "k must be an integer >= 1"),
    (lambda: advanced_composition(0.1, 0.0, 10, 0.0), "delta_prime must be in"),
    (lambda: advanced_composition(0.1, 0.2, 10, 1e-5), "vacuous"),
    (lambda: advanced_composition(-1.0, 0.0, 10, 1e-5), "epsilon must be"),
    (lambda: amplify_by_subsampling(1.0, 0.0, 1.5), r"q \(sampling rate\) must be in"),
    (lambda: amplify_by_subsampling(1.0, 1.5, 0.5), "delta must be in"),
])
def test_conditions_are_checked(call, message):
    with pytest.raises(ValueError, match=message):
        call()
