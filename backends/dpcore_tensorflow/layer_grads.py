"""Per-example gradient norms and clipped sums of one layer from what its forward pass saved.

A layer whose pre-activation output is z = f(a, theta) saves its input in a canonical form
and receives g = dL/dz from the step's single backward pass. With examples i, positions t
(sequence steps, pixels, tokens; T of them), inputs a_it in R^{d_in} and output gradients
g_it in R^{d_out}, the kernel's per-example gradient of a dense-like layer is

    G_i = sum_t a_it g_it^T                                  (d_in x d_out)

and its squared norm can be had two ways (mixed ghost clipping picks the cheaper per layer):

* **ghost norm**: ||G_i||_F^2 = sum_{t,s} (a_it . a_is)(g_it . g_is), cost ~ T^2 (d_in + d_out)
  per example and no d_in x d_out tensor (for T = 1 simply ||a_i||^2 ||g_i||^2);
* **materialised**: form G_i, cost ~ T d_in d_out per example and B d_in d_out memory.

The clipped sum is **book-keeping**: sum_i c_i G_i = sum_{i,t} a_it (c_i g_it)^T, i.e. the
layer's ordinary weight gradient with the output gradients rescaled by the clip factors c_i,
so no second backward pass is needed. Biases get sum_t g_it (B x d_out, always cheap).
Embeddings (ids k_it): G_i = sum_t e_{k_it} g_it^T, nonzero only in the rows example i looks
up: ||G_i||^2 = sum_v ||sum_{t: k_it = v} g_it||^2 (B T d; the ghost identity
sum_{t,s} [k_it = k_is] (g_it . g_is) costs B T^2, the dense G_i B V d). LayerNormalization
(normalised input xhat): the scale's gradient is sum_t xhat_it * g_it and the offset's
sum_t g_it.
"""

from __future__ import annotations

import string

import numpy as np
import tensorflow as tf

from dpcore.rounding import ghost_margin, sum_margin


MODES = ("auto", "ghost", "materialise")


def ghost_is_cheaper(positions: int | None, d_in: int, d_out: int) -> bool:
    """Whether the ghost norm (T^2 (d_in + d_out)) costs less than materialising
    (T d_in d_out) for one example; an unknown T counts as expensive for ghost norms."""
    if positions is None:
        return False
    return positions * positions * (d_in + d_out) < positions * d_in * d_out


def _column(weights: tf.Tensor, like: tf.Tensor, axis: int = 0) -> tf.Tensor:
    """The (B,) weights shaped to broadcast along ``axis`` (the batch axis) of ``like``."""
    shape = [1] * like.shape.rank
    shape[axis] = -1
    return tf.reshape(tf.cast(weights, like.dtype), shape)


def scaled(g: tf.Tensor, weights: tf.Tensor, axis: int = 0) -> tf.Tensor:
    """c_i g_i (batch on ``axis``), exactly 0 for rows with c_i = 0 (padded or dropped records,
    whose g may hold NaN: 0 * NaN is NaN, ``multiply_no_nan`` gives 0)."""
    return tf.math.multiply_no_nan(g, _column(weights, g, axis))


def weighted_rows(per_example: tf.Tensor, weights: tf.Tensor, axis: int = 0) -> tf.Tensor:
    """sum_i c_i P_i for materialised per-example values P (batch on ``axis``)."""
    return tf.reduce_sum(scaled(per_example, weights, axis), axis=axis)


def finite_rows(t: tf.Tensor, sq_norms: tf.Tensor, axis: int = 0) -> tf.Tensor:
    """``t`` with the rows (batch on ``axis``) of records whose squared norm is not finite set
    to 0, so that a product with their factor c_i = 0 stays 0 (0 * NaN is NaN in a matmul);
    the zeroing runs only when some record is non-finite."""
    finite = tf.math.is_finite(sq_norms)
    return tf.cond(tf.reduce_all(finite), lambda: t,
                   lambda: tf.where(_column(finite, t, axis) > 0, t, tf.zeros_like(t)))


