"""The fused DP step, Keras fit and Poisson tf.data: exactness without noise, ghost ==
vectorized, noise against the ledger, padding, the ledger before every release."""

import math
import warnings

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import dpcore  # noqa: E402
from dpcore.aggregation import NonFiniteNormError  # noqa: E402
from dpcore.sampling import steps_per_epoch  # noqa: E402
from dpcore_tensorflow import (PrivateGradients, make_private, poisson_dataset,  # noqa: E402
                               per_example_loss)
from dpcore_tensorflow.data import default_capacity  # noqa: E402

L = keras.layers
CE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def cnn(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((8, 8, 1)), L.Conv2D(3, 3, activation="relu"),
                             L.MaxPooling2D(), L.Flatten(), L.Dense(6, activation="tanh"),
                             L.Dense(3)])


def data(b=12, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(b, 8, 8, 1)).astype("float32"),
            rng.integers(0, 3, size=b).astype("int32"))


def aggregator(model, clip, z, *, n=100, q=0.12, seed=0, **kw):
    names = [v.path for v in model.trainable_variables]
    return dpcore.PrivateAggregator(dpcore.flat(names, clip, z), n=n, q=q,
                                    backend="tensorflow", seed=seed, **kw)


def test_zero_noise_large_clip_is_the_non_private_gradient():
    model = cnn()
    x, y = data()
    agg = aggregator(model, 1e6, 0.0)
    grads = PrivateGradients(model, CE, agg)(x, y)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(per_example_loss(CE)(y, model(x, training=True)))
    expected = tape.gradient(loss, model.trainable_variables)
    for g, e in zip(grads, expected):
        np.testing.assert_allclose(g.numpy(), e.numpy() / agg.expected_size, rtol=2e-5,
                                   atol=1e-7)


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_ghost_equals_vectorized_on_the_same_batch(clipping):
    model = cnn(1)
    x, y = data(seed=1)
    out = {}
    for mode in ("auto", "ghost", "vectorized"):
        private = make_private(model, n=100, q=0.12, max_grad_norm=0.05, noise_multiplier=0.0,
                               clipping=clipping, seed=0, mode=mode)
        out[mode] = PrivateGradients(model, CE, private.aggregator, mode=mode)(x, y)
    for mode in ("ghost", "vectorized"):
        for a, b in zip(out["auto"], out[mode]):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-7)


def test_padded_rows_change_nothing():
    model = cnn(2)
    x, y = data(seed=2)
    grads = {}
    for pad in (0, 5):
        xp = np.concatenate([x, 1e3 * np.ones((pad, *x.shape[1:]), x.dtype)])
        yp = np.concatenate([y, np.zeros(pad, y.dtype)])
        mask = np.arange(len(xp)) < len(x)
        agg = aggregator(model, 0.1, 0.0)
        grads[pad] = PrivateGradients(model, CE, agg)(xp, yp, mask)
    for a, b in zip(grads[0], grads[5]):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-8)


def test_noise_std_matches_the_ledger():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((200,)), L.Dense(100)])
    x = np.zeros((4, 200), "float32")
    y = np.zeros((4, 100), "float32")
    agg = aggregator(model, 1e-8, 1e7, seed=5)  # clip ~0: the release is noise
    grads = PrivateGradients(model, "mse", agg)(x, y)
    expected = agg.ledger.events[-1].noise_std / agg.expected_size
    kernel = grads[0].numpy()
    d = kernel.size
    # relative standard error of a sample std of d normals: 1/sqrt(2d) ~ 0.5%; 5 of them
    # (2.5%) is far below the 10% error this must catch
    assert abs(kernel.std() / expected - 1) < 5 / math.sqrt(2 * d)
    assert abs(kernel.mean()) < 5 * expected / math.sqrt(d)


def test_seeded_steps_repeat_and_noise_is_fresh_each_step():
    x, y = data(seed=4)
    runs = []
    for _ in range(2):
        model = cnn(4)
        agg = aggregator(model, 1.0, 1.0, seed=11)
        dp = PrivateGradients(model, CE, agg)
        runs.append([dp(x, y)[0].numpy() for _ in range(2)])
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    assert not np.allclose(runs[0][0], runs[0][1])


def test_xla_step_matches_the_graph_step():
    x, y = data(seed=5)
    out = []
    for jit in (False, True):
        model = cnn(5)
        agg = aggregator(model, 0.1, 0.0)
        out.append(PrivateGradients(model, CE, agg, jit_compile=jit)(x, y))
    for a, b in zip(*out):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-7)


def test_poisson_dataset_pads_masks_and_samples():
    n, q = 1000, 0.05
    x = np.arange(n, dtype="float32")[:, None]
    y = np.arange(n, dtype="int32")
    cap = default_capacity(n, q)
    assert cap % 8 == 0 and cap >= 50 + 4 * math.sqrt(50)
    sizes = []
    for xb, yb, mask in poisson_dataset(x, y, q=q, steps=200, seed=0):
        assert xb.shape[0] % cap == 0 and mask.shape[0] == xb.shape[0]
        m = mask.numpy()
        assert not m[m.sum():].any()  # real rows first
        np.testing.assert_array_equal(xb.numpy()[m, 0], yb.numpy()[m])
        assert (xb.numpy()[~m] == 0).all()
        sizes.append(int(m.sum()))
    # Binomial(1000, 0.05): mean 50, sd 6.9; the mean of 200 samples is within 4 sd / sqrt(200)
    assert abs(np.mean(sizes) - 50) < 4 * math.sqrt(n * q * (1 - q)) / math.sqrt(200)
    assert np.std(sizes) > 4
    big = list(poisson_dataset(x, y, q=q, steps=1, seed=0, capacity=8))
    assert big[0][2].numpy().sum() > 8 and big[0][0].shape[0] % 8 == 0


