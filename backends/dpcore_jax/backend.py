"""The JAX backend: the :class:`dpcore.backend.Backend` contract on ``jax.numpy`` arrays.

Randomness is explicit, as everywhere in JAX: :meth:`JaxBackend.rng` returns a typed
``threefry2x32`` key and :meth:`JaxBackend.standard_normal` splits it
(:mod:`dpcore_jax.noise`), returning the key to use next, so the generator state is carried
in the caller's state (the aggregator, an optax state).

Per-example gradients of ``loss_fn(params, batch) -> (B,)`` are ``vmap(grad)`` of the loss of
one-example batches, compiled with ``jit``. :meth:`JaxBackend.private_gradient` is the fused
compiled step of :mod:`dpcore_jax.private_grad`: ghost norms and book-keeping sums
(:mod:`dpcore_jax.ghost`), clipping, noise and the division by q n in one XLA program, with the
ledger written on the host before the result is returned.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from dpcore import backend as contract

from dpcore.aggregation import NonFiniteNormError, per_leaf_sq_norms

from .names import leaf_names, named_leaves
from .noise import KEY_IMPL, standard_normal


_OUTSIDE = ("Call it outside (it compiles its own program), or use "
            "dpcore_jax.private_optimizer, an optax transformation that writes the ledger from "
            "inside the program")


def refuse_tracers(what: str, *values, advice: str = _OUTSIDE) -> None:
    """Raise if any of ``values`` (results of the step's program) is a tracer: ``what`` runs
    on the host between compiled programs (it advances the aggregator's noise key, and
    writes the ledger), which inside a user's ``jax.jit`` would happen once, at tracing,
    while every call of the cached program reused the traced key's noise and wrote nothing."""
    if any(isinstance(value, jax.core.Tracer) for value in values):
        raise RuntimeError(
            f"{what} cannot run inside jax.jit or another JAX transformation: it advances the "
            f"aggregator's noise key on the host, so a traced call would reuse one noise draw "
            f"(and record one step). {advice}")


def make_key(seed: int | None = None) -> jax.Array:
    """A typed ``threefry2x32`` key from all 64 bits of ``seed`` (an int in [0, 2^64)), or
    from 64 bits of OS entropy when ``seed`` is None. (``jax.random.key`` keeps only 32 bits
    of a seed unless x64 is enabled, so distinct large seeds could share a key.)"""
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little")
    elif isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int or None, got {seed!r} ({type(seed).__name__})")
    seed = int(seed)
    if not 0 <= seed < 2 ** 64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed!r}")
    words = np.array([seed >> 32, seed & 0xFFFFFFFF], dtype=np.uint32)
    return jax.random.wrap_key_data(words, impl=KEY_IMPL)


def one_example_loss(loss_fn: Callable) -> Callable:
    """``(params, example) -> scalar``: ``loss_fn`` on a batch holding only ``example``."""
    def loss(params, example):
        single = jax.tree_util.tree_map(lambda a: a[None], example)
        return loss_fn(params, single)[0]
    return loss


def kept_per_loss(build: Callable) -> Callable:
    """``build(loss_fn, *key)`` (a compiled program), kept for the 64 (loss, key) used last,
    as ``jax.jit`` keeps a function's traces; built anew for a bound method (``model.loss``
    is a new object at every access, equal to the last, and the attributes it reads may have
    changed since: a program is the loss as traced) and for a key that cannot be hashed."""
    kept = functools.lru_cache(maxsize=64)(build)

    @functools.wraps(build)
    def program(loss_fn: Callable, *key):
        if inspect.ismethod(loss_fn):
            return build(loss_fn, *key)
        try:
            hash((loss_fn, *key))
        except TypeError:
            return build(loss_fn, *key)
        return kept(loss_fn, *key)
    return program


def _per_example_grads(loss_fn, params, batch):
    return jax.vmap(jax.grad(one_example_loss(loss_fn)), in_axes=(None, 0))(params, batch)


@kept_per_loss
def _per_example_grads_program(loss_fn: Callable) -> Callable:
    return jax.jit(functools.partial(_per_example_grads, loss_fn))


class JaxBackend(contract.Backend):
    """``jax.numpy`` arrays on JAX's default device, keys for randomness, compiled steps."""

    name = "jax"
    version = jax.__version__
    capabilities = frozenset({contract.PER_EXAMPLE_GRADS, contract.GHOST_NORMS, contract.JIT})

    def namespace(self) -> Any:
        return jnp

    def asarray(self, x, dtype: str | None = None):
        return jnp.asarray(x, dtype=dtype)

    def to_numpy(self, x):
        return np.array(x, copy=True)

    def is_traced(self, x) -> bool:
        return isinstance(x, jax.core.Tracer)

    def settle(self) -> None:
        """Wait for the ordered host callbacks of the programs dispatched before (the optax
        route's releases write their events from one); effect-free programs are not
        waited for."""
        jax.effects_barrier()

    def rng(self, seed: int | None = None):
        return make_key(seed)

    def standard_normal(self, rng, shape, like):
        return standard_normal(rng, shape, like)

    def per_example_grads(self, loss_fn: Callable, params: Mapping[str, Any], batch) -> dict:
        """``{leaf name: (B, *leaf shape)}`` by ``jit(vmap(grad))``; ``params`` may be any
        pytree (leaf names as in :mod:`dpcore_jax.names`); the program is kept per loss
        (:func:`kept_per_loss`)."""
        return named_leaves(_per_example_grads_program(loss_fn)(params, batch))

    def per_example_sq_norms(self, loss_fn: Callable, params: Mapping[str, Any], batch):
        """Squared per-example gradient norms (B, L): columns in ``params`` order for a flat
        mapping name -> array (the contract), else in :func:`leaf_names` order."""
        names = leaf_names(params)
        if isinstance(params, Mapping) and sorted(params) == sorted(names):
            names = list(params)
        return per_leaf_sq_norms(self.per_example_grads(loss_fn, params, batch), names)

    def private_gradient(self, loss_fn: Callable, params: Mapping[str, Any], batch, aggregator,
                         *, mask=None) -> dict:
        """``{leaf name: private mean gradient}``: the compiled clipping kernel (ghost norms and
        book-keeping sums, :mod:`dpcore_jax.clipping`, one program per ``loss_fn``, groups
        and batch shape; the clips are an argument, so moving clips do not recompile), then
        ``aggregator.release_sums``, which writes the ledger, adds the noise from the
        aggregator's generator and divides by q n. Going through the
        aggregator keeps every clipping policy it supports (schedules, adaptive clipping);
        :class:`dpcore_jax.PrivateStep` fuses the noise and the update into the program too."""
        from .clipping import host_mask
        from .grad import clip_free, clipping_kernel

        mask = host_mask(mask)
        mechanism = aggregator.mechanism
        clips = jnp.asarray([g.clip for g in mechanism.groups])
        sums, nonfinite, factors = clipping_kernel(loss_fn, clip_free(mechanism))(
            params, batch, mask, clips)
        refuse_tracers("JaxBackend.private_gradient", nonfinite)
        if aggregator.on_nonfinite == "raise" and int(nonfinite):
            raise NonFiniteNormError(
                f"{int(nonfinite)} record(s) of this batch have a NaN or infinite gradient "
                f"norm; fix the model or loss, or pass on_nonfinite='drop'")
        return aggregator.release_sums(named_leaves(sums), factors=factors, mask=mask)
