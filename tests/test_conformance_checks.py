"""The conformance suite's helpers for naming a fault (``dpcore_conformance.checks``), on
their own: what they report must not depend on the luck of an unseeded run."""

import numpy as np

from dpcore_conformance.checks import matched_fraction, scale_of_draws


def test_the_scale_of_a_small_groups_draws_is_found():
    """A group of 201 of a step's 10,401 draws, released at 0.8x (a ledger recording 1.25x
    the noise added): its scale is found every time; its largest value need not be 0.8x one
    of the step's 64 largest draws, where the first version looked (it missed about 4% of
    unseeded runs). Noise from another generator, Gaussian or Laplace, has no scale."""
    rng = np.random.default_rng(0)
    for _ in range(60):
        drawn = rng.standard_normal(10401).astype(np.float32).astype(np.float64)
        small = 0.8 * drawn[-201:] + rng.normal(0, 1e-7, 201)
        assert abs(scale_of_draws(small, drawn) - 0.8) < 1e-4
    for other in (rng.standard_normal(201), rng.laplace(size=201) / np.sqrt(2)):
        assert scale_of_draws(other, drawn) is None


def test_nothing_matches_when_nothing_was_drawn():
    assert matched_fraction(np.ones(5), np.zeros(0), 1e-5) == 0.0
    assert scale_of_draws(np.ones(5), np.zeros(0)) is None
