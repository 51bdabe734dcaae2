"""The rounding bound of ghost norms (dpcore.rounding) against a float64 oracle, on float32
NumPy data built so that the ghost identity's terms cancel."""

import numpy as np
import pytest

import cancelling
from dpcore.rounding import ghost_margin, sum_margin


@pytest.mark.parametrize("t, c, f", [(8, 16, 16), (64, 128, 256), (200, 32, 512)])
def test_the_margin_bounds_the_rounding_of_cancelling_ghost_sums(t, c, f):
    rng = np.random.default_rng(t)
    b, eps = 24, np.finfo(np.float32).eps
    worst = 0.0
    for spread in (1e-4, *cancelling.SPREADS):
        x, g = cancelling.inputs(rng, b, t, c, spread), cancelling.backprops(rng, b, t, f, spread)
        products = np.einsum("btc,bsc->bts", x, x) * np.einsum("btf,bsf->bts", g, g)
        s = products.sum(2, dtype=np.float32).sum(1, dtype=np.float32).astype(np.float64)
        u_bound = np.sqrt(np.diagonal(products, axis1=1, axis2=2)).sum(1) ** 2
        exact = cancelling.exact_sq_norms(x, g)
        margin = ghost_margin(c + f, t, eps)
        assert (s + margin * u_bound >= exact).all()
        worst = max(worst, ((exact - s) / (margin * u_bound)).max())
    assert worst > 0  # the data does make the plain sum fall below the exact one


def test_the_margin_scales_with_width_positions_and_precision():
    assert ghost_margin(640, 64, 2.0 ** -23) == pytest.approx(768 * 2.0 ** -23)
    assert ghost_margin(640, 64, 2.0 ** -52) < 1e-12


@pytest.mark.parametrize("n, d", [(3, 1), (4, 8), (64, 128)])
def test_the_sum_margin_bounds_the_norm_of_a_cancelling_sum_of_rows(n, d):
    """Rows that nearly cancel, summed in float32 in random orders: the exact norm of their
    sum is at most the computed norm plus sum_margin(d, n) times the sum of the rows' norms
    (float64 oracle), and the plain computed norm does fall below the exact one."""
    rng = np.random.default_rng(n)
    eps, below = np.finfo(np.float32).eps, False
    for _ in range(200):
        scale = 10.0 ** rng.uniform(-3, 12)
        rows = rng.normal(size=(n, d)) * scale
        rows[-1] = -rows[:-1].sum(0) + rng.normal(size=d) * scale * 10.0 ** rng.uniform(-9, -5)
        rows = rows.astype(np.float32)
        summed = np.zeros(d, np.float32)
        for row in rows[rng.permutation(n)]:
            summed += row
        computed = float(np.linalg.norm(summed.astype(np.float64)))
        exact = float(np.linalg.norm(rows.astype(np.float64).sum(0)))
        total = float(np.linalg.norm(rows.astype(np.float64), axis=1).sum())
        assert exact <= computed + sum_margin(d, n, eps) * total
        below = below or computed < exact
    assert below
