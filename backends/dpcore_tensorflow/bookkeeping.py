"""Per-example gradient norms and clipped sums of a Keras model in one forward and one
backward pass (ghost norms + book-keeping), with a vectorized fallback.

For per-example losses l_i, padded rows masked out (m_i = 0), the step differentiates the
single scalar L = sum_i m_i l_i. Because no layer mixes examples, dL/dz_i = m_i dl_i/dz_i for
every tapped layer's pre-activation output z, so one backward pass gives every record's
output gradients; :mod:`.layer_grads` turns them and the saved inputs into per-example squared
norms and, once the clip factors c_i are known, into the clipped sums sum_i c_i grad_i.
Variables of layers without a tap get per-example gradients from the same tape by a
vectorized Jacobian of (m_i l_i)_i (pfor), then the same norms and sums.

``mode="vectorized"`` skips the taps and computes every per-example gradient with
``tf.vectorized_map`` over the model applied to one example at a time (the reference the
tests compare the ghost path with).
"""

from __future__ import annotations

import warnings
from typing import Callable, NamedTuple

import keras
import numpy as np
import tensorflow as tf

from . import layer_grads as lg
from . import layer_taps
from .kernels import GroupClipper

MODES = ("auto", "ghost", "materialise", "vectorized")


class FallbackWarning(UserWarning):
    """Some layers' per-example gradients take the vectorized fallback (slower)."""


def leaf_names(model: keras.layers.Layer) -> list[str]:
    """Leaf names of the model's trainable variables (their Keras paths), checked unique."""
    names = [v.path for v in model.trainable_variables]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"trainable variables share the paths {repeated}; give the layers "
                         f"unique names so every leaf has its own name")
    return names


def _cast(structure, dtype):
    """Every floating tensor of ``structure`` in ``dtype`` (indices and settings stay)."""
    def cast(t):
        if tf.is_tensor(t) and t.dtype.is_floating and t.dtype != dtype:
            return tf.cast(t, dtype)
        return t
    return tf.nest.map_structure(cast, structure)


def _unfed(plan, recorder, x, losses, traced: set[int] | None = None, *,
           warn: bool = True) -> set[int]:
    """The tapped layers (keys of ``plan``) whose output is not fed by the batch: every
    tapped call's output z must have the examples on axis 0, so that its backprop rows are
    the examples' own. A layer called on something the batch does not feed (positions from
    ``keras.ops.arange`` in a position embedding) gets the backprop summed over the
    examples instead, whatever its shape (T positions for a batch of T examples would pass a
    shape check). In a traced step such a z is unreachable in the graph from the inputs
    ``x`` (unless its input has the static shape of one of the inputs: a constant broadcast
    to the batch); its layer's variables then take the vectorized fallback. A fed z must have
    the batch's leading size. Eager tensors carry no graph: an eager step passes the keys
    found in its forward pass ``traced`` (:meth:`ClippedGradients._unfed_when_traced`)."""
    graph = traced is None
    inputs = [t for t in tf.nest.flatten(x) if tf.is_tensor(t)]
    fed = _fed_by(inputs) if graph else None
    shapes = {tuple(t.shape) for t in inputs if t.shape.is_fully_defined()}
    batch, unfed = losses.shape[0], set()
    for key, saves in recorder.saved.items():
        name = plan[key][0].name
        if graph and any(z.graph is not losses.graph for _, z in saves):
            raise ValueError(f"layer {name!r} is called inside TensorFlow control flow (a "
                             f"Keras RNN cell, unroll=False, runs in a tf.while_loop): the "
                             f"backprops of its calls there cannot be taken, and its "
                             f"gradients came out 0. Unroll the loop (RNN(..., unroll=True)) "
                             f"or call the layer outside it")
        if key in traced if not graph else any(
                z.op.name not in fed and not _batch_shaped(saved, shapes) for saved, z in saves):
            unfed.add(key)
            continue
        for _, z in saves:
            if batch is not None and z.shape.rank and z.shape[0] is not None:
                if z.shape[0] != batch:
                    raise ValueError(f"layer {name!r} gave an output of {z.shape[0]} rows for a "
                                     f"batch of {batch}: dpcore needs the examples on axis 0 "
                                     f"of every layer's input (or mode='vectorized')")
            elif z.shape.rank:
                tf.debugging.assert_equal(
                    tf.shape(z)[0], tf.shape(losses)[0],
                    message=f"layer {name!r}: the examples must be on axis 0 of its input")
    if unfed and warn:
        warnings.warn(f"layers {sorted(plan[key][0].name for key in unfed)} were called on a "
                      f"tensor the batch does not feed (e.g. positions from keras.ops.arange): "
                      f"their per-example gradients take the vectorized fallback (slow). "
                      f"Positions with one row per example, keras.ops.broadcast_to("
                      f"keras.ops.arange(length), keras.ops.shape(ids)), keep them tapped",
                      FallbackWarning, stacklevel=2)
    return unfed


