"""The JAX backend contract: registration, keys and noise, conversion, and per-example
gradients against float64 one-example-at-a-time oracles."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpcore
from dpcore import backend as contract
from dpcore_jax.backend import JaxBackend, make_key
from dpcore_jax.names import leaf_names, named_leaves, unflatten_like

import jax_models as models

# float32 unit roundoff is 2^-24 ~ 6e-8; these small models chain < 50 roundings on values of
# order 1, so 1000 u relative to the leaf's largest entry bounds float32 error with a wide
# margin while a wrong gradient (wrong example, missing term) is off by O(1).
F32_TOL = 1000 * 2.0 ** -24


def test_registered_through_the_entry_point():
    backend = dpcore.get_backend("jax")
    assert isinstance(backend, JaxBackend)
    assert "jax" in dpcore.available_backends()
    assert {contract.PER_EXAMPLE_GRADS, contract.JIT} <= backend.capabilities


def test_plugin_module_imports_no_jax():
    code = ("import sys, dpcore_jax.plugin, dpcore_jax; "
            "assert 'jax' not in sys.modules, 'jax imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_keys_reproduce_use_all_64_bits_and_default_to_entropy():
    backend = JaxBackend()
    like = jnp.zeros((), jnp.float32)
    draw = lambda key: np.asarray(backend.standard_normal(key, (1000,), like)[1])  # noqa: E731
    np.testing.assert_array_equal(draw(backend.rng(7)), draw(backend.rng(7)))
    # seeds differing only above bit 32 give different streams
    assert not np.allclose(draw(backend.rng(5)), draw(backend.rng(5 + 2 ** 40)))
    assert not np.allclose(draw(backend.rng()), draw(backend.rng()))
    with pytest.raises(ValueError, match="2\\*\\*64"):
        make_key(-1)
    with pytest.raises(TypeError, match="seed must be an int"):
        make_key(1.5)


def test_standard_normal_advances_the_key_and_follows_the_dtype():
    backend = JaxBackend()
    key = backend.rng(0)
    key2, a = backend.standard_normal(key, (4, 3), jnp.zeros((), jnp.bfloat16))
    _, b = backend.standard_normal(key2, (4, 3), jnp.zeros((), jnp.int32))
    assert a.dtype == jnp.bfloat16 and a.shape == (4, 3) and b.dtype == jnp.float32
    assert not np.allclose(np.asarray(a, np.float32), np.asarray(b))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_noise_has_gaussian_tails(dtype):
    """Drawn in its own dtype, JAX's normal never passed 3.49 (float16) or 2.89 (bfloat16)
    standard deviations: a truncated Gaussian. Drawn in float32 and rounded, 2^20 values
    hold about 66 beyond 4 (Poisson: fewer than 30 has probability below 1e-7)."""
    backend = JaxBackend()
    _, z = backend.standard_normal(backend.rng(0), (1 << 20,), jnp.zeros((), dtype))
    z = np.asarray(z, np.float64)
    assert z.dtype == np.float64 and np.sum(np.abs(z) > 4) > 30
    assert abs(z.std() - 1) < 0.01


def test_threefry_hash_matches_jax():
    """The written-out hash gives jax's Threefry-2x32 bits (its public reference function)."""
    from jax.extend.random import threefry_2x32

    from dpcore_jax.noise import threefry2x32

    rng = np.random.default_rng(0)
    for _ in range(3):
        key = rng.integers(0, 2 ** 32, size=2, dtype=np.uint32)
        words = rng.integers(0, 2 ** 32, size=(2, 37), dtype=np.uint32)
        ours = np.concatenate(threefry2x32(jnp.uint32(key[0]), jnp.uint32(key[1]),
                                           jnp.asarray(words[0]), jnp.asarray(words[1])))
        theirs = threefry_2x32((jnp.uint32(key[0]), jnp.uint32(key[1])), jnp.asarray(words.ravel()))
        np.testing.assert_array_equal(ours, np.asarray(theirs))


@pytest.mark.parametrize("size", [1, 7, 16, 1001, 16307])
def test_noise_is_jax_random_normal_of_the_split_key(size):
    """standard_normal(key) is (split(key)[0], the first values of jax.random.normal(split(key)[1],
    (m,)) for m the size rounded up to 16), bit for bit, also under jit."""
    from dpcore_jax.noise import standard_normal

    key = make_key(11)
    like = jnp.zeros((), jnp.float32)
    next_key, draws = jax.jit(lambda k: standard_normal(k, (size,), like))(key)
    expected_next, sub = jax.random.split(key)
    with jax.threefry_partitionable(False):
        expected = jax.random.normal(sub, (max(16, -(-size // 16) * 16),), jnp.float32)[:size]
    np.testing.assert_array_equal(np.asarray(draws), np.asarray(expected))
    np.testing.assert_array_equal(jax.random.key_data(next_key), jax.random.key_data(expected_next))


def test_conversion_round_trip():
    backend = JaxBackend()
    x = np.arange(6.0).reshape(2, 3)
    a = backend.asarray(x, dtype="float32")
    assert a.dtype == jnp.float32 and backend.namespace() is jnp
    out = backend.to_numpy(a)
    assert isinstance(out, np.ndarray)
    np.testing.assert_array_equal(out, x)


def test_leaf_names_are_slash_joined_key_paths():
    tree = {"dense": {"w": jnp.ones(2), "b": jnp.ones(1)}, "layers": [jnp.ones(3)]}
    assert leaf_names(tree) == ["dense/b", "dense/w", "layers/0"]
    named = named_leaves(tree)
    rebuilt = unflatten_like(tree, {k: v + 1 for k, v in named.items()})
    assert float(rebuilt["layers"][0][0]) == 2.0
    with pytest.raises(ValueError, match="same name"):
        leaf_names({"a/b": jnp.ones(1), "a": {"b": jnp.ones(1)}})


def test_per_example_grads_match_the_analytic_float64_oracle():
    rng = np.random.default_rng(0)
    params = models.logistic_params(rng)
    x, y = models.data(rng, "logistic", 16)
    grads = JaxBackend().per_example_grads(models.logistic_loss, params, (x, y))
    oracle = models.logistic_oracle(params, x, y)
    assert set(grads) == {"w", "b"} and grads["w"].shape == (16, 5)
    for leaf in oracle:
        np.testing.assert_allclose(grads[leaf], oracle[leaf], rtol=F32_TOL,
                                   atol=F32_TOL * np.abs(oracle[leaf]).max())


@pytest.mark.parametrize("kind", models.KINDS)
def test_per_example_grads_match_a_float64_one_at_a_time_oracle(kind):
    rng = np.random.default_rng(1)
    loss_fn, params = models.model(rng, kind)
    batch = models.data(rng, kind, 6)
    grads = JaxBackend().per_example_grads(loss_fn, params, batch)
    oracle = models.float64_oracle(loss_fn, params, batch)
    assert set(grads) == set(oracle) == set(leaf_names(params))
    for leaf in oracle:
        assert grads[leaf].dtype == jnp.float32
        np.testing.assert_allclose(grads[leaf], oracle[leaf], rtol=F32_TOL,
                                   atol=F32_TOL * np.abs(oracle[leaf]).max(), err_msg=leaf)
    sq = JaxBackend().per_example_sq_norms(loss_fn, params, batch)
    expected = np.stack([(oracle[leaf].reshape(6, -1) ** 2).sum(1) for leaf in leaf_names(params)], 1)
    np.testing.assert_allclose(sq, expected, rtol=10 * F32_TOL, atol=10 * F32_TOL * expected.max())
