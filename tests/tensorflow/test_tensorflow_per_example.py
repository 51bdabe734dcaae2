"""Per-example gradients of every supported layer against a float64 one-example-at-a-time
oracle, in every mode (ghost norms, materialised, vectorized), and the fallback; the float32
grouped filter-gradient path of convolutions against a float32 oracle."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import cancelling  # noqa: E402
import dpcore  # noqa: E402
from dpcore_tensorflow import layer_grads as lg  # noqa: E402
from dpcore_tensorflow import layer_taps  # noqa: E402
from dpcore_tensorflow.bookkeeping import ClippedGradients, FallbackWarning  # noqa: E402
from dpcore_tensorflow.kernels import GroupClipper  # noqa: E402
from dpcore_tensorflow.layer_taps import CrossExampleLayerError  # noqa: E402

L = keras.layers
B = 5


def mse(y, out):
    return tf.reduce_mean(tf.reshape(tf.square(out - y), [tf.shape(out)[0], -1]), axis=1)


def sparse_ce(y, out):
    logits = tf.reshape(out, [tf.shape(out)[0], -1, out.shape[-1]])
    ce = tf.nn.sparse_softmax_cross_entropy_with_logits(tf.reshape(y, [tf.shape(y)[0], -1]),
                                                        logits)
    return tf.reduce_sum(ce, axis=1)


def _model(layers, input_shape, dtype="int32" if False else "float64"):
    inputs = keras.Input(input_shape, dtype=dtype)
    x = inputs
    for layer in layers:
        x = layer(x)
    return keras.Model(inputs, x)


def f64(layer_cls, *args, **kwargs):
    return layer_cls(*args, dtype="float64", **kwargs)


def cases():
    rng = np.random.default_rng(0)
    seq = rng.normal(size=(B, 6, 4))
    img = rng.normal(size=(B, 7, 6, 2))
    ids = rng.integers(0, 9, size=(B, 6)).astype("int32")
    ids[0, :3] = 2  # repeated tokens in one example
    ids[1, 4], ids[2, 0] = -1, -9  # rows 8 and 0, as Keras's take reads them
    return {
        "dense_2d": (lambda: _model([f64(L.Dense, 5, activation="tanh"), f64(L.Dense, 3)], (4,)),
                     rng.normal(size=(B, 4)), rng.normal(size=(B, 3)), mse),
        "dense_3d": (lambda: _model([f64(L.Dense, 5, activation="relu"), f64(L.Dense, 3)], (6, 4)),
                     seq, rng.normal(size=(B, 6, 3)), mse),
        "einsum_dense": (lambda: _model([
            f64(L.EinsumDense, "abc,cde->abde", output_shape=(6, 2, 3), bias_axes="de",
                activation="tanh"),
            f64(L.EinsumDense, "abde,deo->abo", output_shape=(6, 3), bias_axes="o"),
            f64(L.EinsumDense, "...o,ok->...k", output_shape=(2,), bias_axes="k")], (6, 4)),
            seq, rng.normal(size=(B, 6, 2)), mse),
        "conv2d": (lambda: _model([
            f64(L.Conv2D, 3, (3, 2), activation="tanh"),
            f64(L.Conv2D, 2, 3, strides=2, padding="same"),
            f64(L.Conv2D, 2, 2, dilation_rate=2, padding="same"),
            L.Flatten(dtype="float64"), f64(L.Dense, 3)], (7, 6, 2)),
            img, rng.normal(size=(B, 3)), mse),
        "conv1d": (lambda: _model([
            f64(L.Conv1D, 3, 3, padding="causal", dilation_rate=2, activation="tanh"),
            f64(L.Conv1D, 2, 2, strides=2), L.Flatten(dtype="float64"), f64(L.Dense, 2)], (6, 4)),
            seq, rng.normal(size=(B, 2)), mse),
        "embedding_layernorm": (lambda: _model([
            f64(L.Embedding, 9, 4), f64(L.LayerNormalization), f64(L.Dense, 5)], (6,), "int32"),
            ids, rng.integers(0, 5, size=(B, 6)), sparse_ce),
        "layernorm_rms": (lambda: _model([
            f64(L.LayerNormalization, rms_scaling=True), f64(L.Dense, 2)], (6, 4)),
            seq, rng.normal(size=(B, 6, 2)), mse),
        "layernorm_two_axes": (lambda: _model([  # normalises (6, 4) per example
            f64(L.LayerNormalization, axis=[-2, -1]), f64(L.Dense, 2)], (6, 4)),
            seq, rng.normal(size=(B, 6, 2)), mse),
    }


def oracle(model, x, y, loss_fn):
    """One example at a time: grad of loss_fn on a batch of one, float64."""
    rows = []
    for i in range(x.shape[0]):
        with tf.GradientTape() as tape:
            loss = loss_fn(tf.constant(y[i:i + 1]), model(tf.constant(x[i:i + 1]), training=True))[0]
        grads = tape.gradient(loss, model.trainable_variables)
        rows.append([np.zeros(v.shape) if g is None else tf.convert_to_tensor(g).numpy()
                     for v, g in zip(model.trainable_variables, grads)])
    return {v.path: np.stack([r[j] for r in rows]) for j, v in enumerate(model.trainable_variables)}


def _model_for(case):
    build = cases()[case][0]
    keras.utils.set_random_seed(1)
    return build()


@pytest.mark.parametrize("mode", ["auto", "ghost", "materialise", "vectorized"])
@pytest.mark.parametrize("case", list(cases()))
def test_per_example_grads_match_oracle(case, mode):
    _, x, y, loss_fn = cases()[case]
    model = _model_for(case)
    expected = oracle(model, x, y, loss_fn)
    engine = ClippedGradients(model, mode)
    assert not engine.fallback
    got = engine.per_example_grads(tf.constant(x), tf.constant(y), loss_fn)
    assert set(got) == set(expected)
    for name in expected:
        np.testing.assert_allclose(got[name].numpy(), expected[name], rtol=1e-9, atol=1e-11,
                                   err_msg=f"{case}/{mode}: {name}")


@pytest.mark.parametrize("case", ["dense_3d", "conv2d", "embedding_layernorm"])
def test_ghost_norms_equal_materialised_norms(case):
    _, x, y, loss_fn = cases()[case]
    model = _model_for(case)
    norms = {}
    for mode in ("auto", "ghost", "materialise"):
        engine = ClippedGradients(model, mode)
        objects = engine.examples_pass(tf.constant(x), tf.constant(y), loss_fn).objects
        norms[mode] = {k: o.sq_norms().numpy() for k, o in objects.items()}
    for mode in ("auto", "ghost"):
        for name in norms[mode]:
            np.testing.assert_allclose(norms[mode][name], norms["materialise"][name],
                                       rtol=1e-10, err_msg=f"{mode}: {name}")


class Scale(L.Layer):
    """A layer with no tap: its variable takes the vectorized fallback."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="ones", dtype="float64")

    def call(self, x):
        return tf.tanh(x * self.w)


