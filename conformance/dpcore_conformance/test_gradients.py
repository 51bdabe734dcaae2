"""Per-example gradients and squared norms against analytic float64 references.

The backend computes in float32: agreement to 1e-4 relative (plus 1e-5 absolute for entries
near zero) is two orders of magnitude above float32 rounding on these small problems, and far
below any real error such as a batch-mean gradient in place of per-example ones.
"""

import numpy as np
import pytest

from dpcore.aggregation import per_leaf_sq_norms

from .problems import PROBLEMS, ScaledModel, linear_regression

pytestmark = pytest.mark.requires_capability("per_example_grads")


@pytest.mark.parametrize("make", PROBLEMS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("batch", [0, 1, 7, 300])  # 300: past chunks a backend may cut
def test_per_example_gradients(backend, convert, make, batch):
    problem = make(batch=batch)
    grads = backend.per_example_grads(problem.loss(backend.namespace()), convert(problem.params),
                                      convert(problem.batch))
    expected = problem.grads(problem.params, problem.batch)
    assert set(grads) == set(expected)
    for leaf, want in expected.items():
        got = convert.numpy(grads[leaf])
        assert got.shape == (batch, *problem.params[leaf].shape), leaf
        np.testing.assert_allclose(got, want.reshape(got.shape), rtol=1e-4, atol=1e-5,
                                   err_msg=f"per-example gradient of {leaf!r}")


LARGE_BATCH = 2100


def test_per_example_gradients_of_a_large_batch(backend, convert):
    """Linear regression (6 values per record) on LARGE_BATCH rows: past chunks of 512, 1024
    and 2048 rows a backend may cut a batch into (a chunk starting a row early gives rows
    past its start the gradient of the row before)."""
    test_per_example_gradients(backend, convert, linear_regression, LARGE_BATCH)


@pytest.mark.parametrize("make", PROBLEMS, ids=lambda f: f.__name__)
def test_per_example_squared_norms(backend, convert, make):
    problem = make(batch=7)
    sq = backend.per_example_sq_norms(problem.loss(backend.namespace()), convert(problem.params),
                                      convert(problem.batch))
    leaves = list(problem.params)
    expected = per_leaf_sq_norms(problem.grads(problem.params, problem.batch), leaves)
    np.testing.assert_allclose(convert.numpy(sq), expected, rtol=1e-4, atol=1e-6)


def test_a_bound_method_loss_is_read_at_every_call(backend, convert):
    problem = linear_regression(batch=7)
    model = ScaledModel(problem.loss(backend.namespace()))
    expected = problem.grads(problem.params, problem.batch)
    for scale in (1.0, 3.0, 0.5):
        model.scale = scale
        grads = backend.per_example_grads(model.loss, convert(problem.params),
                                          convert(problem.batch))
        for leaf, want in expected.items():
            got = convert.numpy(grads[leaf])
            np.testing.assert_allclose(got, scale * want.reshape(got.shape), rtol=1e-4,
                                       atol=1e-5, err_msg=f"{leaf!r} at scale {scale}")
