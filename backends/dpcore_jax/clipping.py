"""The compiled part of a private step: clipped per-leaf sums of a padded batch, then noise.

For a batch of B rows (records), ``mask`` (B,) marking the real ones, and the groups of a
:class:`dpcore.Mechanism`, :func:`clipped_sums` computes, inside one traced function,

    sq[i, j]   = ||dl_i/dtheta_j||^2                (ghost norms or vmap; :mod:`dpcore_jax.ghost`)
    f[i, g]    = min(1, S_g / ||(dl_i/dtheta_j / alpha_j)_{j in g}||) for real finite rows, else 0
    sums[j]    = sum_i f[i, g(j)] dl_i/dtheta_j     (book-keeping, or from per-example grads)

with the core's Array API kernels (:func:`dpcore.aggregation.group_norms`,
:func:`~dpcore.aggregation.clip_factors` with ``on_nonfinite="drop"``, which needs no host
read) and the number of real rows whose norm was not finite, for the host to raise on.
With ``chunk_size`` the rows are processed ``chunk_size`` at a time in a ``lax.scan``, which
bounds memory at large batches (clip factors depend only on each row's own norms).
:func:`noisy_mean` then adds N(0, (alpha_j sigma~_g)^2) per leaf from an explicit key and
divides by the public expected size q n. Everything here is pure and can run under ``jit``.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dpcore import aggregation
from dpcore.queries import Mechanism

from . import ghost
from .backend import one_example_loss
from .noise import standard_normal
from .names import leaf_names, named_leaves, unflatten_like

METHODS = ("ghost", "vmap")


def _rows(batch) -> int:
    sizes = {leaf.shape[0] for leaf in jax.tree_util.tree_leaves(batch)}
    if len(sizes) != 1:
        raise ValueError(f"every array of the batch needs the same number of rows, got {sorted(sizes)}")
    return sizes.pop()


def _spec(x):
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))


def _chunk(loss_fn, mechanism, method, params, batch, mask, clips):
    """(sums by leaf name, nonfinite count, clip factors) of one chunk of rows: the
    per-example parts (gradients, or a ghost plan's inputs and backprops) at the loss's own
    precision, then norms and clipped sums with every product at full precision. (Default
    precision on GPUs and TPUs rounds float32 inputs to TensorFloat-32 or bfloat16: a sum
    x^T (c g) would not be the sum of the records whose norms were clipped.)"""
    named = named_leaves(params)
    if method == "vmap":
        grads = named_leaves(jax.vmap(jax.grad(one_example_loss(loss_fn)), in_axes=(None, 0))(
            params, batch))
        parts = ((), grads, {}, {})
    else:
        example = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), batch)
        plan = ghost.plan(loss_fn, jax.tree_util.tree_map(_spec, params), example)
        parts = (plan.sites, *ghost.per_example_parts(plan, named, batch))
    with jax.default_matmul_precision("highest"):
        return _clipped(mechanism, named, mask, clips, *parts)


def _clipped(mechanism, named, mask, clips, sites, fallback_grads, site_grads, acts):
    """:func:`_chunk`'s norms, clip factors and sums; ``sites`` are summed by their rules
    (:func:`ghost.site_weighted_sum`), the other leaves from ``fallback_grads``."""
    leaves = mechanism.leaves
    rows = mask.shape[0]
    by_site = {site.leaf: ghost.site_grads(site, named[site.leaf], acts[site.index],
                                           site_grads[site.index]) for site in sites}
    sq = {leaf: grads.sq for leaf, grads in by_site.items()}
    sq.update({leaf: ghost.sq_norms(g) for leaf, g in fallback_grads.items() if leaf not in sq})
    dtype = jnp.result_type(jnp.float32, *[v.dtype for v in sq.values()])
    zero = jnp.zeros((rows,), dtype)
    sq_norms = jnp.stack([sq.get(leaf, zero).astype(dtype) for leaf in leaves], axis=1)
    norms = aggregation.group_norms(sq_norms, mechanism, leaves)
    factors = aggregation.clip_factors(norms, clips, mask=mask, on_nonfinite="drop")
    finite = jnp.all(jnp.isfinite(norms), axis=1)
    keep = jnp.logical_and(mask, finite)
    nonfinite = jnp.sum(jnp.logical_and(mask, jnp.logical_not(finite)), dtype=jnp.int32)

    def weighted_sums(zero_dropped: bool):
        sums = aggregation.clipped_sum(fallback_grads, factors, mechanism, list(fallback_grads),
                                       zero_rows=jnp.logical_not(keep) if zero_dropped else None)
        for site in sites:
            sums[site.leaf] = ghost.site_weighted_sum(
                site, named[site.leaf], by_site[site.leaf], acts[site.index],
                site_grads[site.index], factors[:, mechanism.group_index[site.leaf]],
                keep if zero_dropped else None)
        for leaf in leaves:  # leaves the loss does not read have gradient 0
            if leaf not in sums:
                sums[leaf] = jnp.zeros_like(named[leaf])
        return {leaf: sums[leaf].astype(named[leaf].dtype) for leaf in leaves}

    # Factors are 0 on padded and dropped rows, but 0 * NaN is NaN: when some row's norms
    # (padded rows included) are not finite, the sums are recomputed with those rows zeroed.
    # Otherwise every value the norms were computed from is finite (a non-finite entry of
    # a_i or g_i makes ||.||^2 Inf or NaN) and the sums stand. (The common case stays
    # outside lax.cond: XLA:CPU leaves convolutions inside a branch on a slow path.)
    sums = weighted_sums(False)
    sums = jax.lax.cond(jnp.all(finite), lambda: sums, lambda: weighted_sums(True))
    return sums, nonfinite, factors


def check_param_dtypes(params) -> None:
    """Refuse leaves that are not floating (PRNG keys, counters: a Flax nnx state split
    whole; noise would be added to a leaf the loss does not read) and float16 or bfloat16
    leaves: their clipped sums would be formed and rounded in that dtype before the noise,
    and a rounded sum of many records moves by more than the clip when one record leaves it
    (1.6 clips for a batch of 512 in bfloat16)."""
    dtypes = {name: jnp.result_type(leaf) for name, leaf in named_leaves(params).items()}
    bad = [name for name, dtype in dtypes.items() if not jnp.issubdtype(dtype, jnp.floating)]
    if bad:
        raise TypeError(f"the trained parameters must be floating arrays; leaves {bad} are "
                        f"not (PRNG keys or counters?): train the parameters alone, e.g. "
                        f"nnx.split(model, nnx.Param, ...)")
    for name, dtype in dtypes.items():
        if jnp.finfo(dtype).bits < 32:
            raise ValueError(
                f"parameter {name!r} is {dtype}: its clipped sum would be rounded to {dtype} "
                f"before the noise, and one record could move it by more than its clip. Keep "
                f"the parameters in float32 and compute in {dtype} inside loss_fn (Flax: "
                f"param_dtype=jnp.float32, dtype=jnp.{dtype}; or cast them there, "
                f"jax.tree_util.tree_map(lambda p: p.astype(jnp.{dtype}), params))")


def host_mask(mask):
    """``mask`` as the compiled programs take it: None, a traced value (whose dtype
    :func:`clipped_sums` checks) or a boolean array. A mask given on the host holding other
    values than booleans or 0/1 is refused (the programs would read a NaN or 0.5 as True);
    0/1 numbers are turned into booleans."""
    if (mask is None or isinstance(mask, jax.core.Tracer)
            or getattr(mask, "dtype", None) == bool):
        return mask
    aggregation.check_mask_values(mask)
    return np.asarray(mask, dtype=bool)


def _check_traced_mask(mask) -> None:
    """Refuse a mask traced with another dtype than bool: its values cannot be read at
    tracing, and the program reads it as booleans (weights of 0.5 as whole records)."""
    if isinstance(mask, jax.core.Tracer) and mask.dtype != jnp.bool_:
        raise TypeError(
            f"the mask is traced with dtype {mask.dtype}, and the compiled sums read it as "
            f"booleans: a weight 0.5 would count as a whole record, a NaN as a record. Pass "
            f"a boolean mask (PoissonBatches' masks are; a mask of 0/1 numbers given on the "
            f"host outside jit is checked and turned into booleans)")


@jax.tree_util.register_pytree_node_class
class ClippedSums:
    """A batch's clipped per-leaf sums (a pytree like the parameters) and the number of its
    real rows whose norm was not finite (given weight 0); unpacks as ``(sums, nonfinite)``.
    The optax transformation takes it whole, so that ``on_nonfinite="raise"`` can refuse the
    release and sums clipped under another mechanism than the aggregator's are refused:
    ``clipping`` (static, kept through ``jit``, ``psum`` and other tree maps) is the groups'
    ``(name, leaves, scales, clip)``, the clip None where ``clips`` were passed in."""

    def __init__(self, sums, nonfinite, clipping: tuple | None = None):
        self.sums, self.nonfinite, self.clipping = sums, nonfinite, clipping

    def __iter__(self):
        return iter((self.sums, self.nonfinite))

    def tree_flatten(self):
        return (self.sums, self.nonfinite), self.clipping

    @classmethod
    def tree_unflatten(cls, clipping, children):
        return cls(*children, clipping)


def clipping_of(mechanism: Mechanism, *, clips_given: bool = False) -> tuple:
    """The groups of ``mechanism`` as :attr:`ClippedSums.clipping` records them."""
    return tuple((g.name, g.leaves, g.scales, None if clips_given else g.clip)
                 for g in mechanism.groups)


def clipped_sums(loss_fn: Callable, mechanism: Mechanism, *, chunk_size: int | None = None,
                 method: str = "ghost", with_factors: bool = False) -> Callable:
    """A pure function ``(params, batch, mask, clips=None) -> ClippedSums(sums, nonfinite)``:
    the clipped per-leaf sums as a pytree like ``params`` and the number of real rows with a
    non-finite norm (given weight 0); ``with_factors=True`` returns the tuple
    ``(sums, nonfinite, factors)`` with the clip factors (B, G). ``clips``
    (G,) replaces the mechanism's clips (a traced argument: moving clips do not recompile).
    ``loss_fn(params, batch) -> (B,)`` is the per-record loss; ``mask`` (B,) bool marks real
    rows (None: all; traced with another dtype: refused). ``method`` is ``"ghost"`` (norms
    and sums from each leaf's operation, see :mod:`dpcore_jax.ghost`) or ``"vmap"``
    (per-example gradients of every leaf). With ``chunk_size``, B must be a multiple of it."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if not isinstance(mechanism, Mechanism):
        raise TypeError(f"mechanism must be a dpcore Mechanism, got {mechanism!r}")

    def run(params, batch, mask=None, clips=None):
        mechanism.check_leaves(leaf_names(params))
        check_param_dtypes(params)
        rows = _rows(batch)
        _check_traced_mask(mask)
        mask = jnp.ones((rows,), bool) if mask is None else jnp.asarray(mask, bool)
        clipping = clipping_of(mechanism, clips_given=clips is not None)
        if clips is None:
            clips = [g.clip for g in mechanism.groups]
        if mask.shape != (rows,):
            raise ValueError(f"mask must have shape ({rows},) like the batch, got {mask.shape}")
        if chunk_size is None or chunk_size >= rows:
            sums, nonfinite, factors = _chunk(loss_fn, mechanism, method, params, batch, mask,
                                              clips)
            return _result(params, sums, nonfinite, factors, clipping)
        if rows % chunk_size:
            raise ValueError(f"a batch of {rows} rows cannot be split into chunks of "
                             f"{chunk_size}; pad it to a multiple (see dpcore_jax.batching)")
        split = lambda a: a.reshape((rows // chunk_size, chunk_size) + a.shape[1:])  # noqa: E731

        def body(carry, xs):
            chunk_batch, chunk_mask = xs
            sums, nonfinite, factors = _chunk(loss_fn, mechanism, method, params, chunk_batch,
                                              chunk_mask, clips)
            total, count = carry
            return ({leaf: total[leaf] + sums[leaf] for leaf in total}, count + nonfinite), factors

        init = ({leaf: jnp.zeros_like(a) for leaf, a in named_leaves(params).items()}, jnp.zeros((), jnp.int32))
        (sums, nonfinite), factors = jax.lax.scan(
            body, init, (jax.tree_util.tree_map(split, batch), split(mask)))
        return _result(params, sums, nonfinite, factors.reshape(rows, factors.shape[-1]),
                       clipping)

    def _result(params, sums, nonfinite, factors, clipping):
        out = ClippedSums(unflatten_like(params, sums), nonfinite, clipping)
        return (*out, factors) if with_factors else out

    return run


def noisy_mean(sums, mechanism: Mechanism, key, expected_size: float):
    """``(next_key, (sums + N(0, (alpha_j sigma~_g)^2 I)) / (q n))`` as a pytree like
    ``sums``: one fresh draw per leaf, from ``key``. ``key`` may instead be the list of
    normals drawn from a key in advance (:class:`dpcore_jax.noise.NoiseSource`); the key
    returned is then None."""
    draw = standard_normal
    if isinstance(key, list):
        supply = iter(key)
        draw = lambda rng, shape, like: (rng, next(supply))  # noqa: E731
        key = None
    key, noisy = aggregation.noisy_average(named_leaves(sums), mechanism, key, draw,
                                           expected_size)
    return key, unflatten_like(sums, noisy)