def in_xla() -> bool:
    """Whether the graph being built is compiled by XLA (``jit_compile``)."""
    try:  # a private module: without it, assume not
        from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext
    except ImportError:  # pragma: no cover
        return False
    return GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def wide(t: tf.Tensor) -> tf.Tensor:
    """``t`` in float32 at least: 16-bit ghost norms would round too coarsely for their bound
    (its margin grows with the machine epsilon) to stay small."""
    return tf.cast(t, tf.float32) if t.dtype in (tf.float16, tf.bfloat16) else t


def _margin(width: int, t: tf.Tensor):
    """:func:`dpcore.rounding.ghost_margin` for ``t`` (B, T, ...) of float32 or float64."""
    positions = t.shape[1]
    if positions is None:
        positions = tf.cast(tf.shape(t)[1], t.dtype)
    return ghost_margin(width, positions, np.finfo(t.dtype.as_numpy_dtype).eps)


def ghost_sum(products: tf.Tensor, width: int) -> tf.Tensor:
    """Ghost squared norms (B,) from the products (B, T, T) of the Gram matrices (of total
    width ``width``), plus the bound on their rounding of :mod:`dpcore.rounding` (never below
    the exact squared norms). Summed over s, then t; under XLA a barrier keeps the two sums
    from being merged into one over T^2 terms, whose order the bound cannot know."""
    bound = tf.square(tf.reduce_sum(tf.sqrt(tf.linalg.diag_part(products)), axis=1))
    margin = _margin(width, products)
    rows = tf.reduce_sum(products, axis=2)
    if in_xla():
        from tensorflow.compiler.tf2xla.python.xla import optimization_barrier
        (rows,) = optimization_barrier(rows)
    return tf.reduce_sum(rows, axis=1) + margin * bound


def row_sq_norms(per_example: tf.Tensor) -> tf.Tensor:
    """(B,) squared norms of the rows of (B, ...): by TensorFlow's one-pass norm op (square
    and sum are two ops and a (B, ...) temporary), under XLA (no norm op; it fuses) by both."""
    rows = tf.reshape(per_example, [tf.shape(per_example)[0], -1])
    if in_xla():
        return tf.reduce_sum(tf.square(rows), axis=1)
    return tf.square(tf.math.reduce_euclidean_norm(rows, axis=1))


class Materialised:
    """A parameter whose per-example gradients (B, *shape) are cheap to form (biases,
    normalisation scales and offsets); ``sq_norms`` if their squared norms are known."""

    def __init__(self, per_example: tf.Tensor, shape, sq_norms: tf.Tensor | None = None):
        self.shape = tuple(shape)
        self._rows, self._sq_norms = per_example, sq_norms

    def sq_norms(self) -> tf.Tensor:
        return row_sq_norms(self._rows) if self._sq_norms is None else self._sq_norms

    def weighted_sum(self, weights: tf.Tensor) -> tf.Tensor:
        return tf.reshape(weighted_rows(self._rows, weights), self.shape)

    def per_example(self) -> tf.Tensor:
        return tf.reshape(self._rows, (-1, *self.shape))