def test_fit_writes_the_ledger_before_each_step_is_released(tmp_path):
    n = 600
    rng = np.random.default_rng(6)
    x = rng.normal(size=(n, 8, 8, 1)).astype("float32")
    y = (x[:, :4].mean(axis=(1, 2, 3)) > 0).astype("int32")
    path = tmp_path / "ledger.jsonl"
    private = make_private(cnn(6), n=n, batch_size=60, max_grad_norm=1.0, noise_multiplier=0.3,
                           ledger=path, seed=0)
    private.compile(optimizer=keras.optimizers.SGD(0.2), loss=CE, metrics=["accuracy"])
    seen = []

    class Check(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(dpcore.read_ledger(path).steps()[0].count)

    history = private.fit(x, y, epochs=2, verbose=0, callbacks=[Check()])
    assert seen == list(range(1, 21))  # step t's events were on disk when it was released
    assert dpcore.read_ledger(path).steps() == [dpcore.Step(0.1, 0.3, 20)]
    assert history.history["loss"][1] < history.history["loss"][0]


def test_compiled_metrics_leave_the_padding_rows_out():
    """Keras passes the sample weight (the padding mask) only to weighted_metrics: plain
    metrics counted the zero rows that pad each sample (accuracy 0.49 logged for 0)."""
    n = 200
    model = keras.Sequential([keras.Input((4,)), L.Dense(
        2, kernel_initializer="zeros", bias_initializer=keras.initializers.Constant([1.0, 0.0]))])
    private = make_private(model, n=n, batch_size=20, noise_multiplier=1.0, seed=0)
    private.compile(optimizer=keras.optimizers.SGD(0.0), loss=CE, metrics=["accuracy"],
                    weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="weighted")])
    history = private.fit(np.ones((n, 4), "float32"), np.ones(n, "int32"), verbose=0)
    assert history.history["accuracy"] == history.history["weighted"] == [0.0]
    with pytest.raises(ValueError, match="give metrics as one list"):
        private.compile(optimizer="sgd", loss=CE, metrics={"out": ["accuracy"]},
                        weighted_metrics=["accuracy"])


def test_an_epoch_takes_round_1_over_q_steps_halves_up_as_every_backend():
    """q = 0.4: 1/q = 2.5 gave 2 steps an epoch here (Python's round, halves to even) and 3
    in PyTorch's loader; calibrated for one, a run of the other overspent."""
    private = make_private(mlp(), n=40, q=0.4, noise_multiplier=1.0, seed=0)
    private.compile(optimizer="sgd", loss=CE)
    private.fit(*records(), epochs=1, verbose=0)
    assert private.aggregator.ledger.samplings == steps_per_epoch(0.4) == 3


def test_fit_rejects_batch_size_and_multi_step_execution():
    private = make_private(cnn(), n=100, batch_size=10)
    with pytest.raises(ValueError, match="steps_per_execution"):
        private.compile(optimizer="sgd", loss=CE, steps_per_execution=4)
    private.compile(optimizer="sgd", loss=CE)
    x, y = data(100)
    with pytest.raises(ValueError, match="batch_size=32 does not apply.*Poisson"):
        private.fit(x, y, batch_size=32)
    private.steps_per_execution = 4  # after compile: several releases per ledger step
    with pytest.raises(ValueError, match="steps_per_execution must be 1"):
        private.fit(x, y, epochs=1, steps_per_epoch=1, verbose=0)
    assert private.aggregator.ledger.events == ()


def test_an_optimizers_loss_scale_factor_is_refused():
    """Keras would divide the private gradient by it; the per-example losses are unscaled."""
    private = make_private(cnn(), n=100, batch_size=10)
    private.compile(optimizer=keras.optimizers.SGD(0.1, loss_scale_factor=4.0), loss=CE)
    x, y = data(100)
    with pytest.raises(ValueError, match="loss_scale_factor=4.0 would divide"):
        private.fit(x, y, epochs=1, steps_per_epoch=1, verbose=0)
    assert private.aggregator.ledger.events == ()


def test_fit_stops_on_nonfinite_records():
    x, y = data(100, seed=7)
    x[3] = np.nan
    private = make_private(cnn(), n=100, q=1.0, seed=0)
    private.compile(optimizer="sgd", loss=CE)
    with pytest.raises(NonFiniteNormError, match="record"):
        private.fit(x, y, epochs=1, verbose=0)