def test_untapped_layer_takes_the_vectorized_fallback():
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(B, 4)), rng.normal(size=(B, 2))
    keras.utils.set_random_seed(2)
    model = _model([f64(L.Dense, 4), Scale(dtype="float64"), f64(L.Dense, 2)], (4,))
    with pytest.warns(FallbackWarning, match="scale"):
        engine = ClippedGradients(model, "auto")
    got = engine.per_example_grads(tf.constant(x), tf.constant(y), mse)
    expected = oracle(model, x, y, mse)
    for name in expected:
        np.testing.assert_allclose(got[name].numpy(), expected[name], rtol=1e-9, atol=1e-12)


class TiedLM(keras.Model):
    """An output projection tied to the embedding table, and a Dense kernel used again by an
    op outside the layer: uses of tapped variables outside their layers' calls."""

    def __init__(self):
        super().__init__()
        self.emb = f64(L.Embedding, 9, 4)
        self.mix = f64(L.Dense, 4, activation="tanh")

    def call(self, ids):
        h = self.mix(self.emb(ids))
        h = h + keras.ops.tanh(keras.ops.matmul(h, self.mix.kernel))
        return keras.ops.matmul(h, keras.ops.transpose(self.emb.embeddings))


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("mode", ["auto", "ghost", "materialise"])
def test_a_tapped_variable_used_outside_its_layer_keeps_that_use(mode, graph):
    """The taps form the layer's own use; the use outside (which before was silently lost)
    takes the vectorized fallback, with a warning, and the two add up to the oracle."""
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 9, size=(B, 6)).astype("int32")
    y = rng.integers(0, 9, size=(B, 6)).astype("int32")
    keras.utils.set_random_seed(4)
    model = TiedLM()
    model(ids[:1])
    engine = ClippedGradients(model, mode)
    grads = (tf.function(lambda x, y: engine.per_example_grads(x, y, sparse_ce)) if graph
             else lambda x, y: engine.per_example_grads(x, y, sparse_ce))
    with pytest.warns(FallbackWarning, match="used outside their layer's call"):
        got = grads(tf.constant(ids), tf.constant(y))
    expected = oracle(model, ids, y, sparse_ce)
    assert set(got) == set(expected)
    for name in expected:
        np.testing.assert_allclose(got[name].numpy(), expected[name], rtol=1e-9, atol=1e-12,
                                   err_msg=name)


