"""The reproduction script runs end to end (a small version of each experiment)."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")


@pytest.fixture(scope="module")
def reproductions(load_example):
    return load_example("reproductions")


def test_budget_driven_variants_spend_exactly_the_budget(reproductions):
    rows = reproductions.momentum_and_clip(seeds=1, budgets=[4.0], lr=0.2, epochs=2)
    steps = {name: taken for _, name, _, _, taken, _ in rows}
    assert steps["DP-SGD"] == 44  # z was calibrated for 2 epochs of plain DP-SGD
    assert steps["decreasing clip"] > 1.5 * steps["DP-SGD"]
    assert all(spent <= 4.0 + 1e-9 for *_, spent in rows)
    assert all(acc > 0.3 for _, _, acc, *_ in rows)


def test_adaptive_against_a_grid(reproductions):
    rows = reproductions.adaptive_against_grid(seeds=1, eps=4.0, grid=[1.0], lr=0.5, epochs=2)
    assert [r[0] for r in rows] == [1.0, "adaptive"]
    assert rows[-1][1] > 0.3 and rows[-1][3] <= 4.0 + 1e-9