def test_batch_normalization_model_is_rejected():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), L.Dense(3), L.BatchNormalization()])
    with pytest.raises(ValueError, match="BatchNormalization"):
        private = make_private(model, n=10, q=0.5)
        private.compile(optimizer="sgd", loss="mse")
        private.fit(np.zeros((10, 4), "float32"), np.zeros((10, 3), "float32"), verbose=0)


@pytest.mark.parametrize("resumed", [False, True])
def test_fit_follows_a_clip_schedule(tmp_path, resumed):
    """Also over a resumed run: made private again on the run's ledger after two steps, the
    model takes the schedule's clips of steps 2 and 3."""
    from dpcore.schedules import ClipSchedule, decreasing
    x, y = data(100, seed=8)
    for steps in [2, 2] if resumed else [4]:
        private = make_private(cnn(8), n=100, batch_size=20, max_grad_norm=1.0,
                               noise_multiplier=0.5, seed=0, ledger=tmp_path / "run.jsonl",
                               clip_schedule=ClipSchedule(decreasing(2.0)))
        private.compile(optimizer="sgd", loss=CE)
        private.fit(x, y, epochs=1, steps_per_epoch=steps, verbose=0)
        private.aggregator.ledger.close()
    clips = [e.clip for e in dpcore.read_ledger(tmp_path / "run.jsonl").events
             if hasattr(e, "clip")]
    assert clips == [1.0, 1 / 1.5, 0.5, 0.5]  # C / min(2, 1 + t / 2)
    state = private._dp_state
    assert np.allclose(state.clips.numpy(), [clips[-1]])  # the last step ran with its clip


def test_adaptive_clipping_is_refused_by_the_fused_step():
    from dpcore.adaptive import QuantileClipping
    model = cnn()
    agg = aggregator(model, 0.1, 1.0, clipping=QuantileClipping(count_noise_std=5.0))
    x, y = data()
    with pytest.raises(NotImplementedError, match="private_gradient"):
        PrivateGradients(model, CE, agg)(x, y)
    assert agg.ledger.events == ()  # refused before anything was recorded
    with pytest.raises(TypeError, match="clip_schedule must be a dpcore.ClipSchedule, got "
                                        "QuantileClipping.*private_gradient"):
        make_private(model, n=100, q=0.1, clip_schedule=QuantileClipping(count_noise_std=5.0))


def test_fit_on_a_poisson_dataset_and_a_custom_loop_share_the_ledger():
    x, y = data(200, seed=9)
    private = make_private(cnn(9), n=200, batch_size=20, noise_multiplier=0.5, seed=0)
    private.compile(optimizer="sgd", loss=CE)
    agg = private.aggregator
    private.fit(poisson_dataset(x, y, sampler=agg.sampler, steps=3), epochs=1, verbose=0)
    dp = PrivateGradients(private.model, CE, agg)
    optimizer = keras.optimizers.SGD(0.1)
    for xb, yb, mask in poisson_dataset(x, y, sampler=agg.sampler, steps=2):
        optimizer.apply(dp(xb, yb, mask), private.model.trainable_variables)
    assert agg.ledger.steps() == [dpcore.Step(0.1, 0.5, 5)]


def of_unknown_length(dataset):
    """``dataset``'s elements, in a dataset whose cardinality tf.data does not know."""
    selector = tf.data.Dataset.from_tensors(np.int64(0)).repeat()
    return tf.data.Dataset.choose_from_datasets([dataset], selector)


