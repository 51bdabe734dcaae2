"""The TensorFlow implementation of the dpcore backend contract (DESIGN.md section 4).

* Arrays are ``tf.Tensor``; :func:`namespace` is the Array-API-flavoured namespace of
  :mod:`.namespace` (array-api-compat has none for TensorFlow).
* Noise comes from a ``tf.random.Generator`` (Philox): seeded for tests, otherwise its whole
  state (128-bit counter, 64-bit key) is read from ``os.urandom``.
* Per-example gradients are vectorized (:mod:`.vectorized`) inside a ``tf.function``.
* :meth:`TensorFlowBackend.private_gradient` runs per-example gradients, the clip factors and
  the clipped sums in one compiled function (the kernels of :mod:`.kernels`), then writes the
  step's sum queries to the ledger, adds the noise and divides by q n
  (:meth:`dpcore.PrivateAggregator.release_sums`).

Keras models have faster paths (ghost norms and book-keeping): see :mod:`.keras_model` and
:mod:`.step`.
"""

from __future__ import annotations

import inspect
import os
from collections import OrderedDict
from typing import Callable, Mapping

import numpy as np
import tensorflow as tf

from dpcore.aggregation import NonFiniteNormError, check_mask_values, clips_of
from dpcore.backend import GHOST_NORMS, JIT, PER_EXAMPLE_GRADS, Backend

from . import vectorized
from .kernels import GroupClipper, refuse_16_bit
from .namespace import namespace


def new_generator(seed: int | None = None) -> tf.random.Generator:
    """A Philox generator whose whole state (counter and key) comes from ``seed`` through
    numpy's ``SeedSequence``, or from ``os.urandom``. (``Generator.from_seed(s)`` makes s the
    counter under a key of 0: seeds s and s + 1 drew one stream, shifted by 4 values.)"""
    if seed is not None:
        state = np.random.SeedSequence(int(seed)).generate_state(3, np.uint64).view(np.int64)
    else:
        state = np.frombuffer(os.urandom(24), dtype=np.int64).copy()
    return tf.random.Generator.from_state(state, alg="philox")


