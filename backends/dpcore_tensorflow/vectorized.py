"""Vectorized per-example gradients of a functional loss, for any model or layer.

For ``loss_fn(params, batch) -> (B,)`` and example i, the per-example gradient is

    grad_i = d loss_fn(params, batch_i)[0] / d params,

where ``batch_i`` is example i with a leading axis of 1 (a batch of one, so layers that expect
a batch axis work unchanged). ``tf.vectorized_map`` turns the one-example gradient into one
vectorized computation over the batch (pfor), instead of B separate backward passes. Memory is
B times the parameters; the ghost-norm path (:mod:`.bookkeeping`) avoids that where it can.
"""

from __future__ import annotations

from typing import Callable, Sequence

import tensorflow as tf


def batch_size(batch) -> int | tf.Tensor:
    """The common leading (example) size of every tensor in ``batch`` (a nest)."""
    leaves = [t for t in tf.nest.flatten(batch) if isinstance(t, (tf.Tensor, tf.Variable))]
    if not leaves:
        raise ValueError("the batch holds no tensors; expected tensors with the examples on axis 0")
    sizes = {t.shape[0] for t in leaves}
    if len(sizes) != 1:
        raise ValueError(f"every tensor of the batch needs the same leading (example) size, got "
                         f"sizes {sorted(sizes, key=str)}")
    size = sizes.pop()
    return tf.shape(leaves[0])[0] if size is None else size


def per_example_grads(loss_fn: Callable, names: Sequence[str], values: Sequence[tf.Tensor],
                      batch) -> list[tf.Tensor]:
    """Per-example gradients ``[(B, *shape) for each value]`` of ``loss_fn(dict(names ->
    values), batch)``; call inside ``tf.function``. Parameters the loss does not use get zeros."""
    values = list(values)

    def one(example):
        example = tf.nest.map_structure(lambda t: t[None], example)
        with tf.GradientTape() as tape:
            tape.watch(values)
            losses = loss_fn(dict(zip(names, values)), example)
            if losses.shape.rank != 1 or losses.shape[0] not in (1, None):
                raise ValueError(f"loss_fn must return one loss per example, shape (B,); on a "
                                 f"batch of one it returned shape {tuple(losses.shape)}")
            loss = losses[0]
        return tape.gradient(loss, values,
                             unconnected_gradients=tf.UnconnectedGradients.ZERO)

    return tf.vectorized_map(one, batch)


def sq_norms(grads: Sequence[tf.Tensor]) -> tf.Tensor:
    """``(B, L)``: the squared L2 norm of every example's gradient of every leaf."""
    return tf.stack([tf.reduce_sum(tf.reshape(tf.square(g), [tf.shape(g)[0], -1]), axis=1)
                     for g in grads], axis=1)


def weighted_sum(grads: Sequence[tf.Tensor], weights: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """``sum_i w_i grad_i`` for every leaf; rows with weight 0 contribute exactly 0 even when
    their gradient holds NaN or Inf (padded or dropped records)."""
    out = []
    for g, w in zip(grads, weights):
        keep = tf.reshape(w > 0, [-1] + [1] * (g.shape.rank - 1))
        g = tf.where(keep, g, tf.zeros_like(g))
        out.append(tf.tensordot(tf.cast(w, g.dtype), g, axes=1))
    return out
