"""An array namespace for TensorFlow tensors, for code written against the Python Array API.

array-api-compat does not cover TensorFlow, so this module exposes ``tf.experimental.numpy``
(NumPy's API over ``tf.Tensor``, differentiable under ``tf.GradientTape``) plus the Array API
names NumPy 1 spelled differently (``astype``, ``concat``, ``permute_dims``, ``pow``, ``bool``,
``matrix_transpose``, ``linalg.vector_norm``, ...). It is enough to write per-example losses
once for every backend (``xp = backend.namespace()``); it is not a complete, strict Array API.
The core's aggregation kernels do not run on it: the TensorFlow backend runs its own
TensorFlow versions of those few steps inside ``tf.function`` (see :mod:`.kernels`).
"""

from __future__ import annotations

import types

import tensorflow as tf
import tensorflow.experimental.numpy as tnp


def _astype(x, dtype, /, *, copy=True):
    return tf.cast(x, dtype)


def _vector_norm(x, /, *, axis=None, keepdims=False, ord=2):
    if ord != 2:
        raise ValueError(f"only the L2 norm (ord=2) is provided, got ord={ord!r}")
    return tf.sqrt(tf.reduce_sum(tf.square(x), axis=axis, keepdims=keepdims))


def _matrix_transpose(x, /):
    return tf.linalg.matrix_transpose(x)


class _Namespace(types.SimpleNamespace):
    """``tf.experimental.numpy`` with Array API aliases; unknown names fall through to it."""

    def __getattr__(self, name):
        return getattr(tnp, name)


namespace = _Namespace(
    __name__="dpcore_tensorflow.namespace",
    astype=_astype,
    bool=tf.bool,
    concat=tnp.concatenate,
    permute_dims=tnp.transpose,
    pow=tnp.power,
    acos=tnp.arccos, asin=tnp.arcsin, atan=tnp.arctan, atan2=tnp.arctan2,
    acosh=tnp.arccosh, asinh=tnp.arcsinh, atanh=tnp.arctanh,
    matrix_transpose=_matrix_transpose,
    linalg=types.SimpleNamespace(vector_norm=_vector_norm, matmul=tnp.matmul),
)
