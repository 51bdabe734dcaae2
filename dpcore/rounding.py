"""Bounds on the rounding of norms formed apart from the sums they clip (ghost norms, an
embedding's per-id row sums), so that a clip factor never exceeds its exact value.

A layer applied at T positions (x_t in R^{d_in}, backprop g_t in R^{d_out}) has the per-example
gradient G = sum_t x_t g_t^T, and the ghost identity gives its squared norm without forming G:

    ||G||^2 = sum_{t,s} (x_t . x_s)(g_t . g_s).

The terms can cancel: with inputs nearly equal across positions and backprops summing to
nearly zero, ||G||^2 is far below U = (sum_t ||x_t|| ||g_t||)^2 >= ||G||^2, and the rounding of
the terms, relative to U, is then a large part of the result. A ghost norm computed below the
exact one gives a clip factor above C / ||G||: the clipped contribution exceeds its bound C.

With unit roundoff u (half the machine epsilon), Gram entries formed by any summation order
(with or without fused multiply-adds) are within d u ||x_t|| ||x_s|| (first order in u), their
product adds u, and a sum over s and then over t (each term in at most 2 (T - 1) additions)
adds 2 (T - 1) u of sum_{t,s} |terms| <= U. So the computed S and the exact ||G||^2 satisfy

    | S - ||G||^2 | <= (d_in + d_out + 2 T) u U (1 + O((d_in + d_out + 2 T) u)),

and backends clip with S + mu U, mu = (d_in + d_out + 2 T) eps = 2 (d_in + d_out + 2 T) u,
where U comes from the Gram matrices' diagonals: sum_t sqrt((x_t . x_t)(g_t . g_t)). The
factor 2 covers the higher-order terms and the rounding of U and of the addition, so the norm
used for clipping is never below the exact one. The cost is a bias of mu U / ||G||^2: for
T = 64 positions, d_in + d_out = 640 and U / ||G||^2 = T (positions of unrelated directions),
0.6% on the squared norm (0.3% on the norm), against unbounded relative errors (or a negative
S) under cancellation.

An embedding's norm takes each record's backprop rows summed per id, and its clipped sum
adds the rows in another order, so it needs a bound too. For a sum s of n rows computed in
any order as s~, |s~ - s| <= (n - 1) u sum_t |g_t| elementwise, so ||s~ - s|| <= (n - 1) u A
with A = sum_t ||g_t||; the computed norm of s~ is within d u of it, relative. So

    ||s|| <= ||s~|| + (d + n) eps A        (:func:`sum_margin`, again with a factor 2),

a bound on the norm, not its square: for n rows of unrelated directions it moves the norm by
about (d + n) eps sqrt(n), relative: 3e-5 for n = 4 and d = 128.
"""

from __future__ import annotations


def ghost_margin(width: int, positions: int, eps: float) -> float:
    """mu of the module docstring: the multiple of U = (sum_t ||x_t|| ||g_t||)^2 to add to a
    ghost squared norm over ``positions`` positions with Gram matrices of total ``width``
    (d_in + d_out), computed in a floating-point type of machine epsilon ``eps``."""
    return (width + 2 * positions) * eps


def sum_margin(width: int, terms, eps: float):
    """The multiple of A = sum_t ||g_t|| to add to the computed norm of a sum of ``terms``
    rows of ``width`` values (an array of counts gives an array of multiples)."""
    return (width + terms) * eps
