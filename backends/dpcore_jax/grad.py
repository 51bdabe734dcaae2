"""``private_grad``: the privatised mean gradient of one Poisson step, compiled, with the ledger
written on the host.

A call runs one ``jit``-compiled program (per padded batch shape): per-example norms, clip
factors, clipped sums, N(0, (alpha_j sigma~_g)^2) noise from the aggregator's key and the
division by q n (:mod:`dpcore_jax.clipping`). The program is dispatched asynchronously; before
its result is handed back, the host writes (and flushes) the step's sum-query events, one per
group of the mechanism the program was compiled with, so a released gradient always has its
events in the ledger. With ``on_nonfinite="raise"`` the host first reads back the number of
records whose norm was NaN/Inf and raises (releasing nothing) when it is not 0; ``"drop"``
gives those records weight 0 and needs no read-back.
"""

from __future__ import annotations

from typing import Callable

import jax

from dpcore.aggregation import NonFiniteNormError
from dpcore.queries import Group, Mechanism

from .backend import JaxBackend, kept_per_loss, refuse_tracers
from .clipping import clipped_sums, host_mask, noisy_mean
from .noise import NoiseSource


def check_aggregator(aggregator) -> None:
    """The aggregator must draw its noise keys from the JAX backend, and keep one mechanism
    (a compiled step is built for one)."""
    if not isinstance(getattr(aggregator, "backend", None), JaxBackend):
        raise TypeError(f"the aggregator's backend must be the JAX backend (its rng is a jax "
                        f"key), got {getattr(aggregator, 'backend', aggregator)!r}; create it "
                        f"with PrivateAggregator(..., backend='jax')")
    if aggregator.clips_move:
        raise ValueError("the compiled JAX steps (private_grad, PrivateStep, train, "
                         "private_optimizer) are built for one fixed mechanism; clip schedules "
                         "and adaptive clipping run through JaxBackend.private_gradient")


class _Compiled:
    """What a compiled step was built for (a changed aggregator would make the ledger
    disagree with the noise, so it is an error), and where its noise is drawn."""

    def __init__(self, aggregator):
        check_aggregator(aggregator)
        self.aggregator = aggregator
        self.mechanism = aggregator.mechanism
        self.expected_size = aggregator.expected_size
        self._source, self._drawn = NoiseSource(self.mechanism), None

    def noise(self, params):
        """The step's noise argument for ``params``: the aggregator's key (the step draws
        and returns the next key), or the normals drawn from it now
        (:class:`dpcore_jax.noise.NoiseSource`)."""
        self._drawn, noise = self._source(self.aggregator.rng, params)
        return noise

    def check(self) -> None:
        agg = self.aggregator
        if agg.mechanism is not self.mechanism or agg.expected_size != self.expected_size:
            raise RuntimeError("the aggregator's mechanism or q*n changed after this step was "
                               "compiled; build a new one for the new mechanism")

    def release(self, key, nonfinite) -> None:
        """Host side of a step: advance the key (the step's ``key``, or the one after the
        separate draw), raise on non-finite norms (policy ``"raise"``), write the step's
        sum-query events."""
        refuse_tracers("a compiled private step (private_grad, PrivateStep, train)", key,
                       self._drawn, nonfinite)
        # advanced even if nothing is released: no key is reused
        self.aggregator.rng = key if self._drawn is None else self._drawn
        if self.aggregator.on_nonfinite == "raise":
            count = int(nonfinite)
            if count:
                raise NonFiniteNormError(
                    f"{count} record(s) of this batch have a NaN or infinite gradient norm; "
                    f"nothing was released. Fix the model or loss, or create the aggregator "
                    f"with on_nonfinite='drop' to give such records weight 0")
        self.aggregator.record_release()


def private_mean_fn(loss_fn: Callable, mechanism, expected_size: float, *,
                    chunk_size: int | None = None, method: str = "ghost") -> Callable:
    """The pure step ``(params, batch, mask, key) -> (key, mean gradient, nonfinite)``;
    ``key`` may be the normals drawn in advance (:class:`dpcore_jax.noise.NoiseSource`),
    and the key returned is then None."""
    sums_fn = clipped_sums(loss_fn, mechanism, chunk_size=chunk_size, method=method)

    def step(params, batch, mask, key):
        sums, nonfinite = sums_fn(params, batch, mask)
        key, mean = noisy_mean(sums, mechanism, key, expected_size)
        return key, mean, nonfinite

    return step


class PrivateGrad:
    """``grads = private_grad(params, batch, mask=None)``: the private average gradient of
    ``loss_fn(params, batch) -> (B,)`` over the records of ``batch`` (rows where ``mask`` is
    True), as a pytree like ``params``. The step's sampling event must already be in the
    ledger (``aggregator.sample()``, or :class:`dpcore_jax.batching.PoissonBatches`)."""

    def __init__(self, loss_fn: Callable, aggregator, *, chunk_size: int | None = None,
                 method: str = "ghost"):
        self._compiled = _Compiled(aggregator)
        self.aggregator = aggregator
        self._step = _mean_program(loss_fn, aggregator.mechanism, aggregator.expected_size,
                                   chunk_size, method)

    def __call__(self, params, batch, mask=None):
        mask = host_mask(mask)
        self._compiled.check()
        key, grads, nonfinite = self._step(params, batch, mask, self._compiled.noise(params))
        self._compiled.release(key, nonfinite)
        return grads

    def compiled_shapes(self) -> int:
        """How many programs have been compiled (one per distinct batch shape and dtype),
        also by the earlier ones of the same loss and configuration, which share them."""
        return self._step._cache_size()


@kept_per_loss
def _mean_program(loss_fn: Callable, mechanism, expected_size: float, chunk_size, method):
    """``jit`` of :func:`private_mean_fn`, kept per loss and configuration."""
    return jax.jit(private_mean_fn(loss_fn, mechanism, expected_size, chunk_size=chunk_size,
                                   method=method))


def private_grad(loss_fn: Callable, aggregator, *, chunk_size: int | None = None,
                 method: str = "ghost") -> PrivateGrad:
    """A :class:`PrivateGrad` for ``loss_fn`` and ``aggregator`` (a
    :class:`dpcore.PrivateAggregator` with ``backend="jax"``). ``chunk_size`` bounds memory
    by processing that many records at a time; ``method`` is ``"ghost"`` or ``"vmap"``."""
    return PrivateGrad(loss_fn, aggregator, chunk_size=chunk_size, method=method)


def clip_free(mechanism: Mechanism) -> Mechanism:
    """``mechanism`` with every clip set to 1 and no noise: what a clipping kernel depends on
    besides its clips (groups, leaves, scales), so moving clips share one kernel."""
    return Mechanism(tuple(Group(g.name, g.leaves, 1.0, 0.0, g.scales)
                           for g in mechanism.groups), mechanism.record,
                     mechanism.microbatch_size)


@kept_per_loss
def clipping_kernel(loss_fn: Callable, structure: Mechanism) -> Callable:
    """``jit(clipped_sums(loss_fn, structure, with_factors=True))`` called as
    ``kernel(params, batch, mask, clips)``, built once per loss and :func:`clip_free`
    mechanism (a bound method anew each time: :func:`~dpcore_jax.backend.kept_per_loss`)."""
    return jax.jit(clipped_sums(loss_fn, structure, with_factors=True))
