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

from dpcore import BudgetExhaustedError
from dpcore import _validation as check
from dpcore.aggregation import NonFiniteNormError

from .backend import kept_per_loss
from .batching import Buckets, PoissonBatches, batch_shards, replicated
from .clipping import check_param_dtypes, host_mask
from .grad import _Compiled, private_mean_fn


class PrivateStep:
    """``params, opt_state = step(params, opt_state, batch, mask=None)``: one private
    gradient step of ``loss_fn`` with ``optimizer``; ``step.init(params)`` is the
    optimizer's initial state."""

    def __init__(self, loss_fn: Callable, optimizer: optax.GradientTransformation, aggregator,
                 *, chunk_size: int | None = None, method: str = "ghost"):
        self._compiled = _Compiled(aggregator)
        self._checked = False  # whether the parameters were found all floating
        self.aggregator = aggregator
        self.optimizer = optimizer
        self._step = _step_program(loss_fn, optimizer, aggregator.mechanism,
                                   aggregator.expected_size, chunk_size, method)

    def init(self, params):
        return self.optimizer.init(params)

    def check_params(self, params) -> None:
        """Refuse leaves that cannot be differentiated (PRNG keys, counters: a Flax nnx
        ``nnx.split(model)`` state) and 16-bit ones, naming them, before a step is taken
        (:func:`~dpcore_jax.clipping.check_param_dtypes`)."""
        if self._checked:
            return
        check_param_dtypes(params)
        self._checked = True

    def __call__(self, params, opt_state, batch, mask=None):
        mask = host_mask(mask)
        self.check_params(params)
        self._compiled.check()
        params, opt_state, key, nonfinite = self._step(params, opt_state, batch, mask,
                                                       self._compiled.noise(params))
        self._compiled.release(key, nonfinite)
        return params, opt_state

    def compiled_shapes(self) -> int:
        """How many programs have been compiled (one per distinct batch shape and dtype),
        also by the earlier steps of the same loss and configuration, which share them."""
        return self._step._cache_size()


@kept_per_loss
def _step_program(loss_fn: Callable, optimizer, mechanism, expected_size: float,
                  chunk_size: int | None, method: str):
    """``jit(step)``, ``step(params, opt_state, batch, mask, noise)`` (noise: a key, or the
    normals drawn from one) returning ``(params, opt_state, key, nonfinite)``; kept per loss
    and configuration, so a :func:`train` called again (an epoch at a time) or a new
    :class:`PrivateStep` reuses the shapes compiled before."""
    mean_fn = private_mean_fn(loss_fn, mechanism, expected_size, chunk_size=chunk_size,
                              method=method)

    def step(params, opt_state, batch, mask, noise):
        key, grads, nonfinite = mean_fn(params, batch, mask, noise)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, key, nonfinite

    return jax.jit(step)


def train(loss_fn: Callable, params, data, aggregator, optimizer: optax.GradientTransformation,
          *, steps: int, opt_state=None, buckets: Buckets | None = None,
          chunk_size: int | None = None, method: str = "ghost", callback: Callable | None = None,
          sharding=None):
    """Train ``params`` for ``steps`` private steps on Poisson samples of ``data`` (a pytree
    of NumPy arrays with one row per record, ``aggregator.n`` rows); returns
    ``(params, opt_state)``. ``opt_state`` continues a run (``optimizer.init(params)`` if
    None). ``callback(step, params)`` runs after every step. Every step's sampling and
    sum-query events are in ``aggregator.ledger``.

    With a privacy budget, training stops at the first step the budget cannot afford (the
    ledger holds the steps taken). A step refused for a record's NaN or infinite gradient
    (``on_nonfinite="raise"``) raises :class:`~dpcore.aggregation.NonFiniteNormError`
    carrying ``params`` and ``opt_state`` after the last step released. ``sharding`` (a
    ``NamedSharding`` of the batch's first axis) spreads each batch over its devices, with
    the parameters copied to each (:mod:`dpcore_jax.batching`)."""
    steps = check.count("steps", steps)
    if sharding is not None:
        params = jax.device_put(params, replicated(sharding))
    private_step = PrivateStep(loss_fn, optimizer, aggregator, chunk_size=chunk_size,
                               method=method)
    private_step.check_params(params)  # before a sampling event is written
    if opt_state is None:
        opt_state = private_step.init(params)
    if buckets is None and chunk_size is not None:  # every bucket splits into chunks (and shards)
        shards = 1 if sharding is None else batch_shards(sharding)
        buckets = Buckets(aggregator.expected_size, aggregator.q,
                          multiple_of=math.lcm(chunk_size, shards))
    elif chunk_size is not None and buckets.granularity % chunk_size:
        raise ValueError(f"{buckets} pads batches to sizes chunk_size={chunk_size} does not "
                         f"divide: give Buckets multiple_of={chunk_size} (or no buckets, and "
                         f"train chooses them); nothing was recorded")
    batches = PoissonBatches(data, aggregator, buckets=buckets, sharding=sharding)
    for t in range(steps):
        try:
            batch = batches.next()
        except BudgetExhaustedError:
            break  # the budget affords no more steps
        try:
            params, opt_state = private_step(params, opt_state, *batch)
        except NonFiniteNormError as error:
            error.params, error.opt_state = params, opt_state
            raise
        if t + 1 < steps:
            batches.prefetch()  # while the device computes this step
        if callback is not None:
            callback(t, params)
    return params, opt_state