@pytest.mark.parametrize("steps_per_epoch, epochs", [(None, 2), (5, 1)])
def test_the_end_of_a_dataset_of_unknown_length_records_no_step(steps_per_epoch, epochs):
    """A dataset whose end Keras cannot know (chosen from by a selector), also with
    steps_per_epoch past its end: the call that finds no batch writes nothing, so the ledger
    holds exactly the steps trained on (Keras's optimizer.iterations counts that call too)."""
    x, y = data(200, seed=10)
    private = make_private(cnn(10), n=200, batch_size=20, noise_multiplier=0.5, seed=0)
    private.compile(optimizer="sgd", loss=CE)
    agg = private.aggregator
    dataset = of_unknown_length(poisson_dataset(x, y, sampler=agg.sampler, steps=3))
    assert int(dataset.cardinality()) == tf.data.UNKNOWN_CARDINALITY
    trained = []

    class Count(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            trained.append(batch)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras: "your input ran out of data"
        private.fit(dataset, steps_per_epoch=steps_per_epoch, epochs=epochs, verbose=0,
                    callbacks=[Count()])
    assert len(trained) == 3 * epochs
    assert agg.ledger.steps() == [dpcore.Step(0.1, 0.5, 3 * epochs)]


@pytest.mark.parametrize("extra", ["none", "weights"])
def test_fit_refuses_a_dataset_without_a_padding_mask(extra):
    """Fixed-size batches would be accounted as Poisson samples; float sample weights would be
    read as a padding mask (0.25 as full weight)."""
    x, y = data(40, seed=10)
    private = make_private(cnn(10), n=40, batch_size=8, noise_multiplier=1.0, seed=0)
    private.compile(optimizer="sgd", loss=CE)
    parts = (x, y) if extra == "none" else (x, y, np.full(40, 0.25, "float32"))
    with pytest.raises(ValueError, match="bool padding mask"):
        private.fit(tf.data.Dataset.from_tensor_slices(parts).batch(8), epochs=1, verbose=0)
    assert len(private.aggregator.ledger.events) == 0


@pytest.mark.parametrize("source", ["rate", "records", "own", "zipped"])
def test_fit_refuses_a_dataset_not_sampled_at_the_aggregators_n_and_q(source):
    """The ledger prices every step at the aggregator's q: Poisson samples drawn at another
    rate (or from other records), or batches of one's own, would be under-reported."""
    x, y = data(40, seed=10)
    private = make_private(cnn(10), n=40, batch_size=4, noise_multiplier=1.0, seed=0)
    private.compile(optimizer="sgd", loss=CE)
    agg = private.aggregator
    datasets = {
        "rate": lambda: poisson_dataset(x, y, q=0.5, steps=2).map(lambda *batch: batch),
        "records": lambda: poisson_dataset(x[:20], y[:20], q=agg.q, steps=2),
        "own": lambda: tf.data.Dataset.from_tensor_slices(
            (x.reshape(10, 4, *x.shape[1:]), y.reshape(10, 4), np.ones((10, 4), bool))),
        "zipped": lambda: tf.data.Dataset.zip(
            poisson_dataset(x, y, sampler=agg.sampler, steps=2),
            poisson_dataset(x, y, q=0.5, steps=2)).map(lambda a, b: a)}
    with pytest.raises(ValueError, match=r"Poisson samples at the aggregator's n=40, q=0\.1.*"
                                         r"sampler=private\.aggregator\.sampler"):
        private.fit(datasets[source](), epochs=1, verbose=0)
    assert len(agg.ledger.events) == 0


@pytest.mark.parametrize("change", ["filter", "batch", "unbatch", "flat_map", "parallel_batch",
                                    "map_and_batch", "zipped_with_own_batches"])
def test_fit_refuses_a_dataset_that_drops_or_regroups_samples(change):
    """A filter by content makes the steps taken depend on the data (skipping empty samples,
    say: the dataset looked like the aggregator's and was trained on); regrouped records are
    batches the ledger does not describe: two samples merged in one step (tf.data's parallel
    and fused batching had passed a list of names to refuse), or fixed batches zipped with
    the samples."""
    x, y = data(40, seed=10)
    private = make_private(cnn(10), n=40, batch_size=4, noise_multiplier=1.0, seed=0)
    private.compile(optimizer="sgd", loss=CE)
    agg = private.aggregator
    dataset = poisson_dataset(x, y, sampler=agg.sampler, steps=2)
    own = tf.data.Dataset.from_tensor_slices(
        (x.reshape(10, 4, *x.shape[1:]), y.reshape(10, 4), np.ones((10, 4), bool)))

    def merge(x, y, mask):  # two padded samples as one batch
        return (tf.reshape(x, (-1, *x.shape[2:])), tf.reshape(y, (-1,)),
                tf.reshape(mask, (-1,)))

    changed = {
        "filter": lambda: dataset.filter(lambda x, y, mask: tf.reduce_any(mask)),
        "batch": lambda: dataset.batch(1).map(lambda x, y, m: (x[0], y[0], m[0])),
        "unbatch": lambda: dataset.unbatch().batch(4),
        "flat_map": lambda: dataset.flat_map(
            lambda *batch: tf.data.Dataset.from_tensors(batch).repeat(2)),
        "parallel_batch": lambda: dataset.batch(2, num_parallel_calls=2).map(merge),
        "map_and_batch": lambda: dataset.apply(
            tf.data.experimental.map_and_batch(lambda *b: b, 2)).map(merge),
        "zipped_with_own_batches": lambda: tf.data.Dataset.zip(dataset, own).map(
            lambda sample, batch: batch)}[change]()
    with pytest.raises(ValueError, match="drops, cuts, regroups or combines Poisson samples"):
        private.fit(changed, epochs=1, verbose=0)
    assert len(agg.ledger.events) == 0


def test_fit_refuses_generators_and_validation_split():
    x, y = data(40, seed=10)
    private = make_private(cnn(10), n=40, batch_size=4, noise_multiplier=1.0, seed=0)
    private.compile(optimizer="sgd", loss=CE)

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 2

        def __getitem__(self, index):
            return x[:4], y[:4]

    for given in (((x[:4], y[:4]) for _ in range(2)), Batches()):
        with pytest.raises(ValueError, match="cannot take x of type .*not be Poisson samples"):
            private.fit(given, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="validation_split=0.2 .* pass .* as validation_data"):
        private.fit(x, y, validation_split=0.2, epochs=1, verbose=0)
    assert len(private.aggregator.ledger.events) == 0


def test_train_on_batch_refuses_weights_and_takes_a_padding_mask():
    """Weights reached the step as its padding mask (cast to bool): silently ignored."""
    x, y = data(8, seed=10)
    private = make_private(cnn(10), n=40, batch_size=8, noise_multiplier=1.0, seed=0,
                           check_independence=False)
    private.compile(optimizer="sgd", loss=CE)
    with pytest.raises(ValueError, match="class_weight=.* does not apply"):
        private.train_on_batch(x, y, class_weight={0: 10.0, 1: 1.0, 2: 1.0})
    with pytest.raises(ValueError, match=r"padding mask .* such as \[0\.5 2\. \]"):
        private.train_on_batch(x, y, sample_weight=np.r_[np.ones(6), 0.5, 2.0])
    assert len(private.aggregator.ledger.events) == 0
    private.train_on_batch(x, y, sample_weight=np.r_[np.ones(6), 0, 0].astype("float32"))
    assert private.aggregator.ledger.steps() == [dpcore.Step(0.2, 1.0, 1)]
    with pytest.raises(ValueError, match="loss_weights=10.0 would not be applied"):
        private.compile(optimizer="sgd", loss=CE, loss_weights=10.0)  # was ignored


def test_private_gradients_refuses_a_mask_of_weights():
    """Cast to bool in the step, weights of 0.5 counted as whole records."""
    x, y = data(8, seed=10)
    model = cnn(10)
    dp = PrivateGradients(model, CE, aggregator(model, 1.0, 1.0), check_independence=False)
    with pytest.raises(ValueError, match=r"booleans or 0/1 .* got \[0.5, 0.5\]"):
        dp(x, y, np.r_[np.ones(6), 0.5, 0.5])
    assert len(dp.aggregator.ledger.events) == 0


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_box_muller_noise_is_standard_normal(dtype):
    from scipy import stats

    from dpcore_tensorflow.kernels import standard_normal
    z = standard_normal(tf.random.Generator.from_seed(7), 400_001, tf.as_dtype(dtype)).numpy()
    assert z.shape == (400_001,) and z.dtype == dtype and np.isfinite(z).all()
    assert stats.kstest(z, "norm").pvalue > 1e-3
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01
    assert abs(np.mean(np.abs(z) > 3) - 2 * stats.norm.sf(3)) < 5e-4
    pairs = z[:400_000].reshape(2, -1)  # cos and sin halves of one (u, v) are uncorrelated
    assert abs(np.corrcoef(pairs)[0, 1]) < 0.01


def test_the_tape_style_call_inside_a_tf_function_is_refused():
    """Traced, it would write one step's events for every step the function runs."""
    model = cnn(5)
    x, y = data(seed=5)
    agg = aggregator(model, 1.0, 1.0, on_nonfinite="drop")
    dp = PrivateGradients(model, CE, agg)

    @tf.function
    def train_step(x, y):
        return dp(x, y)

    with pytest.raises(RuntimeError, match="cannot run inside a tf.function"):
        train_step(x, y)
    assert len(agg.ledger.events) == 0


class TokensAndPositions(L.Layer):
    """keras.io's token-and-position embedding; with ``per_example`` the positions are given
    one row per example."""

    def __init__(self, per_example, **kwargs):
        super().__init__(**kwargs)
        self.per_example = per_example
        self.tokens, self.positions = L.Embedding(9, 4), L.Embedding(5, 4)

    def call(self, ids):
        positions = keras.ops.arange(ids.shape[1])
        if self.per_example:
            positions = keras.ops.broadcast_to(positions, keras.ops.shape(ids))
        return self.tokens(ids) + self.positions(positions)


@pytest.mark.parametrize("batch", [5, 6])  # 5: as many examples as positions
def test_a_layer_the_batch_does_not_feed_takes_the_fallback(batch):
    """Embedding(arange(T)) has no example axis: its backprop is summed over the batch, and
    with B = T the taps would clip positions as if they were examples. Its table takes the
    vectorized fallback instead; positions given per example are tapped."""
    from dpcore_tensorflow.bookkeeping import FallbackWarning

    rng = np.random.default_rng(6)
    x = rng.integers(0, 9, size=(batch, 5)).astype("int32")
    y = rng.integers(0, 3, size=batch).astype("int32")
    grads = {}
    for per_example in (False, True):
        keras.utils.set_random_seed(6)
        model = keras.Sequential([keras.Input((5,), dtype="int32"),
                                  TokensAndPositions(per_example), L.Flatten(), L.Dense(3)])
        for mode in ("auto", "vectorized"):
            step = PrivateGradients(model, CE, aggregator(model, 0.01, 0.0), mode=mode)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                grads[per_example, mode] = step(x, y)
            fallback = any(issubclass(w.category, FallbackWarning) for w in caught)
            assert fallback == (mode == "auto" and not per_example)  # else tapped
    for key in grads:
        for a, b in zip(grads[key], grads[False, "vectorized"]):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("mode", ["auto", "vectorized"])
def test_masked_positions_are_left_out_of_each_example_loss(mode):
    """Embedding(mask_zero=True): Keras's loss drops padded positions; each example's loss is
    Keras's loss on that example alone."""
    rng = np.random.default_rng(11)
    x = rng.integers(1, 10, size=(6, 7)).astype("int32")
    x[:, 4:], x[0, 2:] = 0, 0  # padding of two lengths
    y = rng.integers(0, 3, size=(6, 7)).astype("int32")
    keras.utils.set_random_seed(11)
    model = keras.Sequential([keras.Input((7,), dtype="int32"),
                              L.Embedding(10, 4, mask_zero=True), L.Dense(3)])
    agg = aggregator(model, 1e6, 0.0)
    grads = PrivateGradients(model, CE, agg, mode=mode)(x, y)
    want = [np.zeros(v.shape) for v in model.trainable_variables]
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            loss = CE(y[i:i + 1], model(x[i:i + 1], training=True))
        for w, g in zip(want, tape.gradient(loss, model.trainable_variables)):
            w += tf.convert_to_tensor(g).numpy()
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g.numpy(), w / agg.expected_size, rtol=1e-4, atol=1e-7)


