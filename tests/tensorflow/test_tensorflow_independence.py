"""The check that a Keras model keeps the examples of a batch apart: every form of mixing
below is refused before anything is recorded; per-example models (dropout, noise, attention,
convolutions, state updated in the forward pass) pass, and train exactly as without it."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import dpcore  # noqa: E402
from dpcore_tensorflow import (NotPerExampleError, PrivateGradients,  # noqa: E402
                               make_private)

L, ops = keras.layers, keras.ops
CE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@tf.custom_gradient
def _gradient_rows_reversed(t):
    return tf.identity(t), lambda g: tf.reverse(g, [0])


@tf.custom_gradient
def _gradient_scaled_by_the_batch(t):
    return tf.identity(t), lambda g: g / tf.reduce_max(tf.abs(g))


def _pairs_swapped(t):
    b = tf.shape(t)[0]
    return tf.reshape(tf.reverse(tf.reshape(t, [b // 2, 2, -1]), [1]), tf.shape(t))


MIXING = {
    "batch mean": lambda t: t - ops.mean(t, axis=0),
    "detached batch mean": lambda t: t - ops.stop_gradient(ops.mean(t, axis=0)),
    "straight-through": lambda t: t + (ops.mean(t, axis=0) - ops.stop_gradient(
        ops.mean(t, axis=0))),
    "reference row": lambda t: t - ops.stop_gradient(t[:1]),
    "reversed batch": lambda t: ops.flip(t, axis=0),
    "rolled by half": lambda t: tf.roll(t, tf.shape(t)[0] // 2, axis=0),
    "pairs swapped": _pairs_swapped,
    "first two rows swapped": lambda t: tf.concat([t[1:2], t[:1], t[2:]], 0),
    "gradient rows reversed": _gradient_rows_reversed,
    "gradient scaled by the batch": _gradient_scaled_by_the_batch,
}


def mlp(mix=None, *, zero_head=False, mix_inputs=None, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    h = inputs if mix_inputs is None else L.Lambda(mix_inputs)(inputs)
    h = L.Dense(8, activation="tanh")(h)
    if mix is not None:
        h = L.Lambda(mix)(h)
    h = L.Dropout(0.2)(h)
    head = L.Dense(3, kernel_initializer="zeros" if zero_head else "glorot_uniform")
    return keras.Model(inputs, head(h))


def data(b, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(b, 6)).astype("float32"),
            rng.integers(0, 3, size=b).astype("int32"))


def private(model, loss=CE, *, n=200, q=0.1, **kw):
    names = [v.path for v in model.trainable_variables]
    agg = dpcore.PrivateAggregator(dpcore.flat(names, 1.0, 1.0), n=n, q=q,
                                   backend="tensorflow", seed=0)
    return PrivateGradients(model, loss, agg, **kw), agg


@pytest.mark.parametrize("batch", [6, 8, 16, 32])
@pytest.mark.parametrize("form", sorted(MIXING))
def test_mixing_is_refused_before_anything_is_recorded(form, batch):
    model = mlp(MIXING[form])
    dp, agg = private(model)
    before = [v.numpy() for v in model.variables]
    with pytest.raises(NotPerExampleError, match="mixes the examples"):
        dp(*data(batch))
    assert agg.ledger.events == ()
    for v, value in zip(model.variables, before):
        np.testing.assert_array_equal(v.numpy(), value)


def test_mixing_before_a_zero_head_and_in_the_inputs_is_refused():
    """A zero-initialised head's per-example gradients of the layer before it are 0, so the
    mixing shows in its input; inputs normalised by the batch show in the first layer's."""
    for model in (mlp(MIXING["detached batch mean"], zero_head=True),
                  mlp(mix_inputs=lambda x: x / ops.stop_gradient(ops.std(x, axis=0)))):
        with pytest.raises(NotPerExampleError, match="the input of layer"):
            private(model)[0](*data(16))


class RunningCentre(L.Layer):
    """Centres with a running mean of earlier batches, read before it is updated: step t's
    gradients carry batch t-1's records."""

    def build(self, shape):
        self.mean = self.add_weight(shape=shape[1:], initializer="zeros", trainable=False)

    def call(self, t, training=None):
        out = t - self.mean
        if training:
            self.mean.assign(0.5 * self.mean + 0.5 * ops.mean(t, axis=0))
        return out


