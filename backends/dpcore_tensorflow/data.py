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

_SAMPLERS = weakref.WeakKeyDictionary()  # dataset of poisson_dataset -> its sampler
# tf.data's transformations that store the elements they pass and replay them when iterated
# again (.cache(), .snapshot(), tf.data.experimental.snapshot), by class name
REPLAYING = frozenset({"CacheDataset", "_SnapshotDataset", "_LegacySnapshotDataset"})
# ... and the only ones that may come between a poisson_dataset and fit: each passes every
# sample on whole and alone, or drops samples by their position, never by their content (a
# list of those to refuse had missed tf.data's parallel and fused batching). A
# _DirectedInterleaveDataset (choose_from_datasets, sample_from_datasets) passes whole
# samples of its data inputs, which alone are walked: its selector is no data.
PER_SAMPLE = frozenset({
    "_MapDataset", "_ParallelMapDataset", "_PrefetchDataset", "_OptionsDataset",
    "_AssertCardinalityDataset", "_RepeatDataset", "_TakeDataset", "_SkipDataset",
    "_ShardDataset", "_ShuffleDataset", "_DirectedInterleaveDataset"})


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
    _SAMPLERS[dataset] = sampler
    return dataset


def check_fit_dataset(dataset: tf.data.Dataset, aggregator) -> None:
    """Refuse a dataset whose batches are not the Poisson samples the ledger will price: one
    not made from :func:`poisson_dataset` at the aggregator's (n, q) (found by walking back
    through the datasets' inputs); in a resumed run, one whose sampler was seeded apart from
    the aggregator's; one that stores samples and replays them; and one that passes them
    through any transformation not in :data:`PER_SAMPLE`."""
    sources = [d for d in _walk(dataset) if d in _SAMPLERS]
    found = {(_SAMPLERS[d].n, _SAMPLERS[d].q) for d in sources}
    if found != {(aggregator.n, aggregator.q)}:
        got = (f"samples of (n, q) in {sorted(found)}" if found else
               "a dataset not made by poisson_dataset")
        raise ValueError(
            f"a dataset given to a private model's fit must hold Poisson samples at the "
            f"aggregator's n={aggregator.n}, q={aggregator.q} (the ledger prices its steps so); "
            f"got {got}. Build it with poisson_dataset(x, y, "
            f"sampler=private.aggregator.sampler, steps=...)")
    if aggregator.start_step and any(_SAMPLERS[d].seeded and _SAMPLERS[d] is not
                                     aggregator.sampler for d in sources):
        raise ValueError(
            "a resumed run's dataset draws from a sampler seeded apart from the aggregator's "
            "(poisson_dataset(seed=...), or a seeded sampler=): it draws, in every session, "
            "the samples the ledger already prices. Give it sampler=private.aggregator.sampler "
            "(whose seed moves on with the ledger), or no seed")
    stored = _transformations(dataset, REPLAYING)
    if stored:
        raise ValueError(
            f"the dataset stores Poisson samples and replays them ({', '.join(stored)}, from "
            f".cache() or .snapshot()): the steps would repeat samples the ledger prices as "
            f"independent. Cache the arrays, not the samples: give the records to "
            f"poisson_dataset as arrays (it draws fresh samples each pass)")
    altered = _transformations(dataset, PER_SAMPLE, outside=True)
    if altered:
        raise ValueError(
            f"the dataset drops, cuts, regroups or combines Poisson samples "
            f"({', '.join(altered)}): a filter by content makes the steps taken depend on the "
            f"data (skipping empty samples, say), and regrouped records, or samples zipped or "
            f"concatenated with other data, are batches the ledger does not describe. Only "
            f"map, prefetch, with_options, repeat, take, skip, shard, shuffle and "
            f"choose_from_datasets (or sample_from_datasets) of whole samples may come "
            f"between poisson_dataset and fit: transform each sample with map, and train on "
            f"every sample")


def _transformations(dataset: tf.data.Dataset, names: frozenset, *,
                     outside: bool = False) -> list[str]:
    """The class names, among ``names`` (or, with ``outside``, not among them), of the
    datasets between ``dataset`` and its :func:`poisson_dataset` sources, and of the first
    datasets that are not such sources."""
    return [type(d).__name__ for d in _walk(dataset)
            if d not in _SAMPLERS and (type(d).__name__ in names) != outside]


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
        if dataset not in _SAMPLERS:
            todo.extend(dataset._data_inputs if type(dataset).__name__ ==
                        "_DirectedInterleaveDataset" else dataset._inputs())