def test_fit_takes_a_dict_of_inputs():
    """A model with two named inputs: each Poisson sample takes the same rows of both."""
    keras.utils.set_random_seed(0)
    a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
    model = keras.Model({"a": a, "b": b}, L.Dense(3)(L.Concatenate()([a, b])))
    rng = np.random.default_rng(0)
    x = {"a": rng.normal(size=(50, 3)).astype("float32"),
         "b": rng.normal(size=(50, 2)).astype("float32")}
    y = rng.integers(0, 3, 50)
    for xb, yb, mask in poisson_dataset(x, y, q=0.2, steps=3, seed=0):
        rows = [int(np.flatnonzero((x["a"] == r).all(1))[0]) for r in xb["a"].numpy()[mask]]
        np.testing.assert_array_equal(xb["b"].numpy()[mask], x["b"][rows])
        np.testing.assert_array_equal(yb.numpy()[mask], y[rows])
    private = make_private(model, n=50, batch_size=10, seed=0)
    private.compile(optimizer="sgd", loss=CE)
    private.fit(x, y, epochs=1, steps_per_epoch=3, verbose=0)
    assert private.aggregator.ledger.steps() == [dpcore.Step(0.2, 1.0, 3)]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_secure_aggregator_is_served_by_private_gradient(dtype):
    """secure=True draws noise on the host: backend.private_gradient adds the noise the
    ledger records (zero gradients; a 10% error fails), in the variables' dtype."""
    agg = dpcore.PrivateAggregator(dpcore.flat(["w"], 1.0, 3.0), n=100, q=0.5,
                                   backend="tensorflow", secure=True)
    agg.sample()
    w = tf.zeros(50_000, dtype=dtype)
    grads = dpcore.get_backend("tensorflow").private_gradient(
        lambda p, b: tf.reduce_sum(p["w"] * 0 * b, axis=1), {"w": w},
        tf.ones((7, 50_000), dtype=dtype), agg)
    std = float(tf.math.reduce_std(tf.cast(grads["w"], tf.float64))) * agg.expected_size
    assert grads["w"].dtype == w.dtype and abs(std / 3.0 - 1) < 0.03


