"""The Gaussian sum query as an optax ``GradientTransformation``.

:func:`private_aggregate` maps the *clipped sums* of a step (the
:class:`~dpcore_jax.clipping.ClippedSums` of :func:`~dpcore_jax.clipping.clipped_sums`, whose
count of records with a non-finite norm makes the release fail under
``on_nonfinite="raise"``) to the private average

    (sums_j + N(0, (alpha_j sigma~_g)^2 I)) / (q n),

drawing the noise from a key carried in its state (split off the aggregator's key at
``init``, which must run outside ``jit``), or, for a ``secure`` aggregator, from the system's
CSPRNG on the host by an ordered ``io_callback`` at every run of the compiled program (the
state's key is then None). The step's sum-query events are written from inside the compiled
program by an ordered ``io_callback`` before the noise is drawn: its result, the step's index
in the ledger, is folded into the key (the secure normals' callback comes after it), so the
released average cannot exist before its events are in the ledger, and a state restored from
a checkpoint (its key that of an earlier step) draws new noise for the ledger's new steps.

With gradient accumulation a logical batch (one Poisson sample, one sampling event) is
processed in k parts: :func:`private_optimizer` *adds* the k parts' clipped sums and, under a
``lax.cond``, adds the noise, writes the events and runs the wrapped optimizer only on the
k-th call, so all three happen once per logical batch. (``optax.MultiSteps`` around these
transformations is refused at ``init``: it runs the wrapped update on every call, which would
write the events k times, and releases the parts' mean.) Each call also reads, by another
ordered callback, the aggregator's current step: the parts held all belong to one step, and
a part of a later step while parts of an earlier one are held (``accumulation_steps`` other
than the ``splits`` of :class:`~dpcore_jax.PoissonBatches`, a sample left part-way) raises
before anything is added, except after a refused release, whose parts are then dropped.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import io_callback

from dpcore import _validation as check
from dpcore.aggregation import NonFiniteNormError

from .backend import refuse_tracers
from .clipping import ClippedSums, clipping_of, noisy_mean
from .grad import check_aggregator
from .noise import NoiseSource, secure_normals


class PrivateAggregateState(NamedTuple):
    key: jax.Array | None  # None: a secure aggregator's noise comes from the host


class PrivateOptimizerState(NamedTuple):
    key: jax.Array | None
    sums: object          # clipped sums of the parts held (of one sample)
    count: jax.Array      # parts held
    nonfinite: jax.Array  # records with a non-finite norm in them
    step: jax.Array       # the aggregator's step the parts held belong to (-1: none)
    inner: object         # the wrapped optimizer's state


def _clipped(updates, aggregator):
    """``(sums, nonfinite)`` from what the caller passed: the :class:`ClippedSums` of
    :func:`dpcore_jax.clipped_sums`, or (under ``on_nonfinite="drop"`` only) bare sums."""
    if isinstance(updates, ClippedSums):
        _check_clipping(updates.clipping, aggregator.mechanism)
        return updates.sums, jnp.asarray(updates.nonfinite, jnp.int32)
    if aggregator.on_nonfinite == "raise":
        raise TypeError(
            "the aggregator's on_nonfinite='raise' needs the count of records with a "
            "non-finite norm: pass the ClippedSums that clipped_sums returns, whole "
            "(opt.update(sums_fn(params, batch, mask), state, params)), or create the "
            "aggregator with on_nonfinite='drop'")
    return updates, jnp.zeros((), jnp.int32)


def _check_clipping(clipping, mechanism) -> None:
    """Refuse sums clipped under other groups or clips than the aggregator's, whose noise and
    ledger would not cover them (a clip passed in is the caller's to match)."""
    if clipping is None:  # a ClippedSums built by hand
        return
    ours = clipping_of(mechanism)
    if len(clipping) != len(ours) or any(
            t[:3] != o[:3] or t[3] not in (None, o[3]) for t, o in zip(clipping, ours)):
        raise ValueError(
            f"the clipped sums were made under other groups or clips than the aggregator's "
            f"mechanism, whose noise and ledger would then not cover them: sums "
            f"{[(g[0], g[3]) for g in clipping]}, aggregator {[(g[0], g[3]) for g in ours]}; "
            f"build clipped_sums with the aggregator's mechanism (aggregator.mechanism)")


class _Ledger:
    """The host side of a transformation: the release's events and, under accumulation, the
    step each part belongs to. Parts held of one step and a part of a later one would add up
    two samples (a record in both counts twice) under one step's events: refused, unless
    the held parts' release was refused (they are then dropped, as never released)."""

    def __init__(self, aggregator, parts: int):
        self.aggregator, self.parts, self.refused = aggregator, parts, set()

    def stamp(self, held, count):
        """``[current step, 1 if the parts held are dropped else 0]`` for a new part."""
        now, held, count = self.aggregator.step, int(held), int(count)
        if not self.aggregator.begun:
            raise RuntimeError("no sample to release from: begin a step first "
                               "(PoissonBatches.next(), or aggregator.sample())")
        drop = bool(count) and held != now
        if drop and held not in self.refused:
            raise RuntimeError(
                f"the optimizer holds the clipped sums of {count} part(s) of step {held}, and a "
                f"part of step {now} arrived: its release would add up two samples. Give "
                f"PoissonBatches splits={self.parts} (accumulation_steps), run every part of "
                f"each sample, or drop the parts held with dpcore_jax.drop_parts(state) (init "
                f"again would also reset the wrapped optimizer); nothing was released")
        return np.array([now, int(drop)], np.int32)

    def record(self, nonfinite, step):
        """Write the step's events (after its checks) and return the ledger's count of
        events, which no other release shares; on refusal, remember the step."""
        try:
            if self.aggregator.on_nonfinite == "raise" and int(nonfinite):
                raise NonFiniteNormError(
                    f"{int(nonfinite)} record(s) of this sample have a NaN or infinite gradient "
                    f"norm; nothing was released. Fix the model or loss, or create the "
                    f"aggregator with on_nonfinite='drop' to give such records weight 0")
            self.aggregator.record_release()
        except Exception:
            self.refused.add(int(step))
            raise
        return np.asarray(self.aggregator.ledger.event_count, np.int32)


def _release_fn(aggregator, ledger: _Ledger):
    """``(sums, nonfinite, step, key) -> (key, private mean)``, writing the sum-query events
    from the compiled program before the mean can exist; under ``on_nonfinite="raise"`` a
    release with ``nonfinite`` > 0 fails instead."""
    check_aggregator(aggregator)
    mechanism = aggregator.mechanism
    expected_size = aggregator.expected_size
    source = NoiseSource(mechanism)
    salt = None if aggregator.secure else _session_salt(aggregator)

    def host_normals(sums):
        """The step's normals from the secure generator, drawn when the program runs."""
        plan = source.plan(sums)
        shapes = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in plan]
        return list(io_callback(lambda: secure_normals(aggregator.rng, plan), shapes,
                                ordered=True))

    def release(sums, nonfinite, step, key):
        if (key is None) != aggregator.secure:  # at tracing, before anything is recorded
            raise ValueError(
                "this optimizer state holds " + (
                    "a noise key (made with an aggregator without secure=True), but a secure "
                    "aggregator draws every step's noise on the host" if key is not None else
                    "no noise key (made with a secure aggregator), which this aggregator "
                    "needs") + ": init the state again with this aggregator")
        # the events first; the ledger's count of events after them keys the noise, so a
        # state restored from a checkpoint (its key an earlier step's), or one state updated
        # twice in a step, never draws a noise twice, and the session's salt, so two
        # sessions resuming one state draw apart
        index = io_callback(ledger.record, jax.ShapeDtypeStruct((), jnp.int32), nonfinite,
                            step, ordered=True)
        noise = (host_normals(sums) if key is None
                 else jax.random.fold_in(jax.random.fold_in(key, salt), index))
        return noisy_mean(sums, mechanism, noise, expected_size)

    return release


