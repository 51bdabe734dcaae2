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
(:func:`.layer_taps.check_per_example`); this check sees the rest, on the first batch with
two real records or more, by running the step's own pass (compiled as the step is, without
noise) on altered batches:

1. *Repeat*: the unchanged batch again must give the same results, or the model draws
   random numbers the check cannot replay (TensorFlow's global random ops; Keras's seed
   generators and every non-trainable variable are restored before each run).
2. *Scaled losses*: with L = sum_i s_i m_i l_i, s_i random powers of two (exact in floating
   point), every example's squared gradient norm must scale by s_i^2, and the weighted
   sums sum_i (w_i / s_i) grad_i must not change (to 1e-6): example i's gradient reads its
   own loss only. Mixing of one pair of rows passes a scaling only if their factors agree:
   1 in 17 for each of the two scalings.
3. *Rerun*: the rows are split at random into halves, SPLITS times; for each half the pass
   runs again with every row of the other half (inputs, targets, mask) replaced by one row
   of this half. In this half's rows the losses, the model's outputs, every tapped layer's
   input and output (a layer whose weight is zero shows mixing in its input only), the
   squared gradient norms and a weighted sum of the gradients with random weights on this
   half must not change (to 1e-5 of their norms). One pair of rows mixed without gradient
   stays unseen if both rows fall in the same half in every split: 1 pair in 16 (the
   splits are fixed for a batch size).

Rows are compared through statistics in float64: each row's projection on a fixed
pseudo-random direction, and its norm. What the runs change (seed generators, non-trainable
variables) is restored afterwards, so training is the same with the check and without it.
Not seen: mixing that only later batches trigger.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from .bookkeeping import ClippedGradients
from .layer_taps import CrossExampleLayerError