class Monitored(L.Layer):
    """Keeps the mean activation in a Keras metric: a statistic of the batch in state."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.activation = keras.metrics.Mean()

    def call(self, t):
        self.activation.update_state(ops.mean(t))
        return t


def test_a_batch_statistic_kept_for_later_steps_is_refused_unless_none_reads_it():
    """The running mean changes what the next pass computes; the monitored mean, also a
    statistic of the batch left in state, does not (it leaves the model's gradients alone)."""
    with pytest.raises(NotPerExampleError, match="running_centre.*kept for later steps"):
        private(mlp(RunningCentre()))[0](*data(16))
    dp, _ = private(mlp(Monitored()))
    dp(*data(16))
    assert dp.independence.checked == 1


def test_a_batch_statistic_that_every_row_shares_is_refused():
    """Inputs divided by the batch's maximum, on data where every record reaches it: copies
    of a kept row change nothing, the doubled rows of the second split do."""
    x, y = data(16)
    x[:, 0] = 1.0
    x[:, 1:] = np.abs(x[:, 1:]) / (1 + np.abs(x[:, 1:]))
    with pytest.raises(NotPerExampleError, match="2.0 times"):
        private(mlp(mix_inputs=lambda t: t / ops.max(t)))[0](x, y)


def test_mixing_that_the_first_step_switches_on_is_refused_at_the_second():
    """Logits centred over the batch behind a zero head: no effect on the first batch (every
    logit is 0); the second batch is checked with the weights the first step moved."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    logits = L.Dense(3, kernel_initializer="zeros")(L.Dense(8, activation="tanh")(inputs))
    centred = L.Lambda(MIXING["detached batch mean"])(logits)
    model = keras.Model(inputs, centred)
    dp, agg = private(model)
    x, y = data(16)
    keras.optimizers.SGD(0.5).apply(dp(x, y), model.trainable_variables)
    assert dp.independence.checked == 1 and len(agg.ledger.events) == 2
    with pytest.raises(NotPerExampleError, match="mixes the examples"):
        dp(x, y)
    assert len(agg.ledger.events) == 2


def test_a_loss_that_mixes_the_examples_is_refused():
    def centred(y, logits):
        losses = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
        return losses - ops.mean(losses)

    with pytest.raises(NotPerExampleError, match="losses were scaled"):
        private(mlp(), centred)[0](*data(16))


def test_fit_and_train_on_batch_refuse_a_mixing_model_and_record_nothing(tmp_path):
    model = mlp(MIXING["detached batch mean"])
    before = [v.numpy() for v in model.variables]
    x, y = data(200)
    priv = make_private(model, n=200, batch_size=20, seed=0, ledger=tmp_path / "run.jsonl")
    priv.compile(optimizer="sgd", loss=CE)
    with pytest.raises(NotPerExampleError):
        priv.fit(x, y, epochs=1, steps_per_epoch=3, verbose=0)
    assert priv.aggregator.ledger.events == ()
    for v, value in zip(model.variables, before):
        np.testing.assert_array_equal(v.numpy(), value)
    x20, y20 = data(20)
    with pytest.raises(NotPerExampleError):
        priv.train_on_batch(x20, y20, sample_weight=np.ones(20, bool))
    assert priv.aggregator.ledger.events == ()
    # the documented way out for inputs whose rows are not examples
    priv = make_private(model, n=200, batch_size=20, seed=0, check_independence=False)
    priv.compile(optimizer="sgd", loss=CE)
    priv.fit(x, y, epochs=1, steps_per_epoch=2, verbose=0)


class Counter(L.Layer):
    """Per example, with state the forward pass updates: a step counter (a Keras variable
    and a bare tf.Variable) and noise from a tf.random.Generator."""

    def build(self, shape):
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False)
        self.tf_calls = tf.Variable(0.0, trainable=False)
        self.generator = tf.random.Generator.from_seed(1)

    def call(self, t, training=None):
        if training:
            self.calls.assign_add(1.0)
            self.tf_calls.assign_add(1.0)
            t = t + 0.01 * tf.cast(self.generator.normal(tf.shape(t)), t.dtype)
        return t


def transformer(seed=0, t=10, vocabulary=50):
    keras.utils.set_random_seed(seed)
    ids = keras.Input((t,), dtype="int32")
    h = L.Embedding(vocabulary, 16)(ids) + L.Embedding(t, 16)(ops.arange(t))
    h = L.LayerNormalization()(h + L.MultiHeadAttention(2, 8, dropout=0.1)(h, h))
    h = L.GaussianNoise(0.1)(Counter()(h))
    h = L.GlobalAveragePooling1D()(L.Dropout(0.1)(h))
    return keras.Model(ids, L.Dense(3)(h))


def cnn(seed=0):
    keras.utils.set_random_seed(seed)
    frozen = L.BatchNormalization()
    frozen.trainable = False
    return keras.Sequential([keras.Input((8, 8, 2)), L.Conv2D(4, 3, activation="relu"),
                             frozen, L.GroupNormalization(2), L.SpatialDropout2D(0.2),
                             L.MaxPooling2D(), L.Flatten(), L.Dense(3)])


def spectral(seed=0):
    """Keras's SpectralNormalization assigns its (trainable) kernel in the forward pass."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)),
                             L.SpectralNormalization(L.Dense(8, activation="tanh")),
                             L.Dense(3)])


