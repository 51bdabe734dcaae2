"""A private training step with an optax optimizer in one compiled program, and a loop.

The optimizer sees only the released private gradient, so any optax transformation (momentum,
Adam, schedules) is post-processing and costs no privacy. :class:`PrivateStep` compiles
clipped sums, noise, the optimizer update and ``optax.apply_updates`` into one program per
batch shape; the host then writes the step's sum-query events before returning the new
parameters (see :mod:`dpcore_jax.private_grad`). :func:`train` runs it on padded Poisson
batches until ``steps`` steps are done, drawing and padding each next sample while the
device computes the current step.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import optax

from dpcore import _validation as check

from .batching import Buckets, PoissonBatches, batch_shards, replicated
from .grad import _Compiled, private_mean_fn


class PrivateStep:
    """``params, opt_state = step(params, opt_state, batch, mask=None)``: one private
    gradient step of ``loss_fn`` with ``optimizer``; ``step.init(params)`` is the
    optimizer's initial state."""

    def __init__(self, loss_fn: Callable, optimizer: optax.GradientTransformation, aggregator,
                 *, chunk_size: int | None = None, method: str = "ghost"):
        self._compiled = _Compiled(aggregator)
        self.aggregator = aggregator
        self.optimizer = optimizer
        mean_fn = private_mean_fn(loss_fn, aggregator.mechanism, aggregator.expected_size,
                                  chunk_size=chunk_size, method=method)

        def step(params, opt_state, batch, mask, noise):  # noise: a key, or normals
            key, grads, nonfinite = mean_fn(params, batch, mask, noise)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, key, nonfinite

        self._step = jax.jit(step)

    def init(self, params):
        return self.optimizer.init(params)

    def __call__(self, params, opt_state, batch, mask=None):
        self._compiled.check()
        params, opt_state, key, nonfinite = self._step(params, opt_state, batch, mask,
                                                       self._compiled.noise(params))
        self._compiled.release(key, nonfinite)
        return params, opt_state

    def compiled_shapes(self) -> int:
        """How many programs have been compiled (one per distinct batch shape and dtype)."""
        return self._step._cache_size()


def train(loss_fn: Callable, params, data, aggregator, optimizer: optax.GradientTransformation,
          *, steps: int, buckets: Buckets | None = None, chunk_size: int | None = None,
          method: str = "ghost", callback: Callable | None = None, sharding=None):
    """Train ``params`` for ``steps`` private steps on Poisson samples of ``data`` (a pytree
    of NumPy arrays with one row per record, ``aggregator.n`` rows); returns
    ``(params, opt_state)``. ``callback(step, params)`` runs after every step. Every step's
    sampling and sum-query events are in ``aggregator.ledger``. ``sharding`` (a
    ``NamedSharding`` of the batch's first axis) spreads each batch over its devices, with
    the parameters copied to each (:mod:`dpcore_jax.batching`)."""
    steps = check.count("steps", steps)
    if sharding is not None:
        params = jax.device_put(params, replicated(sharding))
    private_step = PrivateStep(loss_fn, optimizer, aggregator, chunk_size=chunk_size,
                               method=method)
    opt_state = private_step.init(params)
    if buckets is None and chunk_size is not None:  # every bucket splits into chunks (and shards)
        shards = 1 if sharding is None else batch_shards(sharding)
        buckets = Buckets(aggregator.expected_size, aggregator.q,
                          multiple_of=math.lcm(chunk_size, shards))
    batches = PoissonBatches(data, aggregator, buckets=buckets, sharding=sharding)
    for t in range(steps):
        params, opt_state = private_step(params, opt_state, *batches.next())
        if t + 1 < steps:
            batches.prefetch()  # while the device computes this step
        if callback is not None:
            callback(t, params)
    return params, opt_state
