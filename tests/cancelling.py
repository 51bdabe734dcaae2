"""float32 data on which the terms of the ghost-norm identity cancel (inputs nearly equal
across positions, backprops summing to nearly zero over them), with the exact float64 squared
norms of its per-example gradients: the rounding tests of every backend use it. ``spread`` 1
gives ordinary data."""

import numpy as np

SPREADS = (1e-3, 1e-2, 1.0)


def backprops(rng, b, p, f, spread):
    """(B, P, F) backprops whose sum over the P positions is small unless ``spread`` is 1."""
    g = rng.normal(size=(b, p, f))
    g -= (1 - spread) * g.mean(1, keepdims=True)
    g += 1e-2 * rng.random((b, 1, 1)) * rng.normal(size=(b, 1, f))
    return g.astype(np.float32)


def inputs(rng, b, p, c, spread):
    """(B, P, C) inputs nearly equal across the P positions unless ``spread`` is 1."""
    x = rng.normal(size=(b, 1, c)) * (1 - spread) + spread * rng.normal(size=(b, p, c))
    return x.astype(np.float32)


def ids(rng, b, p, vocabulary, spread):
    """(B, P) ids: one id at every position unless ``spread`` is 1."""
    return rng.integers(0, 1 if spread < 1 else vocabulary, size=(b, p)).astype(np.int32)


def exact_sq_norms(a, g):
    """||sum_p a_p g_p^T||^2 per example, in float64."""
    products = np.einsum("bpc,bpf->bcf", a.astype(np.float64), g.astype(np.float64))
    return (products ** 2).sum((1, 2))


def exact_rows_sq_norms(ids, g, vocabulary):
    """||sum_p e_{ids_p} g_p^T||^2 per example (an embedding's gradient), in float64."""
    rows = np.zeros((g.shape[0], vocabulary, g.shape[2]))
    for i in range(g.shape[0]):
        np.add.at(rows[i], ids[i], g[i].astype(np.float64))
    return (rows ** 2).sum((1, 2))


def case(rng, kind, b, p, c, f, spread, vocabulary=9):
    """(a, g, exact squared norms): a dense layer's inputs (B, P, C) (``kind`` "dense") or an
    embedding's ids (B, P) ("rows", a table of ``vocabulary`` rows), and backprops (B, P, F)."""
    g = backprops(rng, b, p, f, spread)
    if kind == "dense":
        a = inputs(rng, b, p, c, spread)
        return a, g, exact_sq_norms(a, g)
    a = ids(rng, b, p, vocabulary, spread)
    return a, g, exact_rows_sq_norms(a, g, vocabulary)