@pytest.mark.parametrize("jit", [False, True])
def test_the_fused_step_adds_the_secure_generators_normals(jit, record_normals):
    """PrivateGradients with a secure aggregator: the release is the clipped mean (the same
    step without noise) plus alpha_j sigma~ / (q n) times the host's normals, split into the
    leaves in the clipper's order; fresh normals every step."""
    x, y = data(seed=7)
    clean_model = cnn(7)  # the same weights
    clean = PrivateGradients(clean_model, CE, aggregator(clean_model, 0.1, 0.0),
                             jit_compile=jit)(x, y)
    model = cnn(7)
    agg = aggregator(model, 0.1, 2.0, seed=None, secure=True)
    dp = PrivateGradients(model, CE, agg, jit_compile=jit)
    drawn = record_normals(agg)
    first, second = dp(x, y), dp(x, y)
    assert len(drawn) == 2 and agg.ledger.steps() == [dpcore.Step(0.12, 2.0, 2)]
    by_path = {v.path: v for v in model.trainable_variables}
    for grads, normals in zip((first, second), drawn):
        parts = np.split(normals, np.cumsum([math.prod(by_path[leaf].shape)
                                             for leaf in dp.clipper.leaves])[:-1])
        noise = {leaf: z.reshape(by_path[leaf].shape) for leaf, z in zip(dp.clipper.leaves,
                                                                          parts)}
        scale = 0.1 * 2.0 / agg.expected_size
        for name, g, c in zip(dp.engine.names, grads, clean):
            np.testing.assert_allclose(g.numpy(), c.numpy() + scale * noise[name], rtol=1e-5,
                                       atol=1e-6)


def test_keras_fit_with_a_secure_aggregator_adds_the_noise_the_ledger_records():
    """make_private(secure=True): each step's update is -lr times noise of the standard
    deviation the ledger records (zero gradients; a 10% error fails), fresh at every step;
    a seed is refused (it would make the secure generator predictable)."""
    with pytest.raises(ValueError, match="no seed"):
        make_private(cnn(), n=100, batch_size=10, seed=0, secure=True)
    keras.utils.set_random_seed(8)
    model = keras.Sequential([keras.Input((200,)), L.Dense(100)])
    private = make_private(model, n=100, batch_size=10, max_grad_norm=1e-8,
                           noise_multiplier=1e7, secure=True)
    private.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    updates, kernel = [], model.layers[0].kernel
    for _ in range(2):
        before = kernel.numpy()
        private.fit(np.zeros((100, 200), "float32"), np.zeros((100, 100), "float32"),
                    steps_per_epoch=1, verbose=0)
        updates.append(before - kernel.numpy())
    expected = private.aggregator.ledger.events[-1].noise_std / private.aggregator.expected_size
    d = kernel.numpy().size
    for update in updates:  # 5 standard errors of a sample std of d normals: 2.5%
        assert abs(update.std() / expected - 1) < 5 / math.sqrt(2 * d)
    assert np.corrcoef(updates[0].ravel(), updates[1].ravel())[0, 1] < 5 / math.sqrt(d)
    assert private.aggregator.ledger.steps() == [dpcore.Step(0.1, 1e7, 2)]