def _batches(kind, b, steps):
    rng = np.random.default_rng(1)
    for _ in range(steps):
        if kind == "transformer":
            x = rng.integers(0, 50, size=(b, 10)).astype("int32")
        elif kind == "spectral":
            x = rng.normal(size=(b, 6)).astype("float32")
        else:
            x = rng.normal(size=(b, 8, 8, 2)).astype("float32")
        yield x, rng.integers(0, 3, size=b).astype("int32")


@pytest.mark.filterwarnings("ignore::dpcore_tensorflow.bookkeeping.FallbackWarning")
@pytest.mark.parametrize("kind", ["transformer", "cnn", "spectral"])
def test_per_example_models_pass_and_train_as_without_the_check(kind):
    """Dropout, Gaussian noise, attention, an unfed position embedding, a frozen batch norm,
    group norm (fallback), a counter the forward pass updates and a kernel it assigns
    (spectral normalisation): the check passes, and the weights, counter and seed generators
    after three steps are those without the check."""
    after = {}
    for check in (True, False):
        model = {"transformer": transformer, "cnn": cnn, "spectral": spectral}[kind]()
        dp, agg = private(model, check_independence=check)
        optimizer = keras.optimizers.SGD(0.1)
        for x, y in _batches(kind, 12, 3):
            optimizer.apply(dp(x, y), model.trainable_variables)
        assert dp.independence is None or dp.independence.done
        counter = [layer for layer in model._flatten_layers() if isinstance(layer, Counter)]
        after[check] = [v.numpy() for v in model.variables] + [
            c.tf_calls.numpy() for c in counter] + [c.generator.state.numpy() for c in counter]
    for on, off in zip(after[True], after[False]):
        np.testing.assert_array_equal(on, off)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_models_pass(policy):
    """float16's narrow range: gradients scaled by 2^-8 fall into its subnormals."""
    keras.mixed_precision.set_global_policy(policy)
    try:
        models = [mlp(seed=seed) for seed in range(4)]
    finally:
        keras.mixed_precision.set_global_policy("float32")
    for model in models:
        for batch in (8, 32):
            dp, _ = private(model)
            dp(*data(batch))


def test_examples_with_vanishing_gradients_pass():
    """Confident logits: some examples' squared norms underflow in one run and not in a
    scaled one; they are compared against the batch's largest norms, not their own."""
    model = mlp()
    head = model.layers[-1]
    head.kernel.assign(head.kernel * 60.0)
    dp, _ = private(model)
    optimizer = keras.optimizers.SGD(0.01)
    for seed in range(2):
        optimizer.apply(dp(*data(64, seed=seed)), model.trainable_variables)
    assert dp.independence.done


def test_randomness_the_check_cannot_replay_is_reported():
    model = mlp(lambda t: t + tf.random.normal(tf.shape(t)))
    with pytest.raises(NotPerExampleError, match="cannot check.*tf.random"):
        private(model)[0](*data(8))


def test_a_batch_with_fewer_than_two_records_waits_for_the_next():
    model = mlp(MIXING["batch mean"])
    dp, agg = private(model)
    x, y = data(8)
    dp(x, y, np.arange(8) < 1)  # one real record: nothing to mix, trained unchecked
    assert not dp.independence.done and len(agg.ledger.events) == 2
    with pytest.raises(NotPerExampleError):
        dp(x, y)
    assert len(agg.ledger.events) == 2


def test_a_step_in_a_users_function_must_be_checked_first():
    model = mlp()
    dp, agg = private(model)
    step = tf.function(dp.graph_step)
    x, y = data(8)
    mask = np.ones(8, bool)
    with pytest.raises(RuntimeError, match=r"check\(x, y, mask\)"):
        dp.record_step()
    assert agg.ledger.events == ()
    optimizer = keras.optimizers.SGD(0.1)
    for _ in range(2):  # checked twice; later steps need no check
        dp.check(x, y, mask)
        grads = step(x, y, mask, *map(tf.constant, dp.record_step()))[0]
        optimizer.apply(grads, model.trainable_variables)
    dp.record_step()
    assert dp.independence.done


def test_the_vectorized_mode_is_not_checked():
    """``mode="vectorized"`` differentiates the model on one example at a time: per example
    by construction, whatever the model does with a batch."""
    dp, agg = private(mlp(MIXING["batch mean"]), mode="vectorized")
    assert dp.independence is None
    dp(*data(8))
    assert len(agg.ledger.events) == 2