SCALE_TOLERANCE = 1e-6
RERUN_TOLERANCE = 1e-5
SCALINGS = 2  # scaled-loss runs; factors 2^e, e uniform in -8..8
SPLITS = 4  # random splits of the batch into halves for the reruns
_REPEAT = "two runs on the same batch differ"


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
    per-example loss ``loss_fn``; ``done`` once it has run."""

    def __init__(self, engine: ClippedGradients, loss_fn):
        self.engine, self.loss_fn = engine, loss_fn
        self.done = False
        self._what: list[str] = []  # what each row statistic describes (set when traced)
        self._statistics = tf.function(self._run, autograph=False)  # as Keras traces steps

    def _run(self, x, y, mask, scale, weights, directions):
        """One pass: row statistics of the losses, outputs and tapped calls; squared norms
        (B, L); the statistics (L, 2) of the sums sum_i w_i grad_i for the weights (B,),
        projected on ``directions`` (one per leaf, drawn once for all the runs)."""
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
        return rows, sq_norms, sums

    def __call__(self, x, y, mask=None) -> bool:
        """Check on the batch (eagerly, before its step); raise :class:`NotPerExampleError`
        if the model mixes its examples. True once the check has run (a batch with fewer than
        two real records cannot mix any: the next one is checked)."""
        if self.done:
            return True
        batch = int(tf.shape(tf.nest.flatten(x)[0])[0])
        mask = (np.ones(batch, bool) if mask is None
                else np.asarray(tf.cast(mask, tf.bool)).reshape(batch))
        if mask.sum() < 2:
            return False
        state = [(v, tf.identity(v.value)) for v in self.engine.model.non_trainable_variables]
        try:
            self._check(x, y, mask, batch, state)
        finally:
            _restore(state)
        self.done = True
        return True

    def _check(self, x, y, mask, batch, state) -> None:
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

        def run(x, y, mask, w, scale=ones):
            _restore(state)
            rows, sq, sums = self._statistics(x, y, mask, tf.constant(scale), tf.constant(w),
                                              directions)
            return [r.numpy() for r in rows], sq.numpy(), sums.numpy()

        rows, sq, sums = run(x, y, mask, weights[-1])
        self._compare((rows, sq, sums), run(x, y, mask, weights[-1]), every, RERUN_TOLERANCE,
                      _REPEAT)
        for _ in range(SCALINGS):
            scale = np.exp2(rng.integers(-8, 9, batch)).astype(np.float32)
            self._compare((rows, sq, sums), run(x, y, mask, weights[-1] / scale, scale),
                          every, SCALE_TOLERANCE, "the losses were scaled per example",
                          scale=scale)
        for kept, w in zip(halves, weights):
            source = next((i for i in kept if mask[i]), kept[0])
            index = np.array([i if i in kept else source for i in range(batch)])
            gather = _gatherer(index, batch)
            first = rows, sq, run(x, y, mask, w)[2]
            again = run(tf.nest.map_structure(gather, x), tf.nest.map_structure(gather, y),
                        mask[index], w)
            self._compare(first, again, kept, RERUN_TOLERANCE,
                          f"the examples other than {kept[:8]} of {batch} were replaced")

    def _compare(self, first, second, kept, tolerance, when: str, scale=None) -> None:
        """Raise if ``second``'s statistics differ from ``first``'s in rows ``kept``: the
        forward rows (unless the losses were scaled by ``scale``), the squared norms (times
        scale^2) and the weighted sums."""
        rows, sq, sums = first
        rows2, sq2, sums2 = second
        if scale is None:  # a scaling of the losses leaves the forward pass alone
            for what, want, got in zip(self._what, rows, rows2):
                picked = kept if len(want) == len(sq) else [0]
                self._expect(what, got[picked], want[picked], want[picked, 1], tolerance,
                             picked, when)
        want = sq if scale is None else sq * np.square(scale.astype(np.float64))[:, None]
        for j, leaf in enumerate(self.engine.names):
            self._expect(f"the squared gradient norm of {leaf!r}", sq2[kept, j:j + 1],
                         want[kept, j:j + 1], want[kept, j], 2 * tolerance, kept, when)
        for leaf, got, want in zip(self.engine.names, sums2, sums):
            self._expect(f"a weighted sum of the gradients of {leaf!r}", got[None],
                         want[None], want[None, 1], tolerance, None, when)

    @staticmethod
    def _expect(what: str, got, want, norms, tolerance: float, kept, when: str) -> None:
        found = _deviating(got, want, tolerance, norms)
        if found is None:
            return
        rows, deviation, norm = found
        examples = [] if kept is None else [int(kept[r]) for r in rows][:8]
        where = f" in the rows of examples {examples}" if examples else ""
        if when == _REPEAT:
            raise NotPerExampleError(
                f"dpcore cannot check that the model keeps the examples apart: {when} "
                f"({what}{where}, by {deviation:.3g} against {norm:.3g}). The model draws "
                f"random numbers dpcore cannot replay (TensorFlow's global random ops such as "
                f"tf.random.normal; Keras layers and keras.random with a SeedGenerator are "
                f"replayed), or computes something nondeterministic. Make it deterministic, "
                f"or pass check_independence=False")
        raise NotPerExampleError(
            f"the model mixes the examples of a batch: {what} changed{where} by "
            f"{deviation:.3g} (against a norm of {norm:.3g}) when {when}. The cause may be a "
            f"statistic of the batch (h - ops.mean(h, axis=0), with or without "
            f"stop_gradient, inputs normalised by the batch), a reference row, a reordering or "
            f"pairing of the batch, a custom gradient that moves or rescales rows, or a loss "
            f"computed over the batch. Each example's gradient would depend on the others, "
            f"and clipping would not bound it. Remove the mixing; if the model's inputs have "
            f"rows that are not the examples, pass check_independence=False")


def _restore(state) -> None:
    for variable, value in state:
        variable.assign(value)


def _gatherer(index: np.ndarray, batch: int):
    """Replace the rows of every tensor with the batch's rows on axis 0 by ``index``."""
    def gather(t):
        if tf.is_tensor(t) or isinstance(t, np.ndarray):
            t = tf.convert_to_tensor(t)
            if t.shape.rank and t.shape[0] == batch:
                return tf.gather(t, index)
        return t
    return gather
