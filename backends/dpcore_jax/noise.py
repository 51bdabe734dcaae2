"""Standard normal noise from a ``threefry2x32`` key, the same values as ``jax.random.normal``
but about twice as fast on CPU, and where a compiled step draws it (:class:`NoiseSource`).

``jax.random.normal(key, (m,), float32)`` (sequential bit layout) hashes the counters
0..m-1 with Threefry-2x32-20 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
SC 2011), the first half of the counters as the hash's first word and the second half as its
second, turns each 32-bit output b into f = (b >> 9) 2^-23 in [0, 1) and u = lo + (1 - lo) f
with lo = nextafter(-1, 0) (so u is in (-1, 1)), and returns sqrt(2) erfinv(u).
:func:`standard_normal` does exactly that, with two differences that only change speed,
measured on 2 CPU cores:

* the 20 rounds are written out, where JAX lowers its hash to a rolled ``while`` loop on CPU
  (each of its 5 iterations reads and writes both half arrays): 16,308 normals in 0.12
  against 0.21 ms, 1,684,996 in 5.6 against 10.1 ms;
* m is a multiple of 16, so the fused hash-and-erfinv loop vectorises: XLA:CPU emits a
  scalar loop for a length that is not a multiple of the vector width (16,307 values: 0.43
  against 0.12 ms), and a 2-mod-4 half length even slows JAX's own loop ~6x.

The first ``size`` of the m values are returned (all m are independent standard normals).
Outside ``jit`` the m draws are one compiled program and the cut a separate operation; inside
a step XLA decides the fusion (in dpcore's compiled steps the hash and ``erf_inv`` stay
m-long, checked in their HLO). float16 and bfloat16 noise is drawn in float32 and rounded:
drawn in its own dtype by ``jax.random.normal``, from uniforms of that precision, it never
passed 3.49 (float16) or 2.89 (bfloat16) standard deviations in 2^22 draws, a truncated
Gaussian whose guarantee the accountants do not give. float64 uses ``jax.random.normal``,
also for m values.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dpcore import aggregation
from dpcore.secure import SecureGenerator

from .names import named_leaves

KEY_IMPL = "threefry2x32"  # the key implementation the fast path draws from
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA
_ALIGN = 16


def threefry2x32(k0, k1, x0, x1):
    """The Threefry-2x32 hash with 20 rounds of words ``(x0, x1)`` (uint32 arrays) under
    key ``(k0, k1)``; equal to ``jax.extend.random.threefry_2x32``."""
    ks = (k0, k1, k0 ^ k1 ^ np.uint32(_PARITY))
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(5):  # 5 x 4 rounds, a key injection after each 4
        for r in _ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = x0 ^ ((x1 << np.uint32(r)) | (x1 >> np.uint32(32 - r)))
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x0, x1


def _normal_float32(key, m: int):
    k = jax.random.key_data(key)
    counters = lax.iota(jnp.uint32, m // 2)
    y0, y1 = threefry2x32(k[0], k[1], counters, counters + np.uint32(m // 2))
    bits = jnp.concatenate([y0, y1])
    one_to_two = lax.bitcast_convert_type((bits >> np.uint32(9)) | np.uint32(0x3F800000),
                                          jnp.float32)
    lo = np.nextafter(np.float32(-1), np.float32(0))
    u = lax.max(lo, (one_to_two - np.float32(1)) * (np.float32(1) - lo) + lo)
    return np.float32(math.sqrt(2)) * lax.erf_inv(u)


def _is_threefry(key) -> bool:
    return (jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
            and str(jax.random.key_impl(key)) == KEY_IMPL)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _draws(key, m: int, dtype):
    """``(next_key, m standard normals)``, compiled on its own when called outside ``jit``
    (its m-long output keeps the loop vectorised; the caller's slice is a separate op)."""
    key, sub = jax.random.split(key)
    wide = jnp.promote_types(dtype, jnp.float32)  # float16 and bfloat16: drawn in float32
    if wide == jnp.float32 and _is_threefry(sub):
        return key, _normal_float32(sub, m).astype(dtype)
    with jax.threefry_partitionable(False):
        return key, jax.random.normal(sub, (m,), wide).astype(dtype)


def standard_normal(key, shape, like) -> tuple[jax.Array, jax.Array]:
    """``(next_key, N(0, 1) draws of shape)`` in ``like``'s floating dtype (float32
    otherwise). Pure: usable inside ``jit``."""
    dtype = like.dtype if jnp.issubdtype(like.dtype, jnp.floating) else jnp.float32
    size = math.prod(shape)
    key, draws = _draws(key, max(_ALIGN, -(-size // _ALIGN) * _ALIGN), jnp.dtype(dtype))
    return key, draws[:size].reshape(tuple(shape))


#: A compiled step whose noise has at least this many values gets it drawn by a program of
#: its own, run just before the step (:class:`NoiseSource`).
SEPARATE_DRAW = 1 << 18


class NoiseSource:
    """What a compiled step of ``mechanism`` draws its noise from: the aggregator's key
    (the step draws, and returns the next key), or, when the noise has
    :data:`SEPARATE_DRAW` values or more, the list of normals drawn from that key by a
    program of its own (the same draws, from the same keys, in the same order). Inside a
    step XLA:CPU fuses the draw into each leaf's update: measured on 2 cores, the
    transformer benchmark's 1,684,994 values made its step 0.5-1.6 ms slower than drawing
    them apart (three A/B runs), while the covertype MLP's 16,307 values cost 0.37 ms more
    apart (one more program to dispatch) and the MNIST CNN's 21,840 the same either way."""

    def __init__(self, mechanism):
        self.mechanism = mechanism
        self._plans: dict = {}

    def plan(self, params) -> tuple:
        """The (shape, dtype) of each draw :func:`dpcore_jax.clipping.noisy_mean` makes
        for sums shaped like ``params``, in its order (found by tracing the core's
        ``noisy_average`` abstractly)."""
        leaves, tree = jax.tree_util.tree_flatten(params)
        signature = (tree, tuple((leaf.shape, leaf.dtype) for leaf in leaves))
        if signature not in self._plans:
            calls = []

            def record(rng, shape, like):
                calls.append((tuple(shape), like.dtype))
                return rng, jnp.zeros(shape, like.dtype)

            jax.eval_shape(lambda p: aggregation.noisy_average(
                named_leaves(p), self.mechanism, None, record, 1.0)[1], params)
            self._plans[signature] = tuple(calls)
        return self._plans[signature]

    def __call__(self, key, params):
        """``(next_key, source)``: ``(None, key)`` when the step draws (it returns the next
        key), else the key after the separate draws and the list of normals; for a
        ``secure`` aggregator's generator, the normals drawn from the system's CSPRNG on the
        host (:mod:`dpcore.secure`), whatever their number."""
        plan = self.plan(params)
        if isinstance(key, SecureGenerator):
            return key, [jnp.asarray(z) for z in secure_normals(key, plan)]
        if sum(math.prod(shape) for shape, _ in plan) < SEPARATE_DRAW:
            return None, key
        return _draw_all(key, plan)


def secure_normals(generator: SecureGenerator, plan) -> list[np.ndarray]:
    """The normals of a :meth:`NoiseSource.plan` from the system's CSPRNG, on the host:
    float64 draws (:mod:`dpcore.secure`) rounded to each draw's dtype."""
    return [generator.standard_normal(math.prod(shape)).reshape(shape).astype(dtype)
            for shape, dtype in plan]


@functools.partial(jax.jit, static_argnums=1)
def _draw_all(key, plan):
    normals = []
    for shape, dtype in plan:
        key, draw = standard_normal(key, shape, jnp.zeros((), dtype))
        normals.append(draw)
    return key, normals