def test_fit_with_the_check_trains_on_the_batch_it_checked():
    """The check takes fit's first Poisson batch and hands it on to the step: the same
    batches, ledger and weights as without the check, and the step traced once."""
    x, y = data(200)
    after, ledgers, traces = {}, {}, {}
    for check in (True, False):
        model = mlp(seed=3)
        priv = make_private(model, n=200, batch_size=20, seed=0, check_independence=check)
        traces[check] = 0
        train_step = priv.train_step

        def counted(batch, train_step=train_step, check=check):
            traces[check] += 1
            return train_step(batch)

        priv.train_step = counted
        priv.compile(optimizer="sgd", loss=CE)
        priv.fit(x, y, epochs=1, steps_per_epoch=4, verbose=0)
        after[check] = [v.numpy() for v in model.variables]
        ledgers[check] = priv.aggregator.ledger.steps()
    assert ledgers[True] == ledgers[False] == [dpcore.Step(0.1, 1.0, 4)]
    assert traces == {True: 1, False: 1}
    for on, off in zip(after[True], after[False]):
        np.testing.assert_array_equal(on, off)


def test_a_loss_with_python_control_flow_is_checked_through_autograph():
    """The check traces as Keras does (no autograph) unless the model or loss needs it, as
    this loss does (a Python ``if`` on a tensor), and PrivateGradients's step converts it."""
    def guarded(y, logits):
        losses = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
        if tf.reduce_any(tf.math.is_nan(losses)):
            losses = tf.where(tf.math.is_nan(losses), tf.zeros_like(losses), losses)
        return losses

    dp, agg = private(mlp(), guarded)
    dp(*data(8))
    assert dp.independence.checked == 1
    with pytest.raises(NotPerExampleError):
        private(mlp(MIXING["batch mean"]), guarded)[0](*data(8))


def test_inputs_that_cannot_be_scaled_are_replaced_by_copies():
    """A category index kept as a float column: doubled or negated rows are out of range, so
    those splits fall back to copies."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    ids = L.Lambda(lambda t: ops.cast(t[:, 0], "int32"))(inputs)
    h = ops.concatenate([L.Embedding(4, 3)(ids), inputs[:, 1:]], axis=1)
    dp, _ = private(keras.Model(inputs, L.Dense(3)(h)))
    x, y = data(8)
    x[:, 0] = 2 + np.arange(8) % 2  # doubled: 4 or 6, out of range
    dp(x[:, :5], y)
    assert dp.independence.checked == 1


def _sorted_only(t):
    """The rows must come sorted by their first column (as sequences sorted by length)."""
    tf.debugging.assert_greater_equal(t[:-1, 0], t[1:, 0], message="rows not sorted")
    return t


def test_inputs_sorted_by_a_column_stay_sorted_in_the_reruns():
    """Replaced rows take the nearest kept row before them (as in PyTorch's check), so a
    model that needs its rows sorted runs the reruns; scaled splits fall back to copies."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    dp, _ = private(keras.Model(inputs, L.Dense(3)(L.Lambda(_sorted_only)(inputs))))
    x, y = data(8)
    x[:, 0] = np.arange(8)[::-1]
    dp(x, y)
    assert dp.independence.checked == 1


def _trimmed(ids):
    """Token ids (0 = padding) trimmed to the batch's longest sequence."""
    return ids[:, :tf.reduce_max(tf.reduce_sum(tf.cast(ids > 0, tf.int32), 1))]


def test_a_shape_that_follows_the_batch_is_named():
    keras.utils.set_random_seed(0)
    ids = keras.Input((10,), dtype="int32")
    h = L.GlobalAveragePooling1D()(L.Embedding(20, 4)(L.Lambda(_trimmed)(ids)))
    dp, _ = private(keras.Model(ids, L.Dense(3)(h)))
    rng = np.random.default_rng(0)
    x = np.zeros((8, 10), "int32")
    for i, n in enumerate([9, 2, 3, 5, 1, 4, 2, 6]):
        x[i, :n] = rng.integers(1, 20, n)
    with pytest.raises(NotPerExampleError, match=r"the shape of the input of layer .* changed "
                                                 r"from \(8, 9\)"):
        dp(x, rng.integers(0, 3, 8).astype("int32"))


def test_the_second_check_waits_for_the_weights_to_move():
    dp, _ = private(mlp())
    x, y = data(8)
    dp(x, y)
    dp(x, y)  # the update not applied: the same weights
    assert dp.independence.checked == 1
    keras.optimizers.SGD(0.5).apply(dp(x, y), dp.variables)
    dp(x, y)
    assert dp.independence.checked == 2