class TensorFlowBackend(Backend):
    """dpcore backend for TensorFlow tensors. ``jit_compile`` compiles the per-example
    gradients of :meth:`per_example_grads` and :meth:`private_gradient` with XLA."""

    name = "tensorflow"
    version = tf.__version__
    capabilities = frozenset({PER_EXAMPLE_GRADS, GHOST_NORMS, JIT})
    KEPT_FUNCTIONS = 64

    def __init__(self, *, jit_compile: bool = False):
        self.jit_compile = bool(jit_compile)
        self._compiled: OrderedDict = OrderedDict()  # (loss_fn, key) -> tf.function

    def namespace(self):
        return namespace

    def asarray(self, x, dtype=None):
        return tf.convert_to_tensor(np.asarray(x), dtype=dtype)

    def is_traced(self, x) -> bool:
        return tf.is_tensor(x) and tf.is_symbolic_tensor(x)

    def to_numpy(self, x):
        if isinstance(x, (tf.Tensor, tf.Variable)):
            return np.array(x.numpy(), copy=True)
        return np.array(x, copy=True)

    def rng(self, seed=None):
        return new_generator(seed)

    def standard_normal(self, rng, shape, like):
        """N(0, 1) of ``shape`` from generator ``rng``: a tensor of ``like``'s float dtype, or a
        NumPy array when ``like`` is one (the core ran that step on NumPy)."""
        if isinstance(like, np.ndarray):
            dtype = like.dtype if np.issubdtype(like.dtype, np.floating) else np.float64
            return rng, rng.normal(tuple(shape), dtype=tf.as_dtype(dtype)).numpy()
        dtype = like.dtype if like.dtype.is_floating else tf.float32
        return rng, rng.normal(tuple(shape), dtype=dtype)

    # -- per-example gradients -------------------------------------------------------------
    @staticmethod
    def _params(params: Mapping) -> tuple[list[str], list[tf.Tensor]]:
        names = list(params)
        if not names:
            raise ValueError("params is empty; expected a mapping name -> array")
        return names, [tf.convert_to_tensor(params[k]) for k in names]

    def _function(self, key, loss_fn, build: Callable):
        """``tf.function(build)``, kept per loss and ``key`` for the last ``KEPT_FUNCTIONS``
        pairs used (a loss made anew per call would otherwise keep every function and the
        model it closes over); for a bound method made anew: ``model.loss`` is a new object at
        every access, equal to the last, and the attributes it reads may have changed since
        (a traced function keeps those it was traced with)."""
        if inspect.ismethod(loss_fn):
            return tf.function(build, reduce_retracing=True, jit_compile=self.jit_compile)
        if (loss_fn, key) in self._compiled:
            self._compiled.move_to_end((loss_fn, key))
        else:
            self._compiled[loss_fn, key] = tf.function(build, reduce_retracing=True,
                                                       jit_compile=self.jit_compile)
            if len(self._compiled) > self.KEPT_FUNCTIONS:
                self._compiled.popitem(last=False)
        return self._compiled[loss_fn, key]

    def per_example_grads(self, loss_fn, params, batch) -> dict:
        names, values = self._params(params)
        batch = tf.nest.map_structure(tf.convert_to_tensor, batch)
        if vectorized.batch_size(batch) == 0:
            return {k: tf.zeros((0, *v.shape), v.dtype) for k, v in zip(names, values)}
        fn = self._function(("grads", tuple(names)), loss_fn,
                            lambda v, b: vectorized.per_example_grads(loss_fn, names, v, b))
        return dict(zip(names, fn(values, batch)))

    def per_example_sq_norms(self, loss_fn, params, batch):
        grads = self.per_example_grads(loss_fn, params, batch)
        return vectorized.sq_norms(list(grads.values()))

    def private_gradient(self, loss_fn, params, batch, aggregator, *, mask=None) -> dict:
        """Clipped sums in one compiled function, then ledger, noise and division by q n on
        the host through ``aggregator.release_sums`` (sum-query events written first)."""
        names, values = self._params(params)
        aggregator.mechanism.check_leaves(names)
        refuse_16_bit(names, values)
        batch = tf.nest.map_structure(tf.convert_to_tensor, batch)
        size = vectorized.batch_size(batch)
        mechanism = aggregator.mechanism
        if size == 0:  # no records: zero sums, and (0, G) factors (adaptive counts of 0)
            factors = np.zeros((0, len(mechanism.groups)), values[0].dtype.as_numpy_dtype)
            return aggregator.release_sums({k: tf.zeros_like(v) for k, v in zip(names, values)},
                                           factors=factors)
        if mask is not None:
            check_mask_values(mask)
        mask = (tf.ones([size], tf.bool) if mask is None
                else tf.cast(tf.reshape(tf.convert_to_tensor(mask), [size]), tf.bool))
        clipper = GroupClipper(mechanism, names)

        def clipped(values, batch, clips, mask):
            grads = vectorized.per_example_grads(loss_fn, names, values, batch)
            factors, bad = clipper.factors(vectorized.sq_norms(grads), clips, mask)
            weights = [clipper.leaf_factors(factors)[k] for k in names]
            return vectorized.weighted_sum(grads, weights), factors, bad

        fn = self._function(("private", tuple(names), clipper.structure), loss_fn, clipped)
        sums, factors, bad = fn(values, batch, tf.constant(clips_of(mechanism), tf.float64), mask)
        if aggregator.on_nonfinite == "raise" and bool(tf.reduce_any(bad)):
            rows = np.flatnonzero(bad.numpy()).tolist()
            raise NonFiniteNormError(
                f"records {rows[:10]}{' ...' if len(rows) > 10 else ''} have a NaN or infinite "
                f"gradient norm; fix the model or loss, or use on_nonfinite='drop' to give them "
                f"weight 0")
        return aggregator.release_sums(dict(zip(names, sums)), factors=factors.numpy(),
                                       mask=mask.numpy())
