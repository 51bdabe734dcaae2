"""Moving clips on the JAX backend: private_gradient follows them, compiled steps refuse them."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import dpcore  # noqa: E402
from dpcore.ledger import SumQueryEvent  # noqa: E402
from dpcore_jax import private_grad  # noqa: E402


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
    for _ in range(3):
        rows = agg.sample()
        batch = (jnp.asarray(rng.normal(size=(len(rows), 3)), jnp.float32),
                 jnp.asarray(rng.normal(size=len(rows)), jnp.float32))
        backend.private_gradient(loss_fn, params, batch, agg)
    clips = [e.clip for e in agg.ledger.events if isinstance(e, SumQueryEvent) and e.group == "all"]
    assert clips[0] == pytest.approx(0.1) and clips[2] > clips[1] > clips[0]  # norms >> 0.1
    assert all(s.noise_multiplier == pytest.approx(1.0, rel=1e-12) for s in agg.ledger.steps())


def test_compiled_steps_refuse_a_moving_mechanism():
    with pytest.raises(ValueError, match="built for one fixed mechanism"):
        private_grad(loss_fn, aggregator())