def _batch_shaped(saved, shapes) -> bool:
    """Whether a call's input (first saved tensor) is a constant broadcast to the batch
    (positions ``broadcast_to(arange(T), (B, T))`` under static shapes), one row per example,
    which the graph cannot show fed: the full static shape, of two axes or more, of one of
    the step's inputs, and equal rows. (Positions (T,) of a model with a (B,) input and B = T
    would pass a one-axis comparison; a (T, T) table of relative positions, rows unequal,
    the shape of (B, T) ids when B = T.)"""
    first = tf.nest.flatten(saved)[0]
    if not (first.shape.rank is not None and first.shape.rank >= 2
            and first.shape.is_fully_defined() and tuple(first.shape) in shapes):
        return False
    if first.op.type == "BroadcastTo":  # along axis 0: from fewer axes, or from one row
        source = first.op.inputs[0].shape
        if source.rank is not None and (source.rank < first.shape.rank or source[0] == 1):
            return True
    value = tf.get_static_value(first)  # a constant TensorFlow can fold
    return value is not None and bool(np.all(value == value[:1]))


def _fed_by(inputs) -> set[str]:
    """Names of the graph operations that depend on any of the tensors ``inputs``."""
    fed, stack = set(), [t.op for t in inputs]
    while stack:
        op = stack.pop()
        if op.name in fed:
            continue
        fed.add(op.name)
        stack.extend(c for out in op.outputs for c in out.consumers())
    return fed


class Pass(NamedTuple):
    """What one forward and backward pass gave: gradient objects by leaf path, the
    per-example losses (B,), the model's outputs, the padding mask (B,), and every tapped
    call's saved input and output z, as (layer name, saved, z)."""

    objects: dict
    losses: tf.Tensor
    outputs: object
    mask: tf.Tensor
    calls: list


