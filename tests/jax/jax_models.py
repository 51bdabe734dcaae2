"""Small models for the JAX backend tests: plain pytrees of parameters and per-example losses
``loss(params, batch) -> (B,)`` covering dense, convolution, embedding, attention, layer norm,
a weight used twice, and a Flax module."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dpcore_jax.backend import one_example_loss
from dpcore_jax.names import named_leaves


def xent(logits, labels):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1)[:, 0]


def logistic_params(rng, d=5):
    return {"w": rng.normal(size=(d,)).astype(np.float32), "b": np.float32(0.3)}


def logistic_loss(params, batch):
    x, y = batch
    z = x @ params["w"] + params["b"]
    return jnp.logaddexp(0.0, z) - y * z


def logistic_oracle(params, x, y):
    """Per-example gradients in float64 NumPy: d/dw = (sigmoid(z) - y) x, d/db = sigmoid(z) - y."""
    w, b = np.float64(params["w"]), np.float64(params["b"])
    z = x.astype(np.float64) @ w + b
    r = 1.0 / (1.0 + np.exp(-z)) - y
    return {"w": r[:, None] * x, "b": r}


def mlp_params(rng, sizes=(6, 8, 8, 3)):
    return {f"l{i}": {"w": (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32),
                      "b": (0.1 * rng.normal(size=(b,))).astype(np.float32)}
            for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))}


def mlp_loss(params, batch):
    x, y = batch
    for i in range(len(params)):
        layer = params[f"l{i}"]
        x = x @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            x = jnp.tanh(x)
    return xent(x, y)


def cnn_params(rng):
    return {"conv": {"w": (0.3 * rng.normal(size=(3, 3, 1, 4))).astype(np.float32),
                     "b": np.zeros(4, np.float32)},
            "fc": {"w": (0.2 * rng.normal(size=(16, 3))).astype(np.float32),
                   "b": np.zeros(3, np.float32)}}


def cnn_loss(params, batch):
    x, y = batch
    h = lax.conv_general_dilated(x, params["conv"]["w"], (1, 1), "VALID",
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    h = jax.nn.relu(h + params["conv"]["b"])
    h = lax.reduce_window(h, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    return xent(h.reshape(h.shape[0], -1) @ params["fc"]["w"] + params["fc"]["b"], y)


def transformer_params(rng, vocab=11, d=8, classes=3):
    def dense(a, b):
        return (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32)
    return {"embed": (0.5 * rng.normal(size=(vocab, d))).astype(np.float32),
            "attn": {"qkv": dense(d, 3 * d), "out": dense(d, d)},
            "norm": {"scale": np.ones(d, np.float32), "bias": np.zeros(d, np.float32)},
            "head": {"w": dense(d, classes), "b": np.zeros(classes, np.float32)}}


def transformer_loss(params, batch):
    tokens, y = batch
    h = params["embed"][tokens]                                  # (B, T, d)
    q, k, v = jnp.split(h @ params["attn"]["qkv"], 3, axis=-1)
    a = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(h.shape[-1]), axis=-1)
    h = h + jnp.einsum("bts,bsd->btd", a, v) @ params["attn"]["out"]
    mean = h.mean(-1, keepdims=True)
    h = (h - mean) * lax.rsqrt(((h - mean) ** 2).mean(-1, keepdims=True) + 1e-5)
    h = h * params["norm"]["scale"] + params["norm"]["bias"]
    return xent(h.mean(1) @ params["head"]["w"] + params["head"]["b"], y)


def einsum_params(rng):
    """Dense weights in every layout a ``dot_general`` can give them (see einsum_loss)."""
    def w(*shape):
        return (rng.normal(size=shape) / np.sqrt(shape[0])).astype(np.float32)
    return {"lhs": w(6, 4), "heads": w(6, 2, 3), "merge": w(2, 3, 5), "transposed": w(3, 5)}


def einsum_loss(params, batch):
    """W as the left operand, with two free dimensions, with two contracted dimensions, and
    contracted on its last dimension, over a sequence of T = 4 positions."""
    x, y = batch                                                          # (B, T, 4)
    h = jnp.tanh(jnp.einsum("fc,btc->btf", params["lhs"], x))            # (B, T, 6)
    h = jnp.tanh(jnp.einsum("btc,chk->bthk", h, params["heads"]))        # (B, T, 2, 3)
    h = jnp.tanh(jnp.einsum("bthk,hkf->btf", h, params["merge"]))        # (B, T, 5)
    return xent(jnp.einsum("btf,cf->bc", h, params["transposed"]), y)


def tied_params(rng, d=4):
    return {"w": (rng.normal(size=(d, d)) / 2).astype(np.float32), "v": rng.normal(size=(d,)).astype(np.float32)}


def tied_loss(params, batch):
    """``w`` is used twice (and ``v`` once): the gradient of ``w`` is a sum of two terms."""
    x, y = batch
    h = jnp.tanh(x @ params["w"])
    return (jnp.tanh(h @ params["w"]) @ params["v"] - y) ** 2


def flax_model_and_params(rng):
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.tanh(nn.Dense(8)(x))
            x = nn.LayerNorm()(x)
            return nn.Dense(3)(x)

    net = Net()
    params = net.init(jax.random.key(0), jnp.asarray(rng.normal(size=(1, 6)), jnp.float32))

    def loss(params, batch):
        x, y = batch
        return xent(net.apply(params, x), y)

    return loss, params


def data(rng, kind, batch):
    """A batch for model ``kind``: (inputs, labels)."""
    if kind == "logistic":
        return (rng.normal(size=(batch, 5)).astype(np.float32),
                rng.integers(0, 2, size=batch).astype(np.float32))
    if kind in ("mlp", "flax"):
        return rng.normal(size=(batch, 6)).astype(np.float32), rng.integers(0, 3, size=batch)
    if kind == "cnn":
        return rng.normal(size=(batch, 6, 6, 1)).astype(np.float32), rng.integers(0, 3, size=batch)
    if kind == "transformer":
        return rng.integers(0, 11, size=(batch, 5)), rng.integers(0, 3, size=batch)
    if kind == "einsum":
        return rng.normal(size=(batch, 4, 4)).astype(np.float32), rng.integers(0, 3, size=batch)
    if kind == "tied":
        return rng.normal(size=(batch, 4)).astype(np.float32), rng.normal(size=batch).astype(np.float32)
    raise ValueError(kind)


def model(rng, kind):
    """(loss_fn, params) of model ``kind``."""
    if kind == "flax":
        return flax_model_and_params(rng)
    table = {"logistic": (logistic_loss, logistic_params), "mlp": (mlp_loss, mlp_params),
             "cnn": (cnn_loss, cnn_params), "transformer": (transformer_loss, transformer_params),
             "einsum": (einsum_loss, einsum_params), "tied": (tied_loss, tied_params)}
    loss, make = table[kind]
    return loss, jax.tree_util.tree_map(jnp.asarray, make(rng))


KINDS = ("logistic", "mlp", "cnn", "transformer", "einsum", "tied", "flax")


def float64_oracle(loss_fn, params, batch):
    """Per-example gradients one example at a time, in float64 (x64 enabled only here)."""
    with jax.enable_x64(True):
        p64 = jax.tree_util.tree_map(lambda a: jnp.asarray(np.asarray(a, np.float64)), params)
        grad = jax.jit(jax.grad(one_example_loss(loss_fn)))
        size = len(jax.tree_util.tree_leaves(batch)[0])
        rows = []
        for i in range(size):
            example = jax.tree_util.tree_map(lambda a: np.asarray(a)[i], batch)
            example = jax.tree_util.tree_map(
                lambda a: a.astype(np.float64) if np.issubdtype(a.dtype, np.floating) else a, example)
            rows.append({k: np.asarray(v) for k, v in named_leaves(grad(p64, example)).items()})
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}