class UncalledHead(keras.Model):
    """A Dense layer never called, its kernel used directly."""

    def __init__(self):
        super().__init__()
        self.body = f64(L.Dense, 4, activation="tanh")
        self.head = f64(L.Dense, 3)

    def build(self, shape):
        self.body.build(shape)
        self.head.build((None, 4))

    def call(self, x):
        return keras.ops.matmul(self.body(x), self.head.kernel)


@pytest.mark.parametrize("graph", [False, True])
def test_the_variable_of_a_layer_never_called_keeps_its_direct_use(graph):
    rng = np.random.default_rng(6)
    x, y = rng.normal(size=(B, 3)), rng.normal(size=(B, 3))
    keras.utils.set_random_seed(5)
    model = UncalledHead()
    model(x[:1])
    engine = ClippedGradients(model)
    grads = lambda x, y: engine.per_example_grads(x, y, mse)  # noqa: E731
    with pytest.warns(FallbackWarning, match="used outside their layer's call"):
        got = (tf.function(grads) if graph else grads)(tf.constant(x), tf.constant(y))
    expected = oracle(model, x, y, mse)
    for name in expected:
        np.testing.assert_allclose(got[name].numpy(), expected[name], rtol=1e-9, atol=1e-12,
                                   err_msg=name)


def test_shared_layer_sums_its_calls():
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(B, 3)), rng.normal(size=(B, 3))
    keras.utils.set_random_seed(3)
    shared = f64(L.Dense, 3, activation="tanh")
    inputs = keras.Input((3,), dtype="float64")
    model = keras.Model(inputs, shared(shared(inputs)))
    got = ClippedGradients(model, "ghost").per_example_grads(tf.constant(x), tf.constant(y), mse)
    for name, rows in oracle(model, x, y, mse).items():
        np.testing.assert_allclose(got[name].numpy(), rows, rtol=1e-9, atol=1e-12)


def test_batch_normalization_is_rejected_with_a_fix():
    model = _model([f64(L.Dense, 3), L.BatchNormalization(dtype="float64")], (4,))
    with pytest.raises(CrossExampleLayerError, match="LayerNormalization.*trainable = False"):
        ClippedGradients(model)
    model.layers[-1].trainable = False
    ClippedGradients(model)  # frozen: inference mode, per-example


def test_regularizers_are_refused_not_ignored():
    model = _model([f64(L.Dense, 3, kernel_regularizer="l2")], (4,))
    with pytest.raises(ValueError, match="kernel_regularizer.*weight_decay"):
        ClippedGradients(model)


def test_a_regularizer_of_add_weight_is_refused_not_ignored():
    """Keras 3 keeps add_weight(regularizer=...) on the variable, not the layer: its loss
    (80 here) was left out of the step without a word."""
    class Scaled(L.Layer):
        def build(self, shape):
            self.w = self.add_weight(shape=(shape[-1], 2), dtype="float64",
                                     regularizer=keras.regularizers.L2(10.0))

        def call(self, x):
            return x @ self.w

    model = _model([Scaled(dtype="float64")], (4,))
    with pytest.raises(ValueError, match=r"regularizer on its weight '\S*scaled\S*'.*"
                                         r"weight_decay"):
        ClippedGradients(model)