def _refuse_manual_axes(what: str) -> None:
    """Raise when traced under ``pmap`` or ``shard_map`` (the abstract mesh has manual axes):
    every device would run the program's host callbacks, so each would write the step's
    events, and a secure aggregator's each draw its own normals (the replicas would drift
    apart). JAX versions without ``jax.sharding.get_abstract_mesh`` are not checked."""
    mesh = getattr(jax.sharding, "get_abstract_mesh", lambda: None)()
    axes = tuple(getattr(mesh, "manual_axes", ()))
    if axes:
        raise RuntimeError(
            f"{what} is traced under pmap or shard_map (manual mesh axes {axes}): every "
            f"device would write the step's events and draw noise. Compute the clipped sums "
            f"per device, add them up with jax.lax.psum (the whole ClippedSums, its count "
            f"included) and call update outside pmap/shard_map (inside your jax.jit), or let "
            f"dpcore_jax.train / PoissonBatches(..., sharding=) spread the batch over the "
            f"devices")


def _refuse_multi_steps(what: str) -> None:
    """Raise when called from ``optax.MultiSteps.init`` (a wrapper of ``what``)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is optax.MultiSteps.init.__code__:
            raise TypeError(
                f"{what} is wrapped in optax.MultiSteps, which runs its update on every "
                f"mini-step (each would write the step's sum-query events) and hands it the "
                f"parts' mean, 1/k of the sample's clipped sum. Drop MultiSteps and pass "
                f"accumulation_steps=k to dpcore_jax.private_optimizer (with "
                f"PoissonBatches(..., splits=k))")
        frame = frame.f_back


def _session_salt(aggregator) -> int:
    """A number split off the aggregator's key when a transformation is made, folded into
    every step's key: the noise of a state's key is then the session's, as the aggregator's
    own is (a resumed aggregator's key is not the interrupted one's). With the state's key
    and the ledger's index alone, two sessions resuming one checkpoint (unseeded: a crash
    and its restart, a sweep's branches) drew the same noise at the same step, which the
    difference of their releases cancels."""
    rng, key = jax.random.split(aggregator.rng)
    refuse_tracers("the private optimizer's construction", rng,
                   advice="Make it outside jit")
    aggregator.rng = rng
    return int(jax.random.randint(key, (), 0, 2 ** 31 - 1))


def _split_key(aggregator):
    """A key for the optimizer state, split off the aggregator's on the host (None for a
    secure aggregator, whose noise is drawn on the host at every step). A traced ``init``
    (inside ``jax.jit``) would split once, at tracing, and give every state its program makes
    the same key: refused."""
    if aggregator.secure:
        return None
    rng, key = jax.random.split(aggregator.rng)
    refuse_tracers("the private optimizer's init", rng,
                   advice="Call init outside jit; its state can then enter jitted steps")
    aggregator.rng = rng
    return key


def private_aggregate(aggregator) -> optax.GradientTransformation:
    """Noise and division by q n of clipped sums, with the ledger written in the program."""
    release = _release_fn(aggregator, _Ledger(aggregator, 1))

    def init(params):
        del params
        _refuse_multi_steps("private_aggregate")
        return PrivateAggregateState(_split_key(aggregator))

    def update(updates, state, params=None):
        del params
        _refuse_manual_axes("private_aggregate's update")
        sums, nonfinite = _clipped(updates, aggregator)
        key, mean = release(sums, nonfinite, jnp.int32(-1), state.key)
        return mean, PrivateAggregateState(key)

    return optax.GradientTransformation(init, update)


def drop_parts(state):
    """``state`` (a :class:`PrivateOptimizerState`, or an optax state holding some) without
    the clipped sums of the parts held, the wrapped optimizer's state and the key kept: the
    way on after a part of a later sample was refused (nothing was released, so no noise was
    drawn)."""
    def drop(s):
        if not isinstance(s, PrivateOptimizerState):
            return s
        none = jnp.zeros((), jnp.int32)
        return s._replace(sums=jax.tree_util.tree_map(jnp.zeros_like, s.sums), count=none,
                          nonfinite=none, step=none - 1)

    return jax.tree_util.tree_map(drop, state,
                                  is_leaf=lambda s: isinstance(s, PrivateOptimizerState))


def private_optimizer(optimizer: optax.GradientTransformation, aggregator, *,
                      accumulation_steps: int = 1) -> optax.GradientTransformation:
    """``optimizer`` applied to the private average of clipped sums. With
    ``accumulation_steps=k`` the clipped sums of k consecutive calls (the parts of one
    logical batch) are added; the k-th call adds the noise, writes the events and runs
    ``optimizer``, the others return zero updates and leave ``optimizer``'s state alone."""
    k = check.count("accumulation_steps", accumulation_steps, minimum=1)
    if k == 1:
        return optax.chain(private_aggregate(aggregator), optimizer)
    ledger = _Ledger(aggregator, k)
    release = _release_fn(aggregator, ledger)

    def init(params):
        _refuse_multi_steps("private_optimizer")
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        none = jnp.zeros((), jnp.int32)
        return PrivateOptimizerState(_split_key(aggregator), zeros, none, none, none - 1,
                                     optimizer.init(params))

    def update(updates, state, params=None):
        _refuse_manual_axes("private_optimizer's update")
        part, part_nonfinite = _clipped(updates, aggregator)
        stamp = io_callback(ledger.stamp, jax.ShapeDtypeStruct((2,), jnp.int32), state.step,
                            state.count, ordered=True)
        step, drop = stamp[0], stamp[1] > 0  # drop: parts of a refused release
        sums = jax.tree_util.tree_map(lambda s, p: jnp.where(drop, p, s + p), state.sums, part)
        count = jnp.where(drop, 1, state.count + 1)
        nonfinite = jnp.where(drop, 0, state.nonfinite) + part_nonfinite

        def emit():
            key, mean = release(sums, nonfinite, step, state.key)
            out, inner = optimizer.update(mean, state.inner, params)
            zeros = jax.tree_util.tree_map(jnp.zeros_like, sums)
            none = jnp.zeros((), jnp.int32)
            return out, PrivateOptimizerState(key, zeros, none, none, none - 1, inner)

        def hold():
            out = jax.tree_util.tree_map(jnp.zeros_like, part)
            return out, PrivateOptimizerState(state.key, sums, count, nonfinite, step,
                                              state.inner)

        return jax.lax.cond(count == k, emit, hold)

    return optax.GradientTransformation(init, update)
