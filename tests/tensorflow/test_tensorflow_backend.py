"""The TensorFlow backend's contract: registration, conversion, noise, per-example gradients
and private_gradient against analytic float64 references."""

import math

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import dpcore  # noqa: E402
from dpcore.aggregation import NonFiniteNormError  # noqa: E402


@pytest.fixture(scope="module")
def backend():
    return dpcore.get_backend("tensorflow")


def linear_loss(xp):
    def loss(params, batch):
        x, y = batch
        return (xp.matmul(x, params["w"]) + params["b"] - y) ** 2
    return loss


def problem(n=7, d=3, seed=0):
    rng = np.random.default_rng(seed)
    x, y = rng.normal(size=(n, d)), rng.normal(size=n)
    params = {"w": rng.normal(size=d), "b": np.array(0.3)}
    r = x @ params["w"] + params["b"] - y
    grads = {"w": 2 * r[:, None] * x, "b": 2 * r}
    return params, (x, y), grads


def test_registered_through_the_entry_point(backend):
    from dpcore_tensorflow import TensorFlowBackend
    assert isinstance(backend, TensorFlowBackend)
    assert "tensorflow" in dpcore.available_backends()
    assert {"per_example_grads", "ghost_norms"} <= backend.capabilities


def test_conversion_round_trip(backend):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = backend.asarray(x, "float64")
    assert isinstance(t, tf.Tensor) and t.dtype == tf.float64
    back = backend.to_numpy(t)
    np.testing.assert_array_equal(back, x)
    assert back.dtype == np.float64


def test_namespace_differentiates(backend):
    xp = backend.namespace()
    w = tf.constant([1.0, 2.0], tf.float64)
    with tf.GradientTape() as tape:
        tape.watch(w)
        out = xp.sum(xp.astype(xp.tanh(w), xp.float64) ** 2)
    np.testing.assert_allclose(tape.gradient(out, w).numpy(),
                               2 * np.tanh([1, 2]) * (1 - np.tanh([1, 2]) ** 2))


def test_seeded_noise_repeats_and_unseeded_differs(backend):
    like = tf.zeros([4], tf.float64)
    a = backend.standard_normal(backend.rng(5), (1000,), like)[1].numpy()
    b = backend.standard_normal(backend.rng(5), (1000,), like)[1].numpy()
    c = backend.standard_normal(backend.rng(), (1000,), like)[1].numpy()
    d = backend.standard_normal(backend.rng(), (1000,), like)[1].numpy()
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(c, d)
    assert a.dtype == np.float64
    # neighbouring seeds: not one stream shifted (from_seed(s) made s Philox's counter)
    e = backend.standard_normal(backend.rng(6), (1000,), like)[1].numpy()
    assert not any(np.intersect1d(a[k:k + 8], e).size for k in range(0, 40, 8))
    _, host = backend.standard_normal(backend.rng(1), (3,), np.zeros(2, np.float32))
    assert isinstance(host, np.ndarray) and host.dtype == np.float32


def test_per_example_grads_and_norms(backend):
    params, batch, grads = problem()
    got = backend.per_example_grads(linear_loss(backend.namespace()), params, batch)
    for k in grads:
        np.testing.assert_allclose(got[k].numpy(), grads[k], rtol=1e-12)
    norms = backend.per_example_sq_norms(linear_loss(backend.namespace()), params, batch)
    np.testing.assert_allclose(norms.numpy(), np.stack([(grads["w"] ** 2).sum(1), grads["b"] ** 2],
                                                       1), rtol=1e-12)


def _aggregator(backend, mechanism, n=20, q=0.35, seed=0, **kw):
    agg = dpcore.PrivateAggregator(mechanism, n=n, q=q, backend=backend, seed=seed, **kw)
    agg.begin_step()
    return agg


def test_private_gradient_clips_per_group_and_masks(backend):
    params, batch, grads = problem()
    mask = np.array([1, 1, 0, 1, 1, 1, 0], bool)
    mech = dpcore.Mechanism((dpcore.Group("w", ("w",), 0.7, 0.0), dpcore.Group("b", ("b",), 0.4, 0.0)))
    agg = _aggregator(backend, mech)
    out = backend.private_gradient(linear_loss(backend.namespace()), params, batch, agg, mask=mask)
    for k, clip in (("w", 0.7), ("b", 0.4)):
        g = grads[k].reshape(len(mask), -1)
        f = np.minimum(1, clip / np.linalg.norm(g, axis=1)) * mask
        np.testing.assert_allclose(out[k].numpy(), (f[:, None] * g).sum(0).reshape(grads[k].shape[1:])
                                   / agg.expected_size, rtol=1e-12)
    assert [e.group for e in agg.ledger.events[1:]] == ["w", "b"]


def test_private_gradient_refuses_a_mask_of_weights(backend):
    """Cast to bool, weights of 0.5 counted as whole records."""
    params, batch, _ = problem()
    agg = _aggregator(backend, dpcore.flat(["w", "b"], 1.0, 0.0))
    mask = np.array([1, 0.5, 0, 1, 1, 1, 0])
    with pytest.raises(ValueError, match=r"booleans or 0/1 .* got \[0.5\]"):
        backend.private_gradient(linear_loss(backend.namespace()), params, batch, agg, mask=mask)
    assert len(agg.ledger.events) == 1  # the sampling event only