def test_normals_go_to_the_step_of_a_secure_aggregator_only():
    model = cnn()
    x, y = data()
    secure = PrivateGradients(model, CE, aggregator(model, 1.0, 1.0, seed=None, secure=True))
    plain = PrivateGradients(model, CE, aggregator(model, 1.0, 1.0))
    mask = np.ones(len(x), bool)
    with pytest.raises(ValueError, match="normals=dp.host_normals"):
        secure.graph_step(x, y, mask, [1.0], [1.0] * 6)
    with pytest.raises(ValueError, match="draws its noise in graph"):
        plain.graph_step(x, y, mask, [1.0], [1.0] * 6, secure.host_normals())
    with pytest.raises(ValueError, match="serves a secure=True aggregator"):
        plain.host_normals()
    assert secure.host_normals().shape == [sum(math.prod(v.shape)
                                               for v in model.trainable_variables)]


def test_a_custom_loops_function_takes_fresh_host_normals_and_refuses_traced_ones():
    """The normals enter the user's tf.function as an argument, drawn eagerly each step: the
    releases differ. Drawn inside the function, or made a constant of it, one draw would be
    added at every step: refused."""
    model = keras.Sequential([keras.Input((5,)), L.Dense(3)])
    dp = PrivateGradients(model, "mse", aggregator(model, 1e-8, 1e7, seed=None, secure=True),
                          check_independence=False)
    x, y, mask = np.zeros((4, 5), "float32"), np.zeros((4, 3), "float32"), np.ones(4, bool)

    def inputs():  # the step's clips and stds, as tensors
        return [tf.constant(v, tf.float64) for v in dp.record_step()]

    @tf.function
    def step(x, y, mask, clips, stds, normals):
        return dp.graph_step(x, y, mask, clips, stds, normals)[0]

    releases = [step(x, y, mask, *inputs(), dp.host_normals())[0].numpy() for _ in range(2)]
    assert not np.allclose(releases[0], releases[1])

    @tf.function
    def drawn_inside(x, y, mask, clips, stds):
        return dp.graph_step(x, y, mask, clips, stds, dp.host_normals())[0]

    @tf.function
    def constant(x, y, mask, clips, stds):
        return dp.graph_step(x, y, mask, clips, stds, tf.zeros([dp.noise_size], tf.float64))[0]

    with pytest.raises(RuntimeError, match="inside a tf.function draws once"):
        drawn_inside(x, y, mask, *inputs())
    with pytest.raises(ValueError, match="a constant of the traced function"):
        constant(x, y, mask, *inputs())


def mlp(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), L.Dense(5, name="d1"), L.Dense(3, name="d2")])


def records(n=40, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 4)).astype("float32"), rng.integers(0, 3, n).astype("int32")


@pytest.mark.parametrize("store", ["cache", "snapshot", "cache_then_repeat"])
def test_fit_refuses_stored_samples_and_repeat_draws_fresh_ones(tmp_path, store):
    """A cached dataset replays its samples each pass, which the ledger would price as fresh
    Poisson samples; .repeat() on poisson_dataset runs its generator again (new samples)."""
    x, y = records()
    private = make_private(mlp(), n=40, q=0.1, seed=0)
    private.compile(optimizer="sgd", loss=CE)
    agg, drawn = private.aggregator, []
    sample = agg.sampler.sample
    agg.sampler.sample = lambda: drawn.append(1) or sample()
    private.fit(poisson_dataset(x, y, sampler=agg.sampler, steps=2).repeat(2), verbose=0)
    assert len(drawn) == 4 and agg.ledger.steps() == [dpcore.Step(0.1, 1.0, 4)]
    source = poisson_dataset(x, y, sampler=agg.sampler, steps=2)
    dataset = {"cache": lambda: source.cache(),
               "snapshot": lambda: source.snapshot(str(tmp_path / "snap")),
               "cache_then_repeat": lambda: source.cache().map(lambda *b: b).repeat(2)}[store]()
    with pytest.raises(ValueError, match=r"replays them.*Cache the arrays, not the samples"):
        private.fit(dataset, epochs=2, verbose=0)
    assert agg.ledger.steps() == [dpcore.Step(0.1, 1.0, 4)]


