"""The three benchmark workloads in Keras 3, the same models as ``torch_models.py``:

(a) MNIST CNN: conv 1->10 5x5, max-pool 2, conv 10->20 5x5, max-pool 2, fc 320->50, fc 50->10
    (ReLU), batch 256 of 28x28 random images;
(b) covertype MLP 54-100-100-7 with tanh, batch 512;
(c) transformer encoder: token embedding 10,000 x 128 and learned positions (an Embedding of
    the position ids), 2 pre-norm blocks (4 heads, feed-forward 512 with GELU, attention over
    Dense projections), final LayerNorm, mean pooling, 2 classes; sequence 64, batch 32.
"""

from __future__ import annotations

import keras
import numpy as np
from keras import layers, ops


class PositionIds(layers.Layer):
    """(B, T) token ids -> (B, T) position ids 0..T-1 (no weights)."""

    def call(self, ids):
        return ops.broadcast_to(ops.arange(ops.shape(ids)[1])[None, :], ops.shape(ids))


class Attention(layers.Layer):
    """Scaled dot-product self-attention of packed (B, T, 3 d) queries, keys and values."""

    def __init__(self, heads: int, **kwargs):
        super().__init__(**kwargs)
        self.heads = heads

    def call(self, qkv):
        b, t, d = ops.shape(qkv)[0], qkv.shape[1], qkv.shape[2] // 3
        q, k, v = ops.split(ops.reshape(qkv, (b, t, 3, self.heads, d // self.heads)), 3, axis=2)
        out = ops.dot_product_attention(q[:, :, 0], k[:, :, 0], v[:, :, 0])
        return ops.reshape(out, (b, t, d))


def mnist_cnn() -> keras.Model:
    return keras.Sequential([
        keras.Input((28, 28, 1)), layers.Conv2D(10, 5, activation="relu"), layers.MaxPooling2D(),
        layers.Conv2D(20, 5, activation="relu"), layers.MaxPooling2D(), layers.Flatten(),
        layers.Dense(50, activation="relu"), layers.Dense(10)], name="mnist_cnn")


def covertype_mlp() -> keras.Model:
    return keras.Sequential([
        keras.Input((54,)), layers.Dense(100, activation="tanh"),
        layers.Dense(100, activation="tanh"), layers.Dense(7)], name="covertype_mlp")


def encoder(vocab=10_000, d=128, blocks=2, heads=4, ff=512, seq=64, classes=2) -> keras.Model:
    ids = keras.Input((seq,), dtype="int32")
    h = layers.Embedding(vocab, d)(ids) + layers.Embedding(seq, d)(PositionIds()(ids))
    for _ in range(blocks):
        a = Attention(heads)(layers.Dense(3 * d)(layers.LayerNormalization(epsilon=1e-5)(h)))
        h = h + layers.Dense(d)(a)
        f = layers.Dense(ff, activation="gelu")(layers.LayerNormalization(epsilon=1e-5)(h))
        h = h + layers.Dense(d)(f)
    h = ops.mean(layers.LayerNormalization(epsilon=1e-5)(h), axis=1)
    return keras.Model(ids, layers.Dense(classes)(h), name="encoder")


def workload(name: str, seed: int = 0):
    """(model, inputs, targets) of one of "cnn", "mlp", "transformer"."""
    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    if name == "cnn":
        return (mnist_cnn(), rng.normal(size=(256, 28, 28, 1)).astype("float32"),
                rng.integers(0, 10, 256).astype("int32"))
    if name == "mlp":
        return (covertype_mlp(), rng.normal(size=(512, 54)).astype("float32"),
                rng.integers(0, 7, 512).astype("int32"))
    if name == "transformer":
        return (encoder(), rng.integers(0, 10_000, (32, 64)).astype("int32"),
                rng.integers(0, 2, 32).astype("int32"))
    raise ValueError(f"workload must be cnn, mlp or transformer, got {name!r}")
