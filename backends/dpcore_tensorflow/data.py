"""Poisson-sampled batches as a ``tf.data.Dataset``, padded to static shapes with a mask.

Every element is one Poisson sample (each record in it independently with probability q, so
the size is Binomial(n, q) and may be 0), drawn on the host by a dpcore
:class:`~dpcore.sampling.PoissonSampler`. To keep shapes static for the compiled step the
sample is padded with zero rows to ``capacity`` (by default q n + 4 sqrt(q n), rounded up to
a multiple of 8), or to the next multiple of it in the rare larger sample (never truncated:
dropping records would change the sampling the accountant prices). ``mask`` marks the real
rows; padded rows get clip factor 0, and averages divide by the public q n, never by the
sample size.
"""

from __future__ import annotations

import collections.abc
import math
import weakref
from typing import Sequence

import numpy as np
import tensorflow as tf

from dpcore import _validation as check
from dpcore.sampling import PoissonSampler

_SAMPLINGS = weakref.WeakKeyDictionary()  # dataset of poisson_dataset -> its sampler's (n, q)
_SEEDED = weakref.WeakSet()  # datasets of poisson_dataset(seed=...)
# tf.data's transformations that store the elements they pass and replay them when iterated
# again (.cache(), .snapshot(), tf.data.experimental.snapshot), by class name
REPLAYING = frozenset({"CacheDataset", "_SnapshotDataset", "_LegacySnapshotDataset"})
# ... and those that drop samples by their content (the steps taken would depend on the data)
# or cut and regroup records (batches that are not the samples drawn), by class name
REGROUPING = frozenset({
    "_FilterDataset", "_TakeWhileDataset", "_IgnoreErrorsDataset", "_UniqueDataset",
    "_BatchDataset", "_PaddedBatchDataset", "_UnbatchDataset", "_RebatchDataset",
    "_FlatMapDataset", "_InterleaveDataset", "_ParallelInterleaveDataset",
    "_GroupByWindowDataset", "_WindowDataset", "_ScanDataset"})


def default_capacity(n: int, q: float) -> int:
    """ceil(q n + 4 sqrt(q n)) rounded up to a multiple of 8 (a larger sample still fits, at
    the cost of one more trace)."""
    mean = q * n
    return max(8, 8 * math.ceil((mean + 4 * math.sqrt(mean)) / 8))


def padded(arrays: Sequence[np.ndarray], indices: np.ndarray, capacity: int):
    """``(*rows of every array, mask)`` padded with zeros to a multiple of ``capacity``."""
    size = capacity * max(1, math.ceil(len(indices) / capacity))
    out = []
    for a in arrays:
        rows = np.zeros((size, *a.shape[1:]), a.dtype)
        rows[:len(indices)] = a[indices]
        out.append(rows)
    mask = np.zeros(size, bool)
    mask[:len(indices)] = True
    return (*out, mask)


def poisson_dataset(x, y: np.ndarray, *, q: float | None = None, steps: int,
                    sampler: PoissonSampler | None = None, seed=None,
                    capacity: int | None = None) -> tf.data.Dataset:
    """``steps`` Poisson samples of the records (x[i], y[i]) as ``(x, y, mask)`` batches; ``x``
    an array or a structure of arrays (a dict for a model with several inputs).

    Give ``q`` (and optionally ``seed``), or a ``sampler`` (e.g. ``aggregator.sampler``, so the
    aggregator's seed drives sampling too). Keras's ``fit`` reads the mask as the sample
    weight slot; the private model uses it as the padding mask. The dataset is marked with
    the sampler's (n, q), which a private model's ``fit`` checks (:func:`samplings`).
    """
    if isinstance(y, collections.abc.Mapping) or (
            isinstance(y, (list, tuple)) and any(tf.is_tensor(t) or isinstance(t, np.ndarray)
                                                 for t in y)):
        raise ValueError(f"y must be one array of targets, got a {type(y).__name__} of them: a "
                         f"private model clips one loss per example. For several outputs, "
                         f"combine their losses in one loss function (of y and the outputs) "
                         f"and pass y as one array")
    x, y = tf.nest.map_structure(np.asarray, x), np.asarray(y)
    inputs = tf.nest.flatten(x)
    n = check.count("number of records", len(inputs[0]), minimum=1)
    if any(len(a) != n for a in inputs) or len(y) != n:
        raise ValueError(f"x has {[len(a) for a in inputs]} records and y has {len(y)}; "
                         f"they must match")
    if sampler is None:
        if q is None:
            raise ValueError("give the sampling rate q or a sampler")
        sampler = PoissonSampler(n, q, seed=seed)
    elif seed is not None:
        raise ValueError("give seed or sampler, not both: a given sampler is already seeded")
    elif sampler.n != n or (q is not None and q != sampler.q):
        raise ValueError(f"the sampler draws from n={sampler.n} records at q={sampler.q}; the "
                         f"data has n={n} records" + ("" if q is None else f" and q={q}"))
    steps = check.count("steps", steps, minimum=1)
    capacity = default_capacity(n, sampler.q) if capacity is None else check.count(
        "capacity", capacity, minimum=1)

    def samples():
        for _ in range(steps):
            *rows, labels, mask = padded((*inputs, y), sampler.sample(), capacity)
            yield tf.nest.pack_sequence_as(x, rows), labels, mask

    def spec(a):
        return tf.TensorSpec((None, *a.shape[1:]), tf.as_dtype(a.dtype))

    signature = (tf.nest.map_structure(spec, x), spec(y), tf.TensorSpec((None,), tf.bool))
    dataset = tf.data.Dataset.from_generator(samples, output_signature=signature)
    dataset = dataset.apply(tf.data.experimental.assert_cardinality(steps)).prefetch(2)
    _SAMPLINGS[dataset] = (sampler.n, sampler.q)
    if seed is not None:
        _SEEDED.add(dataset)
    return dataset


def samplings(dataset: tf.data.Dataset) -> set[tuple[int, float]]:
    """The (n, q) of every :func:`poisson_dataset` that ``dataset`` is made from (found by
    walking back through the datasets' inputs); empty if none."""
    return {_SAMPLINGS[d] for d in _walk(dataset) if d in _SAMPLINGS}


def seeded(dataset: tf.data.Dataset) -> bool:
    """Whether ``dataset`` is made from a :func:`poisson_dataset` of a sampler seeded apart
    from the aggregator's (``seed=``): every session it is made in draws the same samples."""
    return any(d in _SEEDED for d in _walk(dataset))


def transformations(dataset: tf.data.Dataset, names: frozenset) -> list[str]:
    """The class names, among ``names``, of the transformations between ``dataset`` and its
    :func:`poisson_dataset` sources."""
    return [type(d).__name__ for d in _walk(dataset) if type(d).__name__ in names]


def _walk(dataset: tf.data.Dataset):
    """``dataset`` and the datasets it is made from, back to the :func:`poisson_dataset`
    sources (not walked into) and the first datasets."""
    seen, todo = set(), [dataset]
    while todo:
        dataset = todo.pop()
        if id(dataset) in seen:
            continue
        seen.add(id(dataset))
        yield dataset
        if dataset not in _SAMPLINGS:
            todo.extend(dataset._inputs())