def test_zero_noise_large_clip_is_the_non_private_sum(backend):
    params, batch, grads = problem()
    agg = _aggregator(backend, dpcore.flat(["w", "b"], 1e9, 0.0))
    out = backend.private_gradient(linear_loss(backend.namespace()), params, batch, agg)
    for k in grads:
        np.testing.assert_allclose(out[k].numpy(), grads[k].sum(0) / agg.expected_size, rtol=1e-12)


def test_noise_std_matches_the_ledger(backend):
    d = 20000
    params = {"w": np.zeros(d), "b": np.array(0.0)}

    def loss(p, batch):  # gradients are 0: the release is pure noise
        return 0.0 * p["b"] + 0.0 * batch

    agg = _aggregator(backend, dpcore.flat(["w", "b"], 2.0, 1.5), n=100, q=0.3, seed=3)
    out = backend.private_gradient(loss, params, np.zeros(4), agg)
    query = agg.ledger.events[-1]
    expected = query.noise_std / agg.expected_size
    std = out["w"].numpy().std()
    # sample std of d normals has relative standard error 1/sqrt(2d) = 0.5%; 5 of them is
    # 2.5%, far below the 10% error this must catch
    assert abs(std / expected - 1) < 5 / math.sqrt(2 * d)


def test_empty_sample_releases_noise_only(backend):
    params, _, _ = problem()
    agg = _aggregator(backend, dpcore.flat(["w", "b"], 1.0, 0.0))
    out = backend.private_gradient(linear_loss(backend.namespace()), params,
                                   (np.zeros((0, 3)), np.zeros(0)), agg)
    assert float(tf.reduce_sum(tf.abs(out["w"]))) == 0.0
    assert len(agg.ledger.events) == 2


def test_an_empty_sample_under_adaptive_clipping_counts_no_records(backend):
    """The released unclipped count is noise alone (here 1e-5 of q n = 1e6), so the clip moves
    as for a fraction of 1/2 unclipped (the centred count is 0), as on the JAX backend."""
    from dpcore.adaptive import QuantileClipping, update_clip
    params, _, _ = problem()
    config = QuantileClipping(target_quantile=0.9, count_noise_std=10.0)
    agg = _aggregator(backend, dpcore.flat(["w", "b"], 0.1, 1.0), n=10**7, q=0.1,
                      clipping=config)
    out = backend.private_gradient(linear_loss(backend.namespace()), params,
                                   (np.zeros((0, 3)), np.zeros(0)), agg)
    assert out["w"].shape == (3,)
    assert any(getattr(e, "group", "").startswith("unclipped_count:") for e in agg.ledger.events)
    assert agg.state_dict()["clips"] == pytest.approx([update_clip(0.1, 0.5, config)], rel=1e-4)


def test_nonfinite_records_raise_or_drop(backend):
    params, (x, y), grads = problem()
    x = x.copy()
    x[2, 0] = np.nan
    loss = linear_loss(backend.namespace())
    agg = _aggregator(backend, dpcore.flat(["w", "b"], 1e9, 0.0))
    with pytest.raises(NonFiniteNormError, match=r"records \[2\]"):
        backend.private_gradient(loss, params, (x, y), agg)
    assert len(agg.ledger.events) == 1  # nothing released, no sum query written
    agg = _aggregator(backend, dpcore.flat(["w", "b"], 1e9, 0.0), on_nonfinite="drop")
    out = backend.private_gradient(loss, params, (x, y), agg)
    keep = np.arange(7) != 2
    np.testing.assert_allclose(out["b"].numpy(), grads["b"][keep].sum() / agg.expected_size)


def test_adaptive_clipping_moves_the_clip_without_retracing(backend):
    from dpcore.adaptive import QuantileClipping
    params, batch, _ = problem()
    agg = dpcore.PrivateAggregator(dpcore.flat(["w", "b"], 0.1, 1.0), n=20, q=0.35,
                                   backend=backend, seed=0,
                                   clipping=QuantileClipping(count_noise_std=2.0))
    loss = linear_loss(backend.namespace())
    clips = []
    for _ in range(3):
        agg.begin_step()
        backend.private_gradient(loss, params, batch, agg)
        clips.append(agg.mechanism.groups[0].clip)
    assert len(set(clips)) == 3
    groups = {e.group for e in agg.ledger.events if hasattr(e, "group")}
    assert any(g.startswith("unclipped_count:") for g in groups)
    compiled = [f for (fn, key), f in backend._compiled.items()
                if fn is loss and key[0] == "private"]
    assert sum(f.experimental_get_tracing_count() for f in compiled) == 1


def test_compiled_functions_are_kept_for_the_losses_used_last():
    """A loss made anew per call (a closure over this step's model) kept one compiled
    function, and the model, per call: now the last ``KEPT_FUNCTIONS`` are kept."""
    backend = dpcore.get_backend("tensorflow")
    params, batch, grads = problem()
    backend._compiled.clear()
    first = linear_loss(backend.namespace())
    backend.per_example_grads(first, params, batch)
    for _ in range(backend.KEPT_FUNCTIONS + 6):
        backend.per_example_grads(first, params, batch)  # used last: kept
        got = backend.per_example_grads(linear_loss(backend.namespace()), params, batch)
        np.testing.assert_allclose(got["w"].numpy(), grads["w"], rtol=1e-6)
    assert len(backend._compiled) == backend.KEPT_FUNCTIONS
    (kept,) = [f for (fn, _), f in backend._compiled.items() if fn is first]
    assert kept.experimental_get_tracing_count() == 1
