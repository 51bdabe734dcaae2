"""A check, before the first DP step, that a Keras model keeps the examples of the batch
apart.

The step (:mod:`.bookkeeping`) forms example i's gradient from row i of every tapped layer's
input and of the backprop dL/dz, L = sum_i m_i l_i, and the fallback's from row i of the
Jacobian of (m_i l_i)_i. That is example i's own gradient only if nothing mixes the rows: a
statistic of the batch in a Lambda or custom layer (``h - ops.mean(h, axis=0)``, with or
without ``stop_gradient``), inputs normalised by the batch, a reference row, a reordering or
pairing of the batch, a custom gradient that moves rows, a straight-through term, a loss
that normalises over the batch. Otherwise each "per-example" gradient carries other records'
data and clipping bounds nothing. Only a training BatchNormalization is refused by its type
(:func:`.layer_taps.check_per_example`); this check sees the rest, on the first BATCHES
batches with two real records or more (the second with the weights the first step moved:
mixing behind a zero-initialised head does nothing at first), by running the step's own
pass (compiled as the step is, without noise) on altered batches:

1. *Repeat*: the unchanged batch again must give the same results, or the model draws
   random numbers the check cannot replay (TensorFlow's global random ops). Every variable
   the pass may change (Keras seed generators, non-trainable variables, metrics and
   tf.Variables held by layers, tf.random.Generator states, weights the pass assigns, as
   Keras's SpectralNormalization its kernel) is restored before each run.
2. *Scaled losses*: with L = sum_i s_i m_i l_i, s_i random powers of two (exact in floating
   point), every example's squared gradient norm must scale by s_i^2, and the weighted
   sums sum_i (w_i / s_i) grad_i must not change (to 1e-6): example i's gradient reads its
   own loss only. Mixing of one pair of rows passes a scaling only if their factors agree:
   1 in 17 for each of the two scalings.
3. *Rerun*: the rows are split at random into halves, SPLITS times; for each half the pass
   runs again with every row of the other half replaced by the nearest real row of this
   half before it (after it, for rows before the first), so that inputs sorted by length
   stay sorted (targets and mask copied, floating inputs multiplied by FACTORS: a copy
   changes no statistic that every row shares, such as a maximum each image reaches). In
   this half's rows the losses, the model's outputs, every tapped layer's input and output
   (a layer whose weight is zero shows mixing in its input only), the squared gradient norms
   and a weighted sum of the gradients with random weights on this half must not change (to
   1e-5 of their norms).
   If a rerun leaves the variables otherwise than the pass did (a statistic of the batch
   kept in state), the batch runs once more from each: what it computes must not change,
   or later steps would read this batch's records (a running mean read before its update);
   a statistic that no pass reads (a metric) passes. One pair of rows mixed without
   gradient stays unseen if both rows fall in the same half in every split: 1 pair in 16
   (the splits are fixed for a batch size).

Rows are compared through statistics in float64: each row's projection on a fixed
pseudo-random direction, and its norm; rows whose norm is below FLOOR of the batch's largest
(gradients that underflow) are compared against that. Under float16 the tolerances are its
precision (its narrow range makes scaled gradients underflow). Training is the same with
the check and without it. Not seen: mixing below the tolerances (``h + 1e-7 * sum(h)``),
and mixing that only later batches or weights trigger.
"""

from __future__ import annotations

import hashlib

import numpy as np
import tensorflow as tf

from .bookkeeping import ClippedGradients
from .layer_taps import CrossExampleLayerError

SCALE_TOLERANCE = 1e-6
RERUN_TOLERANCE = 1e-5
FLOOR = 1e-6  # rows with norms below this fraction of the batch's largest are compared to it
SCALINGS = 2  # scaled-loss runs; factors 2^e, e uniform in -8..8
SPLITS = 4  # random splits of the batch into halves for the reruns
FACTORS = (1.0, 2.0, -1.0, 0.5)  # per split: the replaced rows' floating inputs, source times
BATCHES = 2  # checked batches: the first, and the next with the weights the first step moved
class NotPerExampleError(CrossExampleLayerError):
    """The model (or loss) makes one example's gradient depend on other examples."""


