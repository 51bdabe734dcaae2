"""A tapped layer's output rows must be the examples': positions the batch does not feed
(eager steps too), constant tables of the ids' shape, calls inside control flow, layers no
path can take per example. Sensitivity measured as ||release(D) - release(D - record)||."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import dpcore  # noqa: E402
from dpcore_tensorflow import PrivateGradients, make_private  # noqa: E402
from dpcore_tensorflow.bookkeeping import ClippedGradients, leaf_names  # noqa: E402

L, ops = keras.layers, keras.ops
T = B = 8
CLIP = 0.1


class AddPositions(L.Layer):
    """x + a learnt embedding of positions arange(T): one table shared by the examples."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.pos = L.Embedding(T, 3)

    def build(self, shape):
        self.pos.build((T,))

    def call(self, x):
        return x + self.pos(ops.arange(T))


class RelativeBias(L.Layer):
    """logits (B, T, T) + a bias looked up from a (T, T) table of relative positions, which
    has the shape of the (B, T) ids when B = T."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.rel = L.Embedding(2 * T, 1)

    def build(self, shape):
        self.rel.build((T, T))

    def call(self, logits):
        r = ops.arange(T)
        return logits + ops.squeeze(self.rel(r[:, None] - r[None, :] + T), -1)


def positions_model():
    keras.utils.set_random_seed(0)
    ids = keras.Input((T,), dtype="int32")
    h = AddPositions()(L.Embedding(10, 3)(ids))
    return keras.Model(ids, L.Dense(1)(L.Flatten()(h)))


def relative_model():
    keras.utils.set_random_seed(0)
    ids = keras.Input((T,), dtype="int32")
    h = L.Embedding(10, 4)(ids)
    logits = RelativeBias()(L.Lambda(lambda h: ops.einsum("btd,bsd->bts", h, h))(h))
    return keras.Model(ids, L.Dense(1)(L.Flatten()(logits)))


def sensitivity(model) -> float:
    """||release(D) - release(D without its last, loud record)|| * q n at q = 1, no noise:
    at most the clip when every record is clipped as one."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 10, (B, T)).astype(np.int32)
    y = np.zeros((B, 1), np.float32)
    y[-1] = 1000.0

    def release(rows):
        agg = dpcore.PrivateAggregator(dpcore.flat(leaf_names(model), CLIP, 0.0), n=B, q=1.0,
                                       backend="tensorflow", seed=0)
        step = PrivateGradients(model, "mse", agg, check_independence=False)
        grads = step(ids, y, np.arange(B) < rows)
        return np.concatenate([np.ravel(np.asarray(g)) for g in grads]) * B

    return float(np.linalg.norm(release(B) - release(B - 1)))


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("eager", [False, True])
def test_positions_the_batch_does_not_feed_are_not_clipped_as_examples(eager):
    """Eagerly only the shapes were checked: arange(T) with T = B was clipped row by row as
    if its rows were examples, and one record moved the release by 3 clips."""
    tf.config.run_functions_eagerly(eager)
    try:
        assert sensitivity(positions_model()) <= CLIP * (1 + 1e-5)
    finally:
        tf.config.run_functions_eagerly(False)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_constant_table_of_the_ids_shape_is_not_one_row_per_example():
    """A (T, T) table of relative positions passed for a constant broadcast to the (B, T)
    batch when B = T: one record moved the release by 5.7 clips."""
    assert sensitivity(relative_model()) <= CLIP * (1 + 1e-5)


class Cell(L.Layer):
    """An RNN cell with Dense sublayers: tapped layers called inside a tf.while_loop."""

    def __init__(self, units, **kw):
        super().__init__(**kw)
        self.units = self.state_size = units
        self.dx, self.dh = L.Dense(units), L.Dense(units, use_bias=False)

    def build(self, shape):
        self.dx.build(shape)
        self.dh.build((None, self.units))

    def call(self, x, states):
        h = ops.tanh(self.dx(x) + self.dh(states[0]))
        return h, [h]


@pytest.mark.parametrize("check", [True, False])
def test_a_tapped_layer_called_inside_a_while_loop_is_refused(check):
    """Its calls' backprops were out of the tape's reach: gradients 0 (or, with the
    independence check, a crash). The check's eager pass refuses it before the ledger; the
    compiled step alone, at its tracing, after the step's events (an over-count)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5, 3)), L.RNN(Cell(4)), L.Dense(2)])
    x = np.random.default_rng(0).normal(size=(8, 5, 3)).astype(np.float32)
    private = make_private(model, n=8, q=1.0, max_grad_norm=1.0, noise_multiplier=0.0,
                           seed=0, check_independence=check)
    private.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=r"'dense\w*' is called inside TensorFlow control flow"):
        private.fit(x, np.zeros((8, 2), np.float32), steps_per_epoch=1, verbose=0)
    assert private.aggregator.ledger.samplings == (0 if check else 1)


def test_a_grouped_convolution_is_refused_before_anything_is_recorded():
    """No tap takes it and pfor cannot vectorise its filter gradient: the step failed after
    its events were written."""
    model = keras.Sequential([keras.Input((6, 6, 4)), L.Conv2D(4, 3, groups=2), L.Flatten(),
                              L.Dense(2)])
    with pytest.raises(ValueError, match=r"'conv2d\w*' is a grouped convolution \(groups=2\)"):
        ClippedGradients(model)
