"""Poisson batches of fixed shapes, so that a compiled step is reused across steps.

Each sample is padded up to its bucket (:class:`dpcore.sampling.Buckets`, about 17 shapes).
Padded rows carry ``mask`` False and are zeroed in norms, sums and counts; the average is
divided by q n, never by the realised size.

With a ``sharding`` that cuts the batch's first axis over d devices (``NamedSharding(mesh,
P("data"))``), buckets are multiples of d and each batch is placed so; a step compiled for
replicated parameters then computes each device's per-example gradients there and adds the
clipped sums across devices (XLA inserts the sum), with the noise drawn once, from one key.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import jax
import numpy as np

from dpcore import _validation as check
from dpcore.sampling import Buckets


def pad(data, indices: np.ndarray, size: int):
    """``(batch, mask)``: the rows ``indices`` of every array in ``data`` (a pytree of NumPy
    arrays with a common first dimension), followed by zero rows up to ``size``; ``mask``
    (size,) is True on the real rows."""
    indices = np.asarray(indices, dtype=np.int64)
    if len(indices) > size:
        raise ValueError(f"a sample of {len(indices)} records does not fit a batch of {size}")

    def take(a):
        a = np.asarray(a)
        out = np.zeros((size,) + a.shape[1:], dtype=a.dtype)
        out[:len(indices)] = a[indices]
        return out

    mask = np.zeros(size, dtype=bool)
    mask[:len(indices)] = True
    return jax.tree_util.tree_map(take, data), mask


def batch_shards(sharding) -> int:
    """How many pieces ``sharding`` cuts a batch's first axis into (1: replicated). Meshes
    with explicit axes (``jax.make_mesh``'s default) are refused: the ghost norms re-run a
    traced program, whose operations would then carry shardings of a mesh not in scope."""
    explicit = getattr(getattr(sharding, "mesh", None), "explicit_axes", ())
    if explicit:
        raise ValueError(f"the mesh of {sharding} has explicit axes {explicit}: make it with "
                         f"automatic ones, jax.make_mesh(shape, names, axis_types=(jax."
                         f"sharding.AxisType.Auto,) * len(names)) or jax.sharding.Mesh(...)")
    devices = len(sharding.device_set)
    return devices // sharding.shard_shape((devices,))[0]


def replicated(sharding):
    """A copy on every device of ``sharding`` (a ``NamedSharding``): the parameters' placement
    for a step whose batches are placed with ``sharding``."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        raise TypeError(f"sharding must be a jax.sharding.NamedSharding (e.g. "
                        f"NamedSharding(mesh, PartitionSpec('data'))), got {sharding!r}")
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())


def _rows(data) -> int:
    sizes = {np.shape(a)[0] for a in jax.tree_util.tree_leaves(data)}
    if len(sizes) != 1:
        raise ValueError(f"every array of the data needs the same number of rows, got {sorted(sizes)}")
    return sizes.pop()


class PoissonBatches:
    """Padded Poisson batches of ``data`` for ``aggregator``'s sampling.

    Each step draws a sample from ``aggregator.sampler``, writes the step's sampling event to
    the ledger (``aggregator.begin_step()``) and pads the sample to its bucket. Iterating
    yields ``(batch, mask)``; with ``splits=k`` (gradient accumulation) it yields a list of k
    equal-sized ``(batch, mask)`` parts of one sample, whose clipped sums are to be added and
    noised once. ``steps`` bounds the iteration (None: endless). ``sharding`` (a
    ``jax.sharding.Sharding`` of the batch's first axis) places every batch or part across
    devices, each a multiple of their number of rows.

    :meth:`prefetch` draws and pads the next sample ahead, for a loop to call once a step has
    been dispatched, so the host work overlaps the device's (as :func:`dpcore_jax.train`
    does); its sampling event is still written only by the :meth:`next` that begins its step,
    so the ledger keeps each step's sampling before its sums and a sample never used costs
    nothing.
    """

    def __init__(self, data, aggregator, *, buckets: Buckets | None = None, splits: int = 1,
                 steps: int | None = None, sharding=None):
        rows = _rows(data)
        if rows != aggregator.n:
            raise ValueError(f"data has {rows} records but the aggregator samples from "
                             f"n={aggregator.n}")
        self.data = data
        self.aggregator = aggregator
        self.splits = check.count("splits", splits, minimum=1)
        self.sharding = sharding
        shards = 1 if sharding is None else batch_shards(sharding)
        self.buckets = buckets or Buckets(aggregator.expected_size, aggregator.q,
                                          multiple_of=self.splits * shards)
        if self.buckets.granularity % (self.splits * shards):
            raise ValueError(f"bucket granularity {self.buckets.granularity} is not a multiple "
                             f"of splits={self.splits} times {shards} shards")
        self.steps = None if steps is None else check.count("steps", steps)
        self._ahead = None

    def prefetch(self) -> None:
        """Draw and pad the next step's sample now (once; no ledger event)."""
        if self._ahead is None:
            indices = self.aggregator.sampler.sample()
            self._ahead = pad(self.data, indices, self.buckets.size_for(len(indices)))

    def next(self):
        """Begin a step (its sampling event, written once the programs dispatched before
        have run their ledger callbacks: ``begin_step`` settles the backend) and return its
        padded batch (or parts)."""
        self.prefetch()
        self.aggregator.begin_step()
        (batch, mask), self._ahead = self._ahead, None
        parts = [(batch, mask)] if self.splits == 1 else split(batch, mask, self.splits)
        if self.sharding is not None:
            parts = [jax.device_put(part, self.sharding) for part in parts]
        return parts[0] if self.splits == 1 else parts

    def __iter__(self) -> Iterator:
        taken = 0
        while self.steps is None or taken < self.steps:
            yield self.next()
            taken += 1


def split(batch, mask: np.ndarray, parts: int) -> Sequence:
    """``parts`` consecutive equal slices ``(batch, mask)`` of a padded batch."""
    size = mask.shape[0]
    if size % parts:
        raise ValueError(f"a batch of {size} rows cannot be split into {parts} equal parts")
    step = size // parts
    return [(jax.tree_util.tree_map(lambda a: a[i * step:(i + 1) * step], batch),
             mask[i * step:(i + 1) * step]) for i in range(parts)]