def _row_statistics(t: tf.Tensor, batch: int, seed: int) -> tf.Tensor:
    """(rows, 2) float64: each row's projection on a fixed pseudo-random direction and its
    norm; a tensor without the batch's rows on axis 0 is one row."""
    t = tf.cast(t, tf.float64)
    rows = batch if t.shape.rank and t.shape[0] == batch else 1
    flat = tf.reshape(t, [rows, -1])
    direction = tf.random.stateless_normal([tf.shape(flat)[1]], seed=[seed, 0],
                                           dtype=tf.float64)
    return tf.stack([tf.linalg.matvec(flat, direction), tf.norm(flat, axis=1)], axis=1)


def _vector_statistics(t: tf.Tensor, direction: tf.Tensor) -> tf.Tensor:
    """(2,) float64: the projection of ``t`` on ``direction`` and its norm."""
    flat = tf.reshape(tf.cast(t, tf.float64), [-1])
    return tf.stack([tf.tensordot(flat, direction, 1), tf.norm(flat)])


def _numeric(t) -> bool:
    return tf.is_tensor(t) and (t.dtype.is_floating or t.dtype.is_integer or t.dtype == tf.bool)


def _deviating(got: np.ndarray, want: np.ndarray, tolerance: float, norms: np.ndarray):
    """Rows where ``got`` differs from ``want`` (rows, k) by more than ``tolerance`` times
    ``norms`` (a NaN where the other has none differs): (rows, worst deviation, its norm)."""
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    with np.errstate(invalid="ignore"):  # inf - inf where one of two runs overflowed
        deviation = np.where(same, 0.0, np.abs(got - want)).max(axis=1)
    bad = ~(deviation <= tolerance * np.nan_to_num(norms))
    if not bad.any():
        return None
    worst = int(np.argmax(np.where(bad, np.nan_to_num(deviation, nan=np.inf), -1)))
    return np.flatnonzero(bad).tolist(), float(deviation[worst]), float(norms[worst])