class ClippedGradients:
    """Clip factors and clipped sums of ``model``'s per-example gradients (see module doc).

    ``mode``: ``"auto"`` (per layer, ghost norm or materialised, whichever costs less),
    ``"ghost"``, ``"materialise"`` (force one kind for every tapped kernel) or
    ``"vectorized"`` (no taps)."""

    def __init__(self, model: keras.layers.Layer, mode: str = "auto"):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        layer_taps.check_per_example(model)
        layer_taps.check_no_regularizers(model)
        layer_taps.check_no_grouped_convolutions(model)
        self.model, self.mode = model, mode
        self.names = leaf_names(model)
        self.variables = list(model.trainable_variables)
        self.plan: dict[int, tuple] = {}
        self._traced: dict[tuple, set[int]] = {}  # _unfed_when_traced, by input signature
        if mode != "vectorized":
            for layer in model._flatten_layers(include_self=True, recursive=True):
                tap = layer_taps.tap_for(layer)
                if tap is not None:
                    self.plan[id(layer)] = (layer, tap)
        covered = {v.path for layer, tap in self.plan.values() for v in tap.variables(layer)}
        self.fallback = ([] if mode == "vectorized"
                         else [v for v in self.variables if v.path not in covered])
        if self.fallback:
            warnings.warn(f"per-example gradients of {[v.path for v in self.fallback]} take "
                          f"the vectorized fallback (no tap for their layers); expect a slower "
                          f"step", FallbackWarning, stacklevel=3)

    def _forward(self, x, y, loss_fn):
        outputs = self.model(x, training=True)
        losses = loss_fn(y, outputs)
        if losses.shape.rank != 1:
            raise ValueError(f"the per-example loss must have shape (B,), got shape "
                             f"{tuple(losses.shape)}; reduce every axis but the first")
        return losses, outputs

    def _grad_objects(self, x, y, loss_fn: Callable, mask: tf.Tensor, scale) -> Pass:
        """Forward pass under the taps and one backward pass of L = sum_i m_i s_i l_i (s =
        ``scale``, or 1). Per-example gradients the taps cannot form (variables of untapped
        layers, of layers the batch does not feed, and uses of a tapped variable outside its
        layer's call) take the vectorized Jacobian of (m_i s_i l_i)_i."""
        # persistent: the fallback's Jacobian needs the tape after the taps' gradient (in a
        # graph this keeps nothing more alive)
        with tf.GradientTape(persistent=True) as tape:
            recorder = layer_taps.Recorder(tape)
            with layer_taps.tapped(self.plan, recorder):
                losses, outputs = self._forward(x, y, loss_fn)
            weighted = losses if scale is None else losses * tf.cast(scale, losses.dtype)
            masked = tf.where(mask, weighted, tf.zeros_like(losses))
            total = tf.reduce_sum(masked)
        traced = self._unfed_when_traced(x, y, loss_fn) if tf.executing_eagerly() else None
        unfed = _unfed(self.plan, recorder, x, losses, traced)
        taps = [(key, z) for key, saves in recorder.saved.items() if key not in unfed
                for _, z in saves]
        # every tapped layer's variables, called or not (a layer never called may still have
        # its variable used directly)
        tapped = list({v.path: v for layer, tap in self.plan.values()
                       for v in tap.variables(layer)}.values())
        grads = tape.gradient(total, [z for _, z in taps] + tapped)
        by_layer: dict[int, list] = {}
        for (key, z), g in zip(taps, grads):
            by_layer.setdefault(key, []).append(tf.zeros_like(z) if g is None else g)
        # a gradient reaching a tapped variable itself: a use outside its layer's call
        outside = [v for v, g in zip(tapped, grads[len(taps):]) if g is not None]
        if outside:
            warnings.warn(f"variables {sorted(v.path for v in outside)} are used outside "
                          f"their layer's call (e.g. a weight tied by an op on "
                          f"layer.embeddings): that use's per-example gradients take the "
                          f"vectorized fallback (slow)", FallbackWarning, stacklevel=3)
        objects = {}
        kernel_mode = self.mode if self.mode in lg.MODES else "auto"
        for key, (layer, tap) in self.plan.items():
            if key in recorder.saved and key not in unfed:
                # under a mixed-precision policy, in the variables' dtype: the norms are then
                # those of the very gradients that are summed
                dtype = layer.variable_dtype
                saved = [_cast(s, dtype) for s, _ in recorder.saved[key]]
                gs = [_cast(g, dtype) for g in by_layer[key]]
                objects.update(tap.grads(layer, saved, gs, kernel_mode))
        # the fallback's sources, by variable: the variable itself, and the values that the
        # calls of layers the batch does not feed read it as
        sources = [(v.path, v) for v in self.fallback + outside]
        sources += [(v.path, value) for key in unfed for v, value in recorder.reads.get(key, ())
                    if v.trainable]
        if sources:
            jac = tape.jacobian(masked, [source for _, source in sources],
                                experimental_use_pfor=True,
                                unconnected_gradients=tf.UnconnectedGradients.ZERO)
            variables = {v.path: v for v in self.variables}
            rows: dict[str, tf.Tensor] = {}
            for (path, _), part in zip(sources, jac):
                part = _cast(part, variables[path].dtype)  # a read may be autocast
                rows[path] = part if path not in rows else rows[path] + part
            for path, part in rows.items():
                tapped_rows = objects[path].per_example() if path in objects else 0
                objects[path] = lg.Materialised(part + tapped_rows, variables[path].shape)
        batch = tf.shape(losses)[0]
        for v in self.variables:  # tapped layers the forward pass did not reach
            if v.path not in objects:
                objects[v.path] = lg.Materialised(tf.zeros((batch, *v.shape), v.dtype), v.shape)
        calls = [(self.plan[key][0].name, saved, z) for key, saves in recorder.saved.items()
                 for saved, z in saves]
        return Pass(objects, losses, outputs, mask, calls)

    def _unfed_when_traced(self, x, y, loss_fn: Callable) -> set[int]:
        """The keys of the tapped layers the batch does not feed, as a traced step finds them:
        the forward pass traced (not run) once per input signature. (Eager, only shapes were
        checked: positions arange(T) with T = B were clipped as examples, a record then
        moving the release by 3 to 8 clips.)"""
        specs = tf.nest.map_structure(
            lambda t: tf.TensorSpec.from_tensor(tf.convert_to_tensor(t))
            if tf.is_tensor(t) or isinstance(t, np.ndarray) else t, (x, y))
        key = (id(loss_fn), repr(specs))
        if key not in self._traced:
            found = {}

            def forward(x, y):
                with tf.GradientTape() as tape:
                    recorder = layer_taps.Recorder(tape)
                    with layer_taps.tapped(self.plan, recorder):
                        losses, _ = self._forward(x, y, loss_fn)
                found["unfed"] = _unfed(self.plan, recorder, x, losses, warn=False)
                return losses

            tf.function(forward).get_concrete_function(*specs)
            self._traced[key] = found["unfed"]
        return self._traced[key]

    def _vectorized_objects(self, x, y, loss_fn: Callable, mask: tf.Tensor):
        """Every variable's per-example gradients by the model on one example at a time."""
        def one(example):
            xi, yi = tf.nest.map_structure(lambda t: t[None], example)
            with tf.GradientTape() as tape:
                loss = self._forward(xi, yi, loss_fn)[0][0]
            return tape.gradient(loss, self.variables,
                                 unconnected_gradients=tf.UnconnectedGradients.ZERO)

        grads = tf.vectorized_map(one, (x, y))
        losses, outputs = self._forward(x, y, loss_fn)
        return Pass({v.path: lg.Materialised(g, v.shape) for v, g in zip(self.variables, grads)},
                    losses, outputs, mask, [])

    def examples_pass(self, x, y, loss_fn: Callable, mask=None, scale=None) -> Pass:
        """One pass over the batch: per-example gradient objects of ``loss_fn(y, model(x))
        -> (B,)`` (each example's loss scaled by ``scale`` (B,) if given; the vectorized mode
        takes none), losses, outputs and the tapped calls."""
        mask = (tf.ones([tf.shape(tf.nest.flatten(x)[0])[0]], tf.bool) if mask is None
                else tf.cast(mask, tf.bool))
        if self.mode == "vectorized":
            return self._vectorized_objects(x, y, loss_fn, mask)
        return self._grad_objects(x, y, loss_fn, mask, scale)

    def per_example_grads(self, x, y, loss_fn: Callable, mask=None) -> dict:
        """{path: (B, *shape)}: per-example gradients of ``loss_fn(y, model(x)) -> (B,)``
        for tests and inspection (the DP step never forms them all)."""
        objects = self.examples_pass(x, y, loss_fn, mask).objects
        return {name: objects[name].per_example() for name in self.names}

    def clipped_sums(self, x, y, loss_fn: Callable, clipper: GroupClipper, clips: tf.Tensor,
                     mask=None):
        """``(sums {path: tensor}, nonfinite (B,), losses (B,), outputs)``: sum_i c_i grad_i
        with c the clip factors of ``clipper`` for clips S_g (0 for masked-out and
        non-finite rows)."""
        objects, losses, outputs, mask, _ = self.examples_pass(x, y, loss_fn, mask)
        sq_norms = tf.stack([objects[leaf].sq_norms() for leaf in clipper.leaves], axis=1)
        factors, bad = clipper.factors(sq_norms, clips, mask)
        weights = clipper.leaf_factors(factors)
        sums = {leaf: objects[leaf].weighted_sum(weights[leaf]) for leaf in clipper.leaves}
        return sums, bad, losses, outputs