def _float32_convs():
    """Conv layers (strides, same and causal padding, dilation, a layer called twice) in
    float32, the dtype of the grouped filter-gradient path."""
    inputs = keras.Input((9, 8, 2))
    shared = L.Conv2D(2, 3, padding="same", activation="tanh")
    x = L.Conv2D(3, (3, 2), strides=2, padding="same", activation="tanh")(inputs)
    x = shared(shared(L.Conv2D(2, 2, dilation_rate=2, padding="same")(x)))
    x = L.Reshape((-1, 2))(x)
    x = L.Conv1D(3, 3, padding="causal", dilation_rate=2, activation="tanh")(x)
    return keras.Model(inputs, L.Dense(3)(L.Flatten()(L.Conv1D(2, 2, strides=2)(x))))


@pytest.mark.skipif(not layer_taps.grouped_filter_grads(tf.float32),
                    reason="no grouped filter-gradient op (oneDNN off)")
def test_grouped_conv_grads_and_clipped_sums_match_oracle():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(B, 9, 8, 2)).astype("float32")
    y = rng.normal(size=(B, 3)).astype("float32")
    keras.utils.set_random_seed(4)
    model = _float32_convs()
    expected = oracle(model, x, y, mse)
    engine = ClippedGradients(model, "materialise")
    objects = engine.examples_pass(tf.constant(x), tf.constant(y), mse).objects
    kernels = [v.path for v in model.trainable_variables if "conv" in v.path and "kernel" in v.path]
    assert len(kernels) == 5 and all(isinstance(objects[k], lg.ConvKernel) for k in kernels)
    for name, rows in expected.items():
        np.testing.assert_allclose(objects[name].per_example().numpy(), rows, rtol=1e-4,
                                   atol=1e-5, err_msg=name)
        np.testing.assert_allclose(objects[name].sq_norms().numpy(),
                                   np.square(rows).reshape(B, -1).sum(1), rtol=1e-4, atol=1e-6)
    # clipped sum sum_i c_i G_i, flat clip 0.3, and a masked-out row holding NaN
    names = list(expected)
    clipper = GroupClipper(dpcore.flat(names, 0.3, 1.0), names)
    norms = np.sqrt(sum(np.square(r).reshape(B, -1).sum(1) for r in expected.values()))
    factors = np.minimum(1.0, 0.3 / norms) * (np.arange(B) != 1)
    x[1, 0, 0, 0] = np.nan
    mask = tf.constant(np.arange(B) != 1)
    sums, bad, *_ = engine.clipped_sums(tf.constant(x), tf.constant(y), mse, clipper,
                                        tf.constant([0.3], tf.float64), mask)
    assert not bad.numpy().any()
    for name, rows in expected.items():
        np.testing.assert_allclose(sums[name].numpy(), np.tensordot(factors, rows, axes=1),
                                   rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("mode", ["auto", "ghost", "materialise", "vectorized"])
@pytest.mark.parametrize("case", ["dense_2d", "dense_3d", "einsum_dense", "conv2d", "conv1d",
                                  "layernorm_rms"])
def test_dropped_record_with_nonfinite_input_leaves_the_sums_finite(case, mode):
    """A record whose input holds NaN or Inf gets factor 0 (``bad``) and contributes nothing:
    the ghost book-keeping sum a^T (c g) must not turn its 0 * NaN into NaN."""
    _, x, y, loss_fn = cases()[case]
    model = _model_for(case)
    expected = oracle(model, x, y, loss_fn)
    names = list(expected)
    norms = np.sqrt(sum(np.square(r).reshape(B, -1).sum(1) for r in expected.values()))
    factors = np.minimum(1.0, 0.5 / norms) * (np.arange(B) != 1) * (np.arange(B) != 3)
    x = x.copy()
    x[1].flat[0], x[3].flat[-1] = np.nan, np.inf
    engine = ClippedGradients(model, mode)
    sums, bad, *_ = engine.clipped_sums(tf.constant(x), tf.constant(y), loss_fn,
                                        GroupClipper(dpcore.flat(names, 0.5, 1.0), names),
                                        tf.constant([0.5], tf.float64))
    np.testing.assert_array_equal(bad.numpy(), np.isin(np.arange(B), [1, 3]))
    for name, rows in expected.items():
        np.testing.assert_allclose(sums[name].numpy(), np.tensordot(factors, rows, axes=1),
                                   rtol=1e-9, atol=1e-12, err_msg=f"{case}/{mode}: {name}")


@pytest.mark.skipif(layer_taps.grouped_filter_grads(tf.float32),
                    reason="the grouped path ran in this process")
def test_grouped_conv_path_with_onednn_forced_in_a_child_process():
    """Where oneDNN is off by default (seen on an AMD EPYC), the grouped filter-gradient path
    the DP step takes on other x86 machines is tested in a child with TF_ENABLE_ONEDNN_OPTS=1."""
    import os
    import pathlib
    import subprocess
    import sys

    test = "test_grouped_conv_grads_and_clipped_sums_match_oracle"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", test],
        env={**os.environ, "TF_ENABLE_ONEDNN_OPTS": "1"}, capture_output=True, text=True,
        cwd=pathlib.Path(__file__).resolve().parents[2])
    if "1 skipped" in out.stdout:
        pytest.skip("no oneDNN in this TensorFlow build, even when asked for")
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout[-3000:]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("kind, mode", [("dense", "ghost"), ("rows", "ghost"),
                                        ("rows", "auto"), ("rows", "materialise")])
