"""The Gaussian sum query as an optax ``GradientTransformation``.

:func:`private_aggregate` maps the *clipped sums* of a step (the
:class:`~dpcore_jax.clipping.ClippedSums` of :func:`~dpcore_jax.clipping.clipped_sums`, whose
count of records with a non-finite norm makes the release fail under
``on_nonfinite="raise"``) to the private average

    (sums_j + N(0, (alpha_j sigma~_g)^2 I)) / (q n),

drawing the noise from a key carried in its state (split off the aggregator's key at
``init``, which must run outside ``jit``). The step's sum-query events are written from inside
the compiled program by an ordered ``io_callback`` whose (zero) result is added to the
output, so the released average cannot exist before its events are in the ledger.

With gradient accumulation a logical batch (one Poisson sample, one sampling event) is
processed in k parts: :func:`private_optimizer` *adds* the k parts' clipped sums and, under a
``lax.cond``, adds the noise, writes the events and runs the wrapped optimizer only on the
k-th call, so all three happen once per logical batch. (``optax.MultiSteps`` would not do:
it evaluates the wrapped update on every call, which would write the events k times.)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import io_callback

from dpcore import _validation as check
from dpcore.aggregation import NonFiniteNormError

from .backend import refuse_tracers
from .clipping import ClippedSums, noisy_mean
from .grad import check_aggregator


class PrivateAggregateState(NamedTuple):
    key: jax.Array


class PrivateOptimizerState(NamedTuple):
    key: jax.Array
    sums: object          # clipped sums of the logical batch so far
    count: jax.Array      # parts seen so far
    nonfinite: jax.Array  # records with a non-finite norm in them
    inner: object         # the wrapped optimizer's state


def _clipped(updates, aggregator):
    """``(sums, nonfinite)`` from what the caller passed: the :class:`ClippedSums` of
    :func:`dpcore_jax.clipped_sums`, or (under ``on_nonfinite="drop"`` only) bare sums."""
    if isinstance(updates, ClippedSums):
        return updates.sums, jnp.asarray(updates.nonfinite, jnp.int32)
    if aggregator.on_nonfinite == "raise":
        raise TypeError(
            "the aggregator's on_nonfinite='raise' needs the count of records with a "
            "non-finite norm: pass the ClippedSums that clipped_sums returns, whole "
            "(opt.update(sums_fn(params, batch, mask), state, params)), or create the "
            "aggregator with on_nonfinite='drop'")
    return updates, jnp.zeros((), jnp.int32)


def _release_fn(aggregator, parts: int = 1):
    """``(sums, nonfinite, key) -> (key, private mean)``, writing the sum-query events from
    the compiled program before the mean can exist. Under ``on_nonfinite="raise"`` a
    release with ``nonfinite`` > 0 fails instead. A release that adds the clipped sums of
    ``parts`` > 1 calls must find exactly one step begun since the last release: with two,
    it would sum two samples (a record in both counts twice) under one step's events."""
    check_aggregator(aggregator)
    mechanism = aggregator.mechanism
    expected_size = aggregator.expected_size

    def record(nonfinite):
        if aggregator.on_nonfinite == "raise" and int(nonfinite):
            raise NonFiniteNormError(
                f"{int(nonfinite)} record(s) of this sample have a NaN or infinite gradient "
                f"norm; nothing was released. Fix the model or loss, or create the aggregator "
                f"with on_nonfinite='drop' to give such records weight 0")
        begun = aggregator.steps_since_release
        if parts > 1 and begun != 1:
            raise RuntimeError(
                f"this release adds the clipped sums of accumulation_steps={parts} calls, but "
                f"{begun} steps (Poisson samples) were begun since the last release: the "
                f"calls must be the parts of one sample. Give PoissonBatches splits="
                f"{parts}, and run every part of each sample; nothing was released")
        aggregator.record_release()
        return np.zeros((), np.float32)

    def release(sums, nonfinite, key):
        key, mean = noisy_mean(sums, mechanism, key, expected_size)
        written = io_callback(record, jax.ShapeDtypeStruct((), jnp.float32), nonfinite,
                              ordered=True)
        return key, jax.tree_util.tree_map(lambda x: x + written.astype(x.dtype), mean)

    return release


def _split_key(aggregator):
    """A key for the optimizer state, split off the aggregator's on the host. A traced
    ``init`` (inside ``jax.jit``) would split once, at tracing, and give every state its
    program makes the same key: refused."""
    rng, key = jax.random.split(aggregator.rng)
    refuse_tracers("the private optimizer's init", rng,
                   advice="Call init outside jit; its state can then enter jitted steps")
    aggregator.rng = rng
    return key


def private_aggregate(aggregator) -> optax.GradientTransformation:
    """Noise and division by q n of clipped sums, with the ledger written in the program."""
    release = _release_fn(aggregator)

    def init(params):
        del params
        return PrivateAggregateState(_split_key(aggregator))

    def update(updates, state, params=None):
        del params
        key, mean = release(*_clipped(updates, aggregator), state.key)
        return mean, PrivateAggregateState(key)

    return optax.GradientTransformation(init, update)


def private_optimizer(optimizer: optax.GradientTransformation, aggregator, *,
                      accumulation_steps: int = 1) -> optax.GradientTransformation:
    """``optimizer`` applied to the private average of clipped sums. With
    ``accumulation_steps=k`` the clipped sums of k consecutive calls (the parts of one
    logical batch) are added; the k-th call adds the noise, writes the events and runs
    ``optimizer``, the others return zero updates and leave ``optimizer``'s state alone."""
    k = check.count("accumulation_steps", accumulation_steps, minimum=1)
    if k == 1:
        return optax.chain(private_aggregate(aggregator), optimizer)
    release = _release_fn(aggregator, parts=k)

    def init(params):
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        none = jnp.zeros((), jnp.int32)
        return PrivateOptimizerState(_split_key(aggregator), zeros, none, none,
                                     optimizer.init(params))

    def update(updates, state, params=None):
        part, part_nonfinite = _clipped(updates, aggregator)
        sums = jax.tree_util.tree_map(jnp.add, state.sums, part)
        count, nonfinite = state.count + 1, state.nonfinite + part_nonfinite

        def emit():
            key, mean = release(sums, nonfinite, state.key)
            out, inner = optimizer.update(mean, state.inner, params)
            zeros = jax.tree_util.tree_map(jnp.zeros_like, sums)
            none = jnp.zeros((), jnp.int32)
            return out, PrivateOptimizerState(key, zeros, none, none, inner)

        def hold():
            out = jax.tree_util.tree_map(jnp.zeros_like, part)
            return out, PrivateOptimizerState(state.key, sums, count, nonfinite, state.inner)

        return jax.lax.cond(count == k, emit, hold)

    return optax.GradientTransformation(init, update)