class DenseKernel:
    """The kernel of a layer seen as a (B, T, d_in) -> (B, T, d_out) matmul (Dense, EinsumDense,
    Conv on patches). Its d_in x d_out gradient is reshaped to ``shape`` and then transposed
    by ``perm`` (EinsumDense kernels whose axes are not in (contracted, output) order).
    ``mode``: ``"ghost"``, ``"materialise"`` or ``"auto"`` (the cheaper, :func:`ghost_is_cheaper`).
    ``g_sq``: ||g_i||^2 if known (T = 1, where it is also the bias's squared norm)."""

    def __init__(self, a: tf.Tensor, g: tf.Tensor, shape, *, perm=None, mode: str = "auto",
                 g_sq: tf.Tensor | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.a, self.g, self.shape, self.perm, self._g_sq = a, g, tuple(shape), perm, g_sq
        self.ghost = (mode == "ghost" or mode == "auto"
                      and ghost_is_cheaper(g.shape[1], a.shape[2], g.shape[2]))
        self._rows = None if self.ghost else tf.einsum("bti,bto->bio", a, g)
        self._sq = None

    def _arrange(self, kernel: tf.Tensor, batched: bool) -> tf.Tensor:
        kernel = tf.reshape(kernel, ((-1,) if batched else ()) + self.shape)
        if self.perm is None:
            return kernel
        return tf.transpose(kernel, ([0] + [p + 1 for p in self.perm]) if batched else self.perm)

    def sq_norms(self) -> tf.Tensor:
        if self._sq is None:
            self._sq = self._compute_sq_norms()
        return self._sq

    def _compute_sq_norms(self) -> tf.Tensor:
        if not self.ghost:
            return row_sq_norms(self._rows)
        if self.a.shape[1] == 1:
            g_sq = row_sq_norms(self.g) if self._g_sq is None else self._g_sq
            return row_sq_norms(self.a) * g_sq
        a, g = wide(self.a), wide(self.g)
        aa = tf.matmul(a, a, transpose_b=True)
        gg = tf.matmul(g, g, transpose_b=True)
        return ghost_sum(aa * gg, a.shape[2] + g.shape[2])

    def weighted_sum(self, weights: tf.Tensor) -> tf.Tensor:
        if self._rows is not None:
            return self._arrange(weighted_rows(self._rows, weights), False)
        # sum_{i,t} a_it (c_i g_it)^T: one (B T, d_in)^T (B T, d_out) matmul; a dropped
        # record's non-finite a_i is zeroed (its norm is then non-finite too)
        a = finite_rows(self.a, self.sq_norms())
        a, d_out = tf.reshape(a, [-1, self.a.shape[2]]), self.g.shape[2]
        if self.g.shape[1] == 1:  # the same c_i g_i as a Dense bias's (one op after CSE)
            g = scaled(tf.reshape(self.g, [-1, d_out]), weights)
        else:
            g = tf.reshape(scaled(self.g, weights), [-1, d_out])
        return self._arrange(tf.matmul(a, g, transpose_a=True), False)

    def per_example(self) -> tf.Tensor:
        rows = self._rows if self._rows is not None else tf.einsum("bti,bto->bio", self.a, self.g)
        return self._arrange(rows, True)


class ConvKernel:
    """A convolution kernel whose per-example gradients G_i come as one (K, B, C_out) tensor,
    K = k_h k_w C_in (from TensorFlow's filter-gradient op on the batch folded into channel
    groups, see :class:`~.layer_taps.ConvTap`). Neither step forms a (K, B, C_out)
    temporary: ||G_i||^2 = sum_o ||G_i[:, o]||^2 from one norm op over K, and sum_i c_i G_i
    is K (1, B) x (B, C_out) matmuls (for the MNIST CNN's second conv, alone: 0.29 ms against
    0.58 for a scaled copy and a sum); rows of records with non-finite norms (c_i = 0, maybe
    NaN) are zeroed first, only when there are any."""

    def __init__(self, rows: tf.Tensor, shape):
        self.rows, self.shape = rows, tuple(shape)
        self._sq = None

    def sq_norms(self) -> tf.Tensor:
        if self._sq is None:
            k, c_out = self.rows.shape[0], self.rows.shape[2]
            columns = tf.math.reduce_euclidean_norm(tf.reshape(self.rows, [k, -1]), axis=0)
            self._sq = tf.reduce_sum(tf.reshape(tf.square(columns), [-1, c_out]), axis=1)
        return self._sq

    def weighted_sum(self, weights: tf.Tensor) -> tf.Tensor:
        rows = finite_rows(self.rows, self.sq_norms(), axis=1)
        c = tf.cast(weights, rows.dtype)[None, None, :]
        total = tf.matmul(tf.broadcast_to(c, [self.rows.shape[0], 1, tf.shape(c)[2]]), rows)
        return tf.reshape(total, self.shape)

    def per_example(self) -> tf.Tensor:
        return tf.reshape(tf.transpose(self.rows, [1, 0, 2]), (-1, *self.shape))


class EmbeddingTable:
    """Embedding table (V x d) from ids (B, T) and output gradients (B, T, d). ``"auto"``
    takes the norms from the rows each example touches (:meth:`touched_rows_sq_norms`, B T d),
    ``"ghost"`` from the ghost identity (B T^2), ``"materialise"`` from the rows of the
    dense (B, V, d) per-example gradients (:meth:`per_example`), summed as one segment sum
    over B V segments."""

    def __init__(self, ids: tf.Tensor, g: tf.Tensor, vocabulary: int, *, mode: str = "auto"):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.ids, self.g, self.vocabulary = tf.cast(ids, tf.int32), g, vocabulary
        self.mode = mode

    def per_example(self) -> tf.Tensor:
        batch, width = tf.shape(self.g)[0], self.g.shape[2]
        rows = self.ids + self.vocabulary * tf.range(batch)[:, None]
        flat = tf.math.unsorted_segment_sum(tf.reshape(self.g, [-1, width]),
                                            tf.reshape(rows, [-1]), batch * self.vocabulary)
        return tf.reshape(flat, [batch, self.vocabulary, width])

    def touched_rows_sq_norms(self) -> tf.Tensor:
        """||G_i||^2 = sum_v ||sum_{t: k_it = v} g_it||^2: each example's ids sorted, the
        backprop rows summed per run of equal ids (one segment sum over at most B T
        segments: static shapes, so it also compiles under XLA), the sums squared."""
        batch, positions = tf.shape(self.g)[0], tf.shape(self.g)[1]
        order = tf.argsort(self.ids, axis=1, stable=True)
        ids = tf.gather(self.ids, order, batch_dims=1)
        starts = tf.not_equal(ids, tf.concat([ids[:, :1] - 1, ids[:, :-1]], 1))
        runs = (tf.cumsum(tf.cast(starts, tf.int32), axis=1) - 1
                + positions * tf.range(batch)[:, None])
        return self._summed_rows_sq_norms(tf.gather(self.g, order, batch_dims=1), runs,
                                          batch * positions)

    def _summed_rows_sq_norms(self, g, segments, count) -> tf.Tensor:
        """sum over an example's segments of ||sum of its rows of g||^2, the rows summed per
        segment (ids (B, T) into ``count`` segments, example-major). The clipped sum adds the
        rows in another order, so each segment's norm gets the bound of :mod:`dpcore.rounding`
        on the rounding of a sum of rows (:func:`dpcore.rounding.sum_margin`)."""
        g = wide(g)
        segments = tf.reshape(segments, [-1])
        sums = tf.math.unsorted_segment_sum(tf.reshape(g, [-1, g.shape[2]]), segments, count)
        norms = tf.reshape(tf.norm(g, axis=2), [-1])
        spans = tf.math.unsorted_segment_sum(norms, segments, count)
        counts = tf.math.unsorted_segment_sum(tf.ones_like(norms), segments, count)
        margins = sum_margin(g.shape[2], counts, np.finfo(g.dtype.as_numpy_dtype).eps)
        bounded = tf.square(tf.norm(sums, axis=1) + margins * spans)
        return tf.reduce_sum(tf.reshape(bounded, [tf.shape(g)[0], -1]), 1)

    def sq_norms(self) -> tf.Tensor:
        if self.mode == "auto":
            return self.touched_rows_sq_norms()
        if self.mode == "materialise":  # the dense rows of per_example(), with the bound
            rows = self.ids + self.vocabulary * tf.range(tf.shape(self.g)[0])[:, None]
            return self._summed_rows_sq_norms(self.g, rows,
                                              tf.shape(self.g)[0] * self.vocabulary)
        g = wide(self.g)
        same = tf.equal(self.ids[:, :, None], self.ids[:, None, :])
        gg = tf.matmul(g, g, transpose_b=True)
        return ghost_sum(tf.where(same, gg, tf.zeros_like(gg)), g.shape[2])

    def weighted_sum(self, weights: tf.Tensor) -> tf.Tensor:
        width = self.g.shape[2]
        return tf.math.unsorted_segment_sum(tf.reshape(scaled(self.g, weights), [-1, width]),
                                            tf.reshape(self.ids, [-1]), self.vocabulary)


def einsum_letters(count: int, avoid: str) -> str:
    """``count`` letters not in ``avoid`` (to spell out an einsum ellipsis)."""
    free = [c for c in string.ascii_letters if c not in avoid]
    if count > len(free):
        raise ValueError(f"cannot spell an einsum ellipsis of {count} axes")
    return "".join(free[:count])