def test_float32_ghost_norms_never_fall_below_the_exact_norms(kind, mode, jit):
    """Inputs nearly equal across positions (one token) and backprops summing to nearly zero
    make the ghost identity's terms cancel. With the rounding bound of dpcore.rounding the
    float32 ghost norms, eager and under XLA, are at least the exact norms of the data's
    per-example gradients (float64 oracle); the plain sums fell below them. On ordinary
    data the bound moves them by under 1%. An embedding's norms from its rows summed per id
    ("auto", "materialise") take the same bound: its clipped sum adds them in another
    order."""
    rng = np.random.default_rng(12)
    b, p, c, f = 16, 64, 128, 256

    def norms(a, g):
        if kind == "dense":
            return lg.DenseKernel(a, g, (c, f), mode="ghost").sq_norms()
        return lg.EmbeddingTable(a, g, 9, mode=mode).sq_norms()

    run = tf.function(norms, jit_compile=True) if jit else norms
    for spread in cancelling.SPREADS:
        a, g, exact = cancelling.case(rng, kind, b, p, c, f, spread)
        got = run(tf.constant(a), tf.constant(g)).numpy().astype(np.float64)
        assert (got >= exact).all(), (spread, (got / exact).min())
        if spread == 1.0:
            assert (got <= exact * 1.01).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_ghost_norms_are_formed_in_float32(dtype):
    """A 16-bit model's Gram matrices are formed in float32: in float16 the rounding bound,
    which grows with the machine epsilon, made the norms about 20 times too large, and
    bfloat16 had no machine epsilon for NumPy."""
    rng = np.random.default_rng(14)
    a, g, _ = cancelling.case(rng, "dense", 8, 64, 128, 256, 1.0)
    a16, g16 = tf.constant(a, dtype), tf.constant(g, dtype)
    exact = cancelling.exact_sq_norms(tf.cast(a16, tf.float32).numpy(),
                                      tf.cast(g16, tf.float32).numpy())
    got = lg.DenseKernel(a16, g16, (128, 256), mode="ghost").sq_norms().numpy()
    assert (got >= exact).all() and (got <= exact * 1.01).all()


@pytest.mark.parametrize("mode", ["auto", "materialise"])
def test_long_runs_of_one_id_keep_embedding_norms_within_one_percent(mode):
    """The bound on a per-id row sum grows with the run's length, not the sequence's: with
    T = 4096 positions of 64 ids (runs of about 64), ordinary norms move by under 1% (a
    margin from the whole length made them 14% larger)."""
    rng = np.random.default_rng(16)
    ids = rng.integers(0, 64, size=(2, 4096)).astype(np.int32)
    g = rng.normal(size=(2, 4096, 256)).astype(np.float32)
    exact = cancelling.exact_rows_sq_norms(ids, g, 64)
    got = lg.EmbeddingTable(tf.constant(ids), tf.constant(g), 64, mode=mode).sq_norms().numpy()
    assert (got >= exact * (1 - 1e-6)).all() and (got <= exact * 1.01).all()
