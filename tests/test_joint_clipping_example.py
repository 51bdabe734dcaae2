"""The joint-clipping reproduction: at equal privacy cost, joint clipping beats the others."""

import math

import pytest


def test_joint_clipping_wins_at_equal_privacy_cost(load_example):
    rows, _ = load_example("joint_clipping").rmse_table(z=1.0, n=10_000, q=0.1, releases=60)
    (_, j1, j2), (_, s1, s2), (_, f1, f2), (_, g1, g2) = rows
    # separate clipping needs sqrt(2) more noise for the same z (two groups, proportional)
    assert s1 / j1 == pytest.approx(math.sqrt(2), rel=0.15)
    assert s2 / j2 == pytest.approx(math.sqrt(2), rel=0.15)
    assert f1 > 50 * j1 and f2 == pytest.approx(j2, rel=0.15)  # S = 100 drowns v1
    assert g2 > 10 * j2 and g1 == pytest.approx(j1, rel=0.15)  # S = 1 clips v2 away
