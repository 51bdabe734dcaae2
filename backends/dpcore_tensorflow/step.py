"""The fused DP gradient of a Keras model: one compiled function from a padded Poisson batch
to the private average gradient, with the ledger written on the host before it runs.

One step t:

1. host: ``aggregator.begin_step()`` writes the sampling event (q, n); the step's groups
   (S_g, sigma~_g) are written as sum-query events, so a released step always has its events;
2. graph: per-example norms and clipped sums by book-keeping (:mod:`.bookkeeping`), clip
   factors min(1, S_g / ||v_ig||) (:mod:`.kernels`), noise alpha_j sigma~_g N(0, I) from the
   aggregator's ``tf.random.Generator`` (a ``secure`` aggregator's normals are drawn on the
   host, from the system's CSPRNG, and enter as a tensor), division by the public q n.

Clips and noise enter as tensors, so schedules that move them do not retrace. Adaptive
clipping's count queries are not part of the fused step (use ``backend.private_gradient``).
"""

from __future__ import annotations

import collections.abc
import math
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

from dpcore.aggregation import (NonFiniteNormError, check_mask_values, clips_of, leaf_stds_of,
                                structure)

from .bookkeeping import ClippedGradients
from .independence import IndependenceCheck
from .kernels import GroupClipper, noisy_mean, refuse_16_bit


def per_example_loss(loss) -> Callable:
    """``(y_true, y_pred) -> (B,)`` from a Keras loss (object, name or function): the
    unreduced loss, averaged over every axis but the first (Keras's mean over all elements
    is the mean of these). A Keras mask on ``y_pred`` (``Embedding(mask_zero=True)``) keeps
    the masked positions out, as Keras's own loss does: example i's loss is the mean over its
    unmasked positions, what Keras gives for a batch of that example alone (Keras's batch
    loss weights the examples by their numbers of positions, which would make one record's
    loss depend on the others)."""
    if isinstance(loss, (collections.abc.Mapping, list, tuple)):
        raise ValueError(f"loss must be one loss of the model's output, got a "
                         f"{type(loss).__name__} of {len(loss)}: DP clips one loss per "
                         f"example. For several outputs, combine their losses in one function "
                         f"(y_true, y_pred) -> per-example losses")
    if isinstance(loss, keras.losses.Loss):
        fn = loss.call
    else:
        fn = keras.losses.get(loss)
        if fn is None:
            raise ValueError(f"loss must be a Keras loss, its name or a function "
                             f"(y_true, y_pred) -> per-example losses, got {loss!r}")

    def losses(y_true, y_pred):
        mask = getattr(y_pred, "_keras_mask", None)
        values = tf.convert_to_tensor(fn(y_true, y_pred))
        if values.shape.rank == 0:
            raise ValueError(f"loss {loss!r} returned a scalar; DP needs one loss per example "
                             f"(pass a Keras loss or a function without batch reduction)")
        axes = list(range(1, values.shape.rank))
        if mask is not None and mask.shape.rank == values.shape.rank:
            weight = tf.cast(mask, values.dtype)
            if not axes:
                return values * weight
            return (tf.reduce_sum(values * weight, axis=axes)
                    / tf.maximum(tf.reduce_sum(weight, axis=axes), 1.0))
        return tf.reduce_mean(values, axis=axes) if axes else values

    return losses