def test_weights_save_load_and_checkpoint_but_not_the_whole_private_model(tmp_path):
    x, y = records()
    private = make_private(mlp(), n=40, q=0.1, seed=0)
    private.compile(optimizer=keras.optimizers.SGD(0.5), loss=CE)
    checkpoint = keras.callbacks.ModelCheckpoint(tmp_path / "ck.weights.h5",
                                                 save_weights_only=True)
    private.fit(x, y, epochs=1, steps_per_epoch=2, verbose=0, callbacks=[checkpoint])
    trained = [v.numpy() for v in private.model.weights]
    private.save_weights(tmp_path / "p.weights.h5")
    for path in ("ck.weights.h5", "p.weights.h5"):
        other = make_private(mlp(1), n=40, q=0.1)
        other.load_weights(tmp_path / path)
        for a, b in zip(trained, other.model.weights):
            np.testing.assert_array_equal(a, b.numpy())
    with pytest.raises(NotImplementedError, match=r"Save private\.model.*ledger file"):
        private.save(tmp_path / "p.keras")


def test_several_losses_or_targets_are_refused():
    """One loss per example is clipped: a dict or list of losses (several outputs) or of
    targets is refused with a message, not an error deep in Keras or numpy."""
    x, y = records()
    private = make_private(mlp(), n=40, q=0.1, seed=0)
    for loss in ({"d2": CE}, [CE, "mse"]):
        with pytest.raises(ValueError, match="one loss of the model's output.*combine"):
            private.compile(optimizer="sgd", loss=loss)
    private.compile(optimizer="sgd", loss=CE)
    for targets in ({"d2": y}, [y, y]):
        with pytest.raises(ValueError, match="y must be one array.*combine"):
            private.fit(x, targets, verbose=0)
        with pytest.raises(ValueError, match="y must be one array"):
            poisson_dataset(x, targets, q=0.1, steps=1)
    mask = np.ones(40, bool)
    nested = tf.data.Dataset.from_tensor_slices((x, (y, y), mask)).batch(4)
    with pytest.raises(ValueError, match="targets y must be one tensor.*combine"):
        private.fit(nested, verbose=0)
    assert len(private.aggregator.ledger.events) == 0


class Penalty(L.Layer):
    def call(self, h, training=None):
        if training:
            self.add_loss(keras.ops.mean(h ** 2))
        return h


def test_added_losses_are_refused_before_anything_is_recorded():
    x, y = records()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), L.Dense(5), Penalty(name="pen"), L.Dense(3)])
    private = make_private(model, n=40, q=0.1, seed=0)
    private.compile(optimizer="sgd", loss=CE)
    before = [v.numpy() for v in model.weights]
    with pytest.raises(ValueError, match=r"\['pen'\].*add_loss.*weight_decay"):
        private.fit(x, y, verbose=0)
    with pytest.raises(ValueError, match=r"\['pen'\].*add_loss"):
        private.train_on_batch(x[:6], y[:6])
    assert len(private.aggregator.ledger.events) == 0
    for a, b in zip(before, model.weights):
        np.testing.assert_array_equal(a, b.numpy())


@pytest.mark.parametrize("frozen_at_make_private", [False, True])
def test_a_trainable_set_changed_since_make_private_is_refused(frozen_at_make_private):
    x, y = records()
    model = mlp()
    model.get_layer("d1").trainable = not frozen_at_make_private
    private = make_private(model, n=40, q=0.1, seed=0)
    model.get_layer("d1").trainable = frozen_at_make_private
    private.compile(optimizer="sgd", loss=CE)
    changed = "now trainable" if frozen_at_make_private else "no longer trainable"
    with pytest.raises(ValueError, match=rf"changed since make_private.*{changed}: "
                                         rf"\['\S*d1/bias', '\S*d1/kernel'\].*make_private again"):
        private.fit(x, y, verbose=0)
    assert len(private.aggregator.ledger.events) == 0


@pytest.mark.parametrize("seeded", ["seed", "sampler"])
def test_a_resumed_fit_refuses_a_dataset_seeded_apart_from_the_aggregator(tmp_path, seeded):
    """poisson_dataset(seed=7), or poisson_dataset(sampler=PoissonSampler(n, q, seed=7)),
    drew, in the resumed session, the very samples of the first; the ledger priced the
    repeats as fresh Poisson samples."""
    n, q, path = 32, 0.25, tmp_path / "run.jsonl"
    x, y = np.arange(n, dtype="float32")[:, None], np.zeros((n, 1), "float32")
    for session in range(2):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((1,)), L.Dense(1)])
        private = make_private(model, n=n, q=q, noise_multiplier=1.0, ledger=path,
                               check_independence=False)
        private.compile(optimizer="sgd", loss="mse")
        data = (poisson_dataset(x, y, q=q, seed=7, steps=3) if seeded == "seed" else
                poisson_dataset(x, y, sampler=dpcore.PoissonSampler(n, q, seed=7), steps=3))
        if session == 0:
            private.fit(data, epochs=1, verbose=0)
        else:
            with pytest.raises(ValueError, match=r"poisson_dataset\(seed=...\), or a seeded"):
                private.fit(data, epochs=1, verbose=0)
            private.fit(poisson_dataset(x, y, sampler=private.aggregator.sampler, steps=3),
                        epochs=1, verbose=0)
        private.aggregator.ledger.close()
    assert dpcore.read_ledger(path).samplings == 6
    with pytest.raises(ValueError, match="give seed or sampler, not both"):  # seed was ignored
        poisson_dataset(x, y, sampler=dpcore.PoissonSampler(n, q), seed=7, steps=3)
