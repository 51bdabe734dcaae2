"""Moving clips on the JAX backend: private_gradient follows them, compiled steps refuse them."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import dpcore  # noqa: E402
from dpcore.ledger import SumQueryEvent  # noqa: E402
from dpcore_jax import private_grad  # noqa: E402
from dpcore_jax.grad import clip_free, clipping_kernel  # noqa: E402


def loss_fn(params, batch):
    x, y = batch
    return 0.5 * (x @ params["w"] + params["b"][0] - y) ** 2


def aggregator():
    mechanism = dpcore.flat(["w", "b"], clip=0.1, noise_multiplier=1.0)
    return dpcore.PrivateAggregator(mechanism, n=2000, q=0.05, backend="jax", seed=0,
                                    clipping=dpcore.QuantileClipping())


def test_private_gradient_follows_adaptive_clipping_at_its_total_cost():
    agg = aggregator()
    backend = dpcore.get_backend("jax")
    rng = np.random.default_rng(0)
    params = {"w": jnp.ones(3), "b": jnp.zeros(1)}
    kernel = clipping_kernel(loss_fn, clip_free(agg.mechanism))
    compiled = kernel._cache_size()
    for _ in range(3):
        agg.sample()
        rows = 100  # a fixed batch shape: the moving clip alone must not recompile
        batch = (jnp.asarray(rng.normal(size=(rows, 3)), jnp.float32),
                 jnp.asarray(rng.normal(size=rows), jnp.float32))
        backend.private_gradient(loss_fn, params, batch, agg)
    assert kernel._cache_size() == compiled + 1
    clips = [e.clip for e in agg.ledger.events if isinstance(e, SumQueryEvent) and e.group == "all"]
    assert clips[0] == pytest.approx(0.1) and clips[2] > clips[1] > clips[0]  # norms >> 0.1
    assert all(s.noise_multiplier == pytest.approx(1.0, rel=1e-12) for s in agg.ledger.steps())


def test_compiled_steps_refuse_a_moving_mechanism():
    with pytest.raises(ValueError, match="built for one fixed mechanism"):
        private_grad(loss_fn, aggregator())


def test_private_gradient_applies_the_clip_the_ledger_records_at_every_step():
    """A clip schedule with zero noise: each step's released mean is the mean clipped at that
    step's ledger clip (one compiled kernel serves every clip)."""
    from dpcore.schedules import ClipSchedule, exponential

    mechanism = dpcore.flat(["w", "b"], clip=2.0, noise_multiplier=0.0)
    agg = dpcore.PrivateAggregator(mechanism, n=200, q=0.1, backend="jax", seed=0,
                                   clipping=ClipSchedule(exponential(0.7), hold="noise_std"))
    backend = dpcore.get_backend("jax")
    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray([0.3, -0.2, 0.5]), "b": jnp.asarray([0.1])}
    kernel = clipping_kernel(loss_fn, clip_free(agg.mechanism))
    compiled = kernel._cache_size()
    for _ in range(4):
        agg.sample()
        x, y = rng.normal(size=(16, 3)), 3 * rng.normal(size=16)
        out = backend.private_gradient(loss_fn, params, (jnp.asarray(x, jnp.float32),
                                                         jnp.asarray(y, jnp.float32)), agg)
        clip = [e for e in agg.ledger.events if isinstance(e, SumQueryEvent)][-1].clip
        residual = x @ np.asarray(params["w"], np.float64) + 0.1 - y
        grads = np.concatenate([residual[:, None] * x, residual[:, None]], axis=1)
        factors = np.minimum(1.0, clip / np.linalg.norm(grads, axis=1))
        expected = (factors[:, None] * grads).sum(0) / agg.expected_size
        np.testing.assert_allclose(np.concatenate([out["w"], out["b"]]), expected, rtol=1e-5)
    clips = [e.clip for e in agg.ledger.events if isinstance(e, SumQueryEvent)]
    assert clips == pytest.approx([2.0 * np.exp(-0.7 * t) for t in range(4)])
    assert kernel._cache_size() == compiled + 1  # batches of 16 rows: one new program