class PrivateGradients:
    """DP gradients of ``model`` under ``aggregator`` (a :class:`dpcore.PrivateAggregator` on
    the tensorflow backend, whose mechanism names the model's variable paths).

    Call it in a GradientTape-style custom loop; each call is one step::

        grads = dp(x, y, mask)               # ledger first, then the compiled step
        optimizer.apply(grads, model.trainable_variables)

    ``mode`` chooses the norms (:class:`~.bookkeeping.ClippedGradients`); ``jit_compile`` runs
    the step under XLA. ``check_independence`` (default) checks on the first two batches that
    the model keeps its examples apart (:mod:`.independence`), raising
    :class:`~.independence.NotPerExampleError` before anything is recorded if it does not.
    """

    def __init__(self, model: keras.Model, loss, aggregator, *, mode: str = "auto",
                 jit_compile: bool = False, check_independence: bool = True):
        variables = model.trainable_variables
        refuse_16_bit([v.path for v in variables], variables)
        self.engine = ClippedGradients(model, mode)
        self.loss_fn = per_example_loss(loss)
        # the vectorized mode differentiates each example alone: per example by construction
        self.independence = (IndependenceCheck(self.engine, self.loss_fn)
                             if check_independence and mode != "vectorized" else None)
        self._checked = False  # check() ran for the step about to be recorded
        self.aggregator = aggregator
        if not (aggregator.secure or isinstance(aggregator.rng, tf.random.Generator)):
            raise TypeError(f"the aggregator's generator is {type(aggregator.rng).__name__}; "
                            f"create it with backend='tensorflow' so noise is drawn in graph")
        self.clipper = GroupClipper(aggregator.mechanism, self.engine.names)
        self.variables = self.engine.variables
        self._function = tf.function(self.graph_step, jit_compile=jit_compile,
                                     reduce_retracing=True)
        self._mechanism = None  # the mechanism of the last recorded step, and what follows
        self._tensors = (None, None)  # from it: (clips, stds) as given and as tensors

    def check(self, x, y, mask=None) -> None:
        """Eagerly, on the batch of the step about to run: until the model has been found to
        keep its examples apart (on two batches of two real records or more), check it, raising
        :class:`~.independence.NotPerExampleError` if it mixes them. A loop that runs
        :meth:`graph_step` in its own ``tf.function`` calls this before :meth:`record_step`."""
        if self.independence is not None:
            self.independence(x, y, mask)
        self._checked = True

    def record_step(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Host side, before the step runs: the sampling event and the step's sum-query events
        go to the ledger; returns the step's clips S_g and leaf noise stds alpha_j sigma~_g
        (inputs of :meth:`graph_step`)."""
        if self.independence is not None and not (self.independence.done or self._checked):
            raise RuntimeError(
                "the model has not yet been checked for mixing of the examples: call "
                "check(x, y, mask) on the step's batch before record_step() (until two "
                "batches of two real records or more have been checked), or build "
                "PrivateGradients with check_independence=False")
        self._checked = False
        agg = self.aggregator
        if agg.count_groups:
            raise NotImplementedError(
                "the aggregator releases more than the gradient groups each step (adaptive "
                "clipping's counts); the fused step does not: use "
                "TensorFlowBackend.private_gradient, or a clip schedule")
        agg.begin_step()
        mechanism = agg.mechanism
        if mechanism is not self._mechanism:  # clips moved (or first step): recompute
            if structure(mechanism) != self.clipper.structure:
                raise ValueError("the aggregator's groups changed since this step was built; "
                                 "rebuild PrivateGradients")
            self._mechanism = mechanism
            self._inputs = (tuple(clips_of(mechanism)),
                            tuple(leaf_stds_of(mechanism, self.clipper.leaves)))
        agg.record_release()
        return self._inputs

    @property
    def noise_size(self) -> int:
        """The number of normals a step draws: one per trainable value."""
        return sum(math.prod(v.shape) for v in self.variables)

    def host_normals(self) -> tf.Tensor:
        """A ``secure`` aggregator's noise for one step: :attr:`noise_size` float64 N(0, 1)
        values from the system's CSPRNG (:mod:`dpcore.secure`), the ``normals`` of
        :meth:`graph_step`. Draw them afresh for every step: normals used twice would let
        the difference of two releases cancel their noise."""
        if not self.aggregator.secure:
            raise ValueError("host_normals() serves a secure=True aggregator; this one's noise "
                             "is drawn in graph from its tf.random.Generator")
        if tf.inside_function():
            raise RuntimeError(
                "host_normals() inside a tf.function draws once, at tracing, and every step "
                "the function runs would reuse that noise: call it eagerly each step and pass "
                "the normals in as an argument of your function")
        return tf.constant(self.aggregator.rng.standard_normal(self.noise_size))

    def graph_step(self, x, y, mask, clips, stds, normals=None):
        """In graph: ``(grads in variable order, losses (B,), outputs, nonfinite (B,))`` for
        clips (G,) and leaf noise stds (L,) tensors. Whoever runs this must have called
        :meth:`record_step` for the step on the host (it gives clips and stds). A ``secure``
        aggregator's step takes its ``normals`` from :meth:`host_normals`, any other draws
        them in graph (``normals`` None). Run per replica of a ``tf.distribute`` strategy
        (``strategy.run``) on the replica's part of the batch, it adds the noise in the first
        replica only: the results added up over the replicas are the step's release."""
        if self.aggregator.secure != (normals is not None):
            raise ValueError(
                "a secure=True aggregator's step takes normals=dp.host_normals() (drawn on the "
                "host, afresh each step)" if self.aggregator.secure else
                "normals are a secure=True aggregator's; this one draws its noise in graph")
        replica = tf.distribute.get_replica_context()
        first = None
        if replica is not None and replica.num_replicas_in_sync > 1:
            check_strategy(tf.distribute.get_strategy())
            first = tf.equal(replica.replica_id_in_sync_group, 0)
        if (normals is not None and tf.inside_function()
                and tf.get_static_value(normals) is not None):
            raise ValueError("the normals are a constant of the traced function: every step "
                             "it runs would add the same noise. Pass dp.host_normals(), drawn "
                             "eagerly each step, as an argument of the function")
        mask = tf.cast(mask, tf.bool)
        sums, bad, losses, outputs = self.engine.clipped_sums(x, y, self.loss_fn, self.clipper,
                                                              clips, mask)
        means = noisy_mean(sums, self.clipper.leaves, stds,
                           self.aggregator.rng if normals is None else normals,
                           self.aggregator.expected_size, first)
        return [means[name] for name in self.engine.names], losses, outputs, bad

    def __call__(self, x, y, mask=None) -> list[tf.Tensor]:
        """One DP step's private average gradient, aligned with ``model.trainable_variables``.
        Call it eagerly: it writes the ledger on the host, which inside a ``tf.function``
        would happen once, at tracing."""
        if tf.inside_function():
            raise RuntimeError(
                "PrivateGradients(...)(x, y, mask) writes the step's ledger events on the host, "
                "so it cannot run inside a tf.function (they would be written once, at "
                "tracing, for every step the function runs). Call it eagerly (its step is "
                "compiled), or call record_step() eagerly and graph_step() in your function")
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        if replicas > 1:  # before the ledger
            raise ValueError(
                f"PrivateGradients(...)(x, y, mask) computes a whole batch's step on one "
                f"device, not under a tf.distribute strategy of {replicas} replicas: use the "
                f"private model's fit (make_private), which splits each batch over the "
                f"replicas, or record_step() and then graph_step per replica "
                f"(strategy.run) with the results added up")
        if mask is None:
            mask = tf.ones([tf.shape(tf.nest.flatten(x)[0])[0]], tf.bool)
        check_mask_values(mask)
        self.check(x, y, mask)
        inputs = self.record_step()
        if inputs != self._tensors[0]:
            self._tensors = (inputs, tuple(tf.constant(v, tf.float64) for v in inputs))
        normals = self.host_normals() if self.aggregator.secure else None
        grads, _, _, bad = self._function(x, y, mask, *self._tensors[1], normals)
        raise_on_nonfinite(self.aggregator, bad)
        return grads


def check_strategy(strategy: tf.distribute.Strategy) -> int:
    """The number of replicas of ``strategy``. Several are served under a
    ``MirroredStrategy`` (one host, whose Python writes the ledger and draws the samples);
    other strategies of several replicas are refused: with several workers each host would
    draw a Poisson sample of its own and write its own ledger (not the one sample of a step
    that is accounted), a parameter server applies updates asynchronously."""
    replicas = strategy.num_replicas_in_sync
    if replicas > 1 and not isinstance(strategy, tf.distribute.MirroredStrategy):
        raise ValueError(
            f"a {type(strategy).__name__} of {replicas} replicas: dpcore's TensorFlow steps "
            f"serve several replicas under a tf.distribute.MirroredStrategy (one machine) "
            f"only; with several hosts each would draw its own Poisson sample and write its "
            f"own ledger")
    return replicas


def raise_on_nonfinite(aggregator, bad: tf.Tensor) -> None:
    """Host side: raise :class:`NonFiniteNormError` for non-finite records under the
    ``"raise"`` policy (they already got weight 0 in the sums)."""
    if aggregator.on_nonfinite == "raise" and bool(tf.reduce_any(bad)):
        rows = np.flatnonzero(bad.numpy()).tolist()
        raise NonFiniteNormError(
            f"records {rows[:10]}{' ...' if len(rows) > 10 else ''} have a NaN or infinite "
            f"gradient norm; fix the model or loss, or use on_nonfinite='drop'")

