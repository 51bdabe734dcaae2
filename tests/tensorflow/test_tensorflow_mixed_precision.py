"""Mixed precision (Keras ``mixed_bfloat16``): layers compute in bfloat16 and keep float32
variables; per-example gradients, norms and sums are formed in float32, against the same
model run one example at a time under the same policy."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from dpcore_tensorflow import make_private  # noqa: E402
from dpcore_tensorflow.bookkeeping import ClippedGradients  # noqa: E402

L = keras.layers
BF16_TOL = 2e-2  # bfloat16 keeps 8 significant bits (relative rounding 2^-9); many roundings


@pytest.fixture
def mixed_bfloat16():
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    yield
    keras.mixed_precision.set_global_policy(previous)


def model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((6,), dtype="int32"), L.Embedding(12, 4), L.Conv1D(8, 3),
        L.LayerNormalization(), L.Flatten(), L.Dense(8, activation="tanh"),
        L.Dense(3, dtype="float32")])  # logits in float32, as Keras recommends


def loss(y, out):
    return keras.losses.sparse_categorical_crossentropy(y, out, from_logits=True)


def data(n=6):
    rng = np.random.default_rng(0)
    return rng.integers(0, 12, (n, 6)).astype("int32"), rng.integers(0, 3, (n,))


def test_per_example_gradients_are_float32_and_match_one_example_at_a_time(mixed_bfloat16):
    net = model()
    assert net.layers[1].compute_dtype == "bfloat16"
    x, y = data()
    got = ClippedGradients(net).per_example_grads(tf.constant(x), tf.constant(y), loss)
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            one = loss(tf.constant(y[i:i + 1]), net(tf.constant(x[i:i + 1]), training=True))
        for v, g in zip(net.trainable_variables, tape.gradient(one, net.trainable_variables)):
            want = tf.convert_to_tensor(g).numpy().astype(np.float32)
            assert got[v.path].dtype == tf.float32, v.path
            err = np.abs(got[v.path][i].numpy() - want).max()
            assert err <= BF16_TOL * max(np.abs(want).max(), 1e-6), (v.path, i)


@pytest.mark.parametrize("secure", [False, True])
def test_a_private_fit_runs_under_the_policy(mixed_bfloat16, secure):
    net = model()
    before = [v.numpy().copy() for v in net.trainable_variables]
    x, y = data(32)
    private = make_private(net, n=len(x), batch_size=8, max_grad_norm=1.0,
                           noise_multiplier=1.0, secure=secure)
    private.compile(optimizer=keras.optimizers.SGD(0.1),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    private.fit(x, y, epochs=1, verbose=0)
    assert len(private.aggregator.ledger.steps()) == 1
    after = [v.numpy() for v in net.trainable_variables]
    assert all(np.isfinite(a).all() and (a != b).any() for a, b in zip(after, before))


def test_mixed_float16_updates_are_not_divided_by_a_loss_scale():
    """Keras wraps the optimizer in a LossScaleOptimizer, which would divide the private
    gradient (from unscaled per-example losses) by 2^15. SGD(1), zero noise, no clipping,
    q = 1: the update times q n is the summed gradient."""
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        rng = np.random.default_rng(1)
        x = rng.normal(size=(16, 3)).astype("float32")
        y = rng.normal(size=(16, 1)).astype("float32")
        net = keras.Sequential([keras.Input((3,)), L.Dense(1, use_bias=False, dtype="float32",
                                                           kernel_initializer="zeros")])
        private = make_private(net, n=16, q=1.0, max_grad_norm=1e6, noise_multiplier=0.0,
                               seed=0)
        private.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
        private.fit(x, y, epochs=1, steps_per_epoch=1, verbose=0)
        assert isinstance(private.optimizer, keras.optimizers.LossScaleOptimizer)
    finally:
        keras.mixed_precision.set_global_policy(previous)
    step = -net.get_weights()[0].ravel() * 16
    np.testing.assert_allclose(step, (-2 * x * y).sum(0), rtol=1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_variables_are_refused(dtype):
    """A 16-bit variable's clipped sum would be rounded in its dtype before the noise (for
    512 records of a bfloat16 Dense, leaving one out moved the sum by 1.6 clips): refused by
    make_private, PrivateGradients and the backend's private_gradient, before any event."""
    import dpcore
    from dpcore_tensorflow import PrivateGradients
    net = keras.Sequential([keras.Input((3,)), L.Dense(2, dtype=dtype)])
    match = f"parameter '{net.trainable_variables[0].path}' is {dtype}.*mixed_{dtype}"
    with pytest.raises(ValueError, match=match):
        make_private(net, n=16, q=0.5, max_grad_norm=1.0, noise_multiplier=1.0)
    agg = dpcore.PrivateAggregator(dpcore.flat([v.path for v in net.trainable_variables], 1.0,
                                               1.0), n=16, q=0.5, backend="tensorflow", seed=0)
    with pytest.raises(ValueError, match=match):
        PrivateGradients(net, "mse", agg)
    params = {v.path: v for v in net.trainable_variables}
    with pytest.raises(ValueError, match=match):
        dpcore.get_backend("tensorflow").private_gradient(
            lambda p, batch: tf.reduce_sum(batch[0], axis=1), params,
            (tf.ones((4, 3), dtype),), agg)
    assert list(agg.ledger.events) == []