class IndependenceCheck:
    """The check of the module doc for ``engine`` (a :class:`ClippedGradients`) and the
    per-example loss ``loss_fn``; ``done`` once BATCHES batches are checked."""

    def __init__(self, engine: ClippedGradients, loss_fn):
        self.engine, self.loss_fn = engine, loss_fn
        self.checked = 0  # batches checked
        self._checked_at = None  # the weights' hashes at the last check
        self._what: list[str] = []  # what each row statistic describes (set when traced)
        # traced as Keras traces a train step (no autograph, faster), or converted by
        # autograph, as PrivateGradients's step is, if the model or loss needs it
        self._statistics = tf.function(self._run, autograph=False)
        # float16's narrow range: values scaled by 2^-8 may fall below it (bfloat16 has
        # float32's); compare to its precision
        layers = engine.model._flatten_layers(include_self=True, recursive=True)
        self._floor = (float(np.finfo(np.float16).eps)
                       if any(layer.compute_dtype == "float16" for layer in layers) else 0.0)

    @property
    def done(self) -> bool:
        return self.checked >= BATCHES

    def _run(self, x, y, mask, scale, weights, directions):
        """One pass: row statistics of the losses, outputs and tapped calls; squared norms
        (B, L); the statistics (L, 2) of the sums sum_i w_i grad_i for the weights (B,),
        projected on ``directions`` (one per leaf, drawn once for all the runs); the shapes
        of the tensors of the row statistics."""
        run = self.engine.examples_pass(x, y, self.loss_fn, mask, scale)
        batch = run.losses.shape[0]
        entries = []  # in the order of the calls: the first to change is named
        for name, saved, z in run.calls:
            entries += [(f"the input of layer {name!r}", t) for t in tf.nest.flatten(saved)
                        if _numeric(t)]
            entries.append((f"the output of layer {name!r}", z))
        entries += [("the model's output", t) for t in tf.nest.flatten(run.outputs)
                    if _numeric(t)]
        entries.append(("the per-example loss", run.losses))
        self._what = [what for what, _ in entries]
        rows = [_row_statistics(t, batch, k) for k, (_, t) in enumerate(entries)]
        names = self.engine.names
        sq_norms = tf.stack([tf.cast(run.objects[leaf].sq_norms(), tf.float64)
                             for leaf in names], axis=1)
        sums = tf.stack([_vector_statistics(run.objects[leaf].weighted_sum(weights), direction)
                         for leaf, direction in zip(names, directions)])
        return rows, sq_norms, sums, [tf.shape(t) for _, t in entries]

    def __call__(self, x, y, mask=None) -> bool:
        """Check on the batch (eagerly, before its step); raise :class:`NotPerExampleError`
        if the model mixes its examples. True once BATCHES batches have been checked (one
        with fewer than two real records cannot mix any and is not counted)."""
        if self.done:
            return True
        batch = int(tf.shape(tf.nest.flatten(x)[0])[0])
        mask = (np.ones(batch, bool) if mask is None
                else np.asarray(tf.cast(mask, tf.bool)).reshape(batch))
        if mask.sum() < 2:
            return False
        weights = self._weights()
        if weights != self._checked_at:  # the check leaves the weights as they are
            self._check(x, y, mask, batch)
            self.checked, self._checked_at = self.checked + 1, weights
        return self.done

    def _weights(self) -> list[bytes]:
        """The trainable variables' values, hashed: the second check waits for them to move
        (a step whose update was not applied leaves them as they were)."""
        return [hashlib.sha1(v.numpy().tobytes()).digest() for v in self.engine.variables]

    def _check(self, x, y, mask, batch) -> None:
        rng = np.random.default_rng(batch)
        order = [rng.permutation(batch) for _ in range(SPLITS)]
        halves = [sorted(p[:(batch + 1) // 2].tolist()) for p in order]
        halves = [h for first in halves for h in (first, sorted(set(range(batch)) - set(first)))]
        every = list(range(batch))
        weights = np.zeros((len(halves) + 1, batch), np.float32)  # the halves', then all rows'
        for k, kept in enumerate(halves + [every]):
            weights[k, kept] = rng.uniform(0.5, 1.5, len(kept))
        ones = np.ones(batch, np.float32)
        directions = [tf.random.stateless_normal([int(np.prod(v.shape))], seed=[j, 1],
                                                 dtype=tf.float64)
                      for j, v in enumerate(self.engine.variables)]

        def inputs(x, y, mask, w, scale=ones):
            return x, y, mask, tf.constant(scale), tf.constant(w), directions

        try:
            concrete = self._statistics.get_concrete_function(*inputs(x, y, mask, weights[-1]))
        except tf.errors.OperatorNotAllowedInGraphError:  # Python control flow on tensors
            self._statistics = tf.function(self._run)
            concrete = self._statistics.get_concrete_function(*inputs(x, y, mask, weights[-1]))
        # every variable the pass may change: Keras seed generators and non-trainable
        # variables, metrics and tf.Variables held by layers, tf.random.Generator states, and
        # (found by the first run) weights it assigns
        state = [v for v in concrete.variables if not v.trainable]
        initial = [tf.identity(v) for v in state]

        def run(*args, start=initial):
            for variable, value in zip(state, start):
                variable.assign(value)
            rows, sq, sums, shapes = self._statistics(*inputs(*args))
            return ([r.numpy() for r in rows], sq.numpy(), sums.numpy(),
                    [v.numpy() for v in state], [tuple(s.numpy().tolist()) for s in shapes])

        trainable = [v for v in concrete.variables if v.trainable]
        before = [tf.identity(v) for v in trainable]
        try:
            first = run(x, y, mask, weights[-1])
            # and the weights the pass assigns (Keras's SpectralNormalization its kernel)
            for variable, value in zip(trainable, before):
                if not bool(tf.reduce_all(tf.equal(variable, value))):
                    state.append(variable)
                    initial.append(value)
                    first[3].append(variable.numpy())
            del before
            self._compare(first, run(x, y, mask, weights[-1]), every, RERUN_TOLERANCE,
                          "two runs on the same batch differ", repeat=True)
            for _ in range(SCALINGS):
                scale = np.exp2(rng.integers(-8, 9, batch)).astype(np.float32)
                self._compare(first, run(x, y, mask, weights[-1] / scale, scale), every,
                              SCALE_TOLERANCE, "when the losses were scaled per example",
                              scale=scale)
            left = None  # state a rerun left otherwise than the pass
            for k, (kept, w) in enumerate(zip(halves, weights)):
                index = _nearest(kept, mask)
                factor, targets = FACTORS[k // 2], tf.nest.map_structure(
                    _replacer(index, batch), y)
                try:
                    again = run(tf.nest.map_structure(_replacer(index, batch, factor), x),
                                targets, mask[index], w)
                except Exception:  # scaled inputs the model refuses (indices kept in floats)
                    if factor == 1:
                        raise
                    factor = 1.0
                    again = run(tf.nest.map_structure(_replacer(index, batch), x), targets,
                                mask[index], w)
                base = first[:2] + run(x, y, mask, w)[2:]
                replacement = "a copy of" if factor == 1 else f"{factor} times"
                self._compare(base, again, kept, RERUN_TOLERANCE,
                              f"when the examples other than {kept[:8]} of {batch} were "
                              f"replaced (by {replacement} one of them)")
                if left is None and _changed(first[3], again[3]):
                    left = again[3]
            if left is not None:
                # the state holds a statistic of the batch: does the next pass read it?
                names = [self._path(v) for v, a, b in zip(state, first[3], left)
                         if _changed([a], [b])]
                self._compare(run(x, y, mask, weights[-1], start=first[3]),
                              run(x, y, mask, weights[-1], start=left), every, RERUN_TOLERANCE,
                              f"when the batch ran again from the state {names[:4]} that a "
                              f"batch with other records left (a statistic of the batch kept "
                              f"for later steps)")
        finally:
            for variable, value in zip(state, initial):
                variable.assign(value)

    def _path(self, variable) -> str:
        """The Keras path of a captured variable, else its TensorFlow name."""
        paths = {v.value.ref(): v.path for v in self.engine.model.variables}
        return paths.get(variable.ref(), variable.name)

    def _compare(self, first, second, kept, tolerance, when: str, *, scale=None,
                 repeat: bool = False) -> None:
        """Raise if ``second``'s statistics differ from ``first``'s in rows ``kept``: the
        forward rows (unless the losses were scaled by ``scale``), the squared norms (times
        scale^2) and the weighted sums; ``repeat``: the same batch ran twice."""
        rows, sq, sums, _, shapes = first
        rows2, sq2, sums2, _, shapes2 = second
        tolerance = max(tolerance, self._floor)
        for what, shape, shape2 in zip(self._what, shapes, shapes2):
            if shape != shape2:
                raise NotPerExampleError(
                    f"the model mixes the examples of a batch: the shape of {what} changed "
                    f"from {shape} to {shape2} {when}. A shape that follows the batch "
                    f"(padding or trimming to its longest sequence) makes each example's "
                    f"computation depend on the others: pad to a fixed length (e.g. "
                    f"TextVectorization(output_sequence_length=T)); if the padding is masked "
                    f"out everywhere, pass check_independence=False")
        if scale is None:  # a scaling of the losses leaves the forward pass alone
            for what, want, got in zip(self._what, rows, rows2):
                picked = kept if len(want) == len(sq) else [0]
                self._expect(what, got[picked], want[picked], want[picked, 1], tolerance,
                             picked, when, repeat=repeat)
        want = sq if scale is None else sq * np.square(scale.astype(np.float64))[:, None]
        for j, leaf in enumerate(self.engine.names):
            self._expect(f"the squared gradient norm of {leaf!r}", sq2[kept, j:j + 1],
                         want[kept, j:j + 1], want[kept, j], 2 * tolerance, kept, when,
                         squared=True, repeat=repeat)
        for leaf, got, want in zip(self.engine.names, sums2, sums):
            self._expect(f"a weighted sum of the gradients of {leaf!r}", got[None],
                         want[None], want[None, 1], tolerance, None, when, repeat=repeat)

    @staticmethod
    def _expect(what: str, got, want, norms, tolerance: float, kept, when: str, *,
                squared: bool = False, repeat: bool = False) -> None:
        """Raise if ``got`` and ``want`` (rows, k) differ by more than ``tolerance`` of the
        rows' ``norms``, these raised to FLOOR of the largest (squared: FLOOR^2), so that
        rows near zero, which underflow, are not compared to their own rounding."""
        floor = FLOOR ** 2 if squared else FLOOR
        finite = np.abs(norms[np.isfinite(norms)])
        if finite.size:
            norms = np.maximum(norms, floor * finite.max())
        found = _deviating(got, want, tolerance, norms)
        if found is None:
            return
        rows, deviation, norm = found
        examples = [] if kept is None else [int(kept[r]) for r in rows][:8]
        where = f" in the rows of examples {examples}" if examples else ""
        if repeat:
            raise NotPerExampleError(
                f"dpcore cannot check that the model keeps the examples apart: {when} "
                f"({what}{where}, by {deviation:.3g} against {norm:.3g}). The model draws "
                f"random numbers dpcore cannot replay (TensorFlow's global random ops such as "
                f"tf.random.normal; Keras layers and keras.random with a SeedGenerator are "
                f"replayed), or computes something nondeterministic. Make it deterministic, "
                f"or pass check_independence=False")
        raise NotPerExampleError(
            f"the model mixes the examples of a batch: {what} changed{where} by "
            f"{deviation:.3g} (against a norm of {norm:.3g}) {when}. The cause may be a "
            f"statistic of the batch (h - ops.mean(h, axis=0), with or without "
            f"stop_gradient, inputs normalised by the batch), a reference row, a reordering or "
            f"pairing of the batch, a custom gradient that moves or rescales rows, a loss "
            f"computed over the batch, or a statistic of the batch kept in a variable (a "
            f"running mean) that later steps read. Each example's gradient would depend on "
            f"other records, and clipping would not bound it. Remove the mixing; if the "
            f"model's inputs have rows that are not the examples, or the statistic is kept "
            f"for monitoring only, pass check_independence=False")


def _nearest(kept, mask) -> np.ndarray:
    """For each row, itself if ``kept``, else the nearest kept real (``mask``) row before it
    (the first after it, for the rows before that one; any kept row if none is real)."""
    real = {i for i in kept if mask[i]} or set(kept)
    source, last = np.arange(len(mask)), min(real)
    for i in range(len(mask)):
        if i in real:
            last = i
        elif i not in kept:
            source[i] = last
    return source


def _changed(values, others) -> bool:
    """Whether any array of ``others`` differs from its match in ``values`` at all (runs from
    one state repeat bit for bit on the CPU; a count beside a mean must not hide it)."""
    return any(not np.array_equal(a, b, equal_nan=np.asarray(a).dtype.kind in "fc")
               for a, b in zip(values, others))


def _replacer(index: np.ndarray, batch: int, factor: float = 1.0):
    """Take the rows of every tensor with the batch's rows on axis 0 by ``index``, floating
    ones multiplied by ``factor`` where ``index`` moved them (a copy of one row changes no
    statistic that every row shares, such as a maximum every image reaches)."""
    moved = tf.constant(index != np.arange(batch))

    def replace(t):
        if tf.is_tensor(t) or isinstance(t, np.ndarray):
            t = tf.convert_to_tensor(t)
            if t.shape.rank and t.shape[0] == batch:
                rows = tf.gather(t, index)
                if factor != 1 and t.dtype.is_floating:
                    where = tf.reshape(moved, [batch] + [1] * (t.shape.rank - 1))
                    rows = tf.where(where, rows * tf.cast(factor, t.dtype), rows)
                return rows
        return t
    return replace
