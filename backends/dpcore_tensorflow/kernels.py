"""The core's aggregation steps 2-6 (see :mod:`dpcore.aggregation`) as TensorFlow ops, so a
whole DP step runs inside one ``tf.function`` (and XLA) without a round trip through NumPy.

For B records, L leaves in a fixed order and G groups of a :class:`dpcore.Mechanism`:

* ``norms[i, g] = sqrt(sum_j sq_norms[i, j] W[j, g])`` with ``W[j, g] = 1 / alpha_j^2`` for the
  leaves j of group g (:func:`dpcore.aggregation.group_weights`, computed once on the host);
* ``factors[i, g] = S_g / max(norms[i, g], S_g) = min(1, S_g / norms[i, g])``, and 0 for padded
  rows (``mask`` false) and for records whose norms are not finite;
* ``mean[j] = (sums[j] + alpha_j sigma~_g N(0, I)) / (q n)``.

The formulas are the core's; the tests compare both on the same inputs. Clips and noise
standard deviations enter as tensors, so clips that move from step to step (schedules,
adaptive clipping) reuse one compiled step; only the partition into groups and the scales
alpha_j are fixed (:func:`dpcore.aggregation.structure`).
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import tensorflow as tf

from dpcore.aggregation import group_weights, structure
from dpcore.queries import Mechanism

from .layer_grads import in_xla


class GroupClipper:
    """Clip factors for the groups of ``mechanism``, per-leaf squared norms in ``leaves`` order."""

    def __init__(self, mechanism: Mechanism, leaves: Sequence[str]):
        mechanism.check_leaves(leaves)
        self.structure = structure(mechanism)
        self.leaves = tuple(leaves)
        self._weights = group_weights(mechanism, self.leaves)
        #: column of ``factors`` that scales each leaf
        self.column = {leaf: mechanism.group_index[leaf] for leaf in self.leaves}

    def factors(self, sq_norms: tf.Tensor, clips: tf.Tensor, mask: tf.Tensor | None = None):
        """``(factors (B, G), nonfinite (B,) bool)`` for clips S_g (G,); non-finite rows among
        the real (masked-in) records are reported in ``nonfinite`` and get factor 0."""
        # a NaN or Inf leaf makes its group's norm NaN or Inf (its weight is > 0, the squared
        # norms are >= 0), so checking the (B, G) norms checks every leaf
        norms = tf.sqrt(tf.matmul(sq_norms, tf.constant(self._weights, dtype=sq_norms.dtype)))
        finite = tf.reduce_all(tf.math.is_finite(norms), axis=1)
        clips = tf.cast(clips, norms.dtype)
        real = tf.ones_like(finite) if mask is None else tf.cast(mask, tf.bool)
        keep = tf.logical_and(finite, real)
        factors = tf.where(keep[:, None], clips / tf.maximum(norms, clips), tf.zeros_like(norms))
        return factors, tf.logical_and(tf.logical_not(finite), real)

    def leaf_factors(self, factors: tf.Tensor) -> dict[str, tf.Tensor]:
        """The (B,) factor that scales each leaf's per-record values."""
        columns = tf.unstack(factors, num=len(self.structure), axis=1)
        return {leaf: columns[g] for leaf, g in self.column.items()}


def standard_normal(generator: tf.random.Generator, n: int, dtype=tf.float32) -> tf.Tensor:
    """(n,) N(0, 1) samples by Box-Muller on the generator's Philox uniforms u, v in [0, 1):
    sqrt(-2 log(1 - u)) (cos 2 pi v, sin 2 pi v). TensorFlow's own normal kernel computes the
    same transform element by element; as vectorised ops it is faster on CPU (one core, the
    covertype MLP's 16,307 normals: ~0.15 instead of ~0.25 ms of its ~1.2 ms DP step). Tails
    reach sqrt(-2 log 2^-23) = 5.6 for float32 (TensorFlow's kernel: 5.7), 8.5 for float64.
    Under XLA TensorFlow's normal is faster (alone, 16,307 normals: 0.29 against 0.35 ms)."""
    if in_xla():
        return generator.normal([n], dtype=dtype)
    u, v = tf.unstack(generator.uniform([2, (n + 1) // 2], dtype=dtype))
    radius = tf.sqrt(-2.0 * tf.math.log1p(-u))
    angle = (2.0 * math.pi) * v
    return tf.concat([radius * tf.cos(angle), radius * tf.sin(angle)], 0)[:n]


def refuse_16_bit(names: Sequence[str], tensors: Sequence) -> None:
    """Refuse float16 and bfloat16 parameters (variables or tensors): their clipped sums and
    noise would be formed and rounded in that dtype, and a rounded sum of many records moves
    by more than the clip when one record leaves it (1.6 clips for a batch of 512 in
    bfloat16)."""
    for name, t in zip(names, tensors):
        dtype = tf.as_dtype(t.dtype)  # Keras variables name theirs
        if dtype in (tf.bfloat16, tf.float16):
            raise ValueError(
                f"parameter {name!r} is {dtype.name}: its clipped sum would be rounded to "
                f"{dtype.name} before the noise, and one record could move it by more than "
                f"its clip. Keep the variables in float32 and compute in 16 bits with "
                f"keras.mixed_precision.set_global_policy('mixed_{dtype.name}')")


def noisy_mean(sums: Mapping[str, tf.Tensor], leaves: Sequence[str], stds: tf.Tensor,
               noise: tf.random.Generator | tf.Tensor,
               expected_size: float, first=None) -> dict[str, tf.Tensor]:
    """``(sums[j] + stds[j] N(0, I)) / (q n)`` for the ``leaves`` (stds in that order, from
    :func:`leaf_stds_of`), in graph. ``noise`` is the generator of one draw of sum_j d_j
    normals (float64 if any leaf is, else float32) split into the leaves, or those normals
    themselves, drawn on the host (a secure aggregator's, :mod:`dpcore.secure`). ``first``, a
    bool tensor, keeps the noise where it is true (one replica of several whose results are
    added up) and leaves it out elsewhere.

    The caller must have written the step's sum-query events to the ledger before the result
    of the function that runs this is released."""
    if not expected_size > 0:
        raise ValueError(f"expected number of records q*n must be > 0, got {expected_size!r}")
    totals = [sums[leaf] for leaf in leaves]
    dtype = tf.float64 if any(t.dtype == tf.float64 for t in totals) else tf.float32
    sizes = [t.shape.num_elements() for t in totals]
    if isinstance(noise, tf.random.Generator):
        normals = standard_normal(noise, sum(sizes), dtype)
    elif noise.shape != [sum(sizes)]:
        raise ValueError(f"the step needs {sum(sizes)} normals, got a tensor of shape "
                         f"{noise.shape}")
    else:
        normals = tf.cast(noise, dtype)
    if first is not None:
        stds = tf.where(first, tf.cast(stds, tf.float64), tf.zeros_like(stds, tf.float64))
    scales = tf.unstack(tf.cast(stds / expected_size, dtype), num=len(leaves))
    out = {}
    for leaf, total, z, scale in zip(leaves, totals, tf.split(normals, sizes), scales):
        z, scale = tf.cast(tf.reshape(z, total.shape), total.dtype), tf.cast(scale, total.dtype)
        out[leaf] = total / expected_size + scale * z
    return out
