"""Poisson-sampled batches for a torch ``Dataset``.

Each step every record joins the batch independently with probability q (batch size
Binomial(n, q), possibly zero), drawn by :class:`dpcore.PoissonSampler`. This, not shuffled
fixed-size batches, is the sampling the accountants' amplification analysis assumes. An empty
batch is a batch of zero examples with the same structure as a non-empty one, so the training
loop runs a (pure-noise) step for it instead of skipping it: skipping would make the number of
released steps depend on the data.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Mapping
from typing import Iterator

from torch.utils.data import (DataLoader, Dataset, RandomSampler, Sampler, SequentialSampler,
                              WeightedRandomSampler)
from torch.utils.data.dataloader import default_collate
from torch.utils.data.distributed import DistributedSampler

from dpcore import PoissonSampler
from dpcore.sampling import steps_per_epoch


class PoissonBatchSampler(Sampler[list[int]]):
    """``steps`` Poisson samples of ``range(n)`` at rate ``q`` (default: about one epoch, 1/q),
    drawn from ``sampler`` (a :class:`dpcore.PoissonSampler` of that n and q, e.g. an
    aggregator's, which its backend made) or from a new one seeded with ``seed``. With
    ``shard=(rank, world)`` only the sampled records i with i % world == rank are kept: one
    process's part of a sample that several processes share
    (:mod:`dpcore_torch.distributed`)."""

    def __init__(self, n: int, q: float, *, steps: int | None = None, seed=None,
                 sampler: PoissonSampler | None = None, shard: tuple[int, int] | None = None):
        if sampler is None:
            sampler = PoissonSampler(n, q, seed=seed)
        elif seed is not None:
            raise ValueError("give seed or sampler, not both: a given sampler is already seeded")
        elif (sampler.n, sampler.q) != (n, q):
            raise ValueError(f"the sampler draws from n={sampler.n} at q={sampler.q}, the "
                             f"loader needs n={n} at q={q}")
        if shard is not None and not 0 <= shard[0] < shard[1]:
            raise ValueError(f"shard must be (rank, world) with 0 <= rank < world, got {shard}")
        self.sampler, self.shard = sampler, shard
        self.steps = steps_per_epoch(q) if steps is None else steps

    def __iter__(self) -> Iterator[list[int]]:
        self.sizes = sizes = collections.deque()  # this pass's sample sizes, not yet handed out
        for _ in range(self.steps):
            sample = self.sampler.sample()
            if self.shard is not None:
                rank, world = self.shard
                sample = sample[sample % world == rank]
            sizes.append(len(sample))
            yield sample.tolist()

    def __len__(self) -> int:
        return self.steps


class _EmptySafeCollate:
    """``collate`` that turns an empty list into a zero-example batch shaped like one example:
    its tensors cut to zero rows, its lists of one value per example (strings, say) emptied.
    Nothing else of that example may pass: it was not sampled."""

    def __init__(self, dataset: Dataset, collate):
        self.dataset, self.collate = dataset, collate

    def __call__(self, examples):
        if examples:
            return self.collate(examples)
        first = self.dataset[0]
        return _no_rows(self.collate([first]), self.collate([first, first]))


def _no_rows(one, two):
    """The zero-example version of ``one``, a collated batch of one example, given ``two``,
    the same example collated twice: a list whose length follows the number of examples
    holds one value per example (labels, variable-size images) and becomes empty."""
    if hasattr(one, "shape") and len(one.shape):
        return one[:0]
    if isinstance(one, Mapping):
        return type(one)({key: _no_rows(value, two[key]) for key, value in one.items()})
    if isinstance(one, (list, tuple)):
        if len(one) != len(two):  # one value per example
            return type(one)()
        items = [_no_rows(a, b) for a, b in zip(one, two)]
        return type(one)(*items) if hasattr(one, "_fields") else type(one)(items)
    raise TypeError(
        f"cannot form an empty Poisson sample: the collated batch holds a "
        f"{type(one).__name__} that is neither a tensor nor a list with one value per "
        f"example, and it would carry an unsampled record's data. Make collate_fn return "
        f"tensors or lists of per-example values")


class PoissonLoader(DataLoader):
    """A DataLoader of Poisson samples that counts the samples it has handed out
    (``samples_given``), so that a step can tell which sample its micro-batches came from,
    and keeps the number of records of the last (``last_size``; None when the batches may
    come out of order, ``in_order=False``)."""

    samples_given = 0
    last_size = None

    def __iter__(self):
        sizes = None
        for batch in super().__iter__():
            if sizes is None:  # the pass has begun: its sampler's sizes, in the batches' order
                sizes = self.batch_sampler.sizes
            self.samples_given += 1
            self.last_size = sizes.popleft() if getattr(self, "in_order", True) else None
            yield batch


#: What a DataLoader's settings hold besides its dataset, sampling and collation: what
#: :func:`dpcore_torch.make_private` passes on to the Poisson loader replacing it.
LOADER_OPTIONS = ("num_workers", "pin_memory", "timeout", "worker_init_fn",
                  "multiprocessing_context", "generator", "prefetch_factor",
                  "persistent_workers", "pin_memory_device", "in_order")


def poisson_loader(dataset: Dataset, q: float, *, steps: int | None = None, seed=None,
                   sampler: PoissonSampler | None = None, shard: tuple[int, int] | None = None,
                   collate_fn=None, **loader_kwargs) -> PoissonLoader:
    """A DataLoader of Poisson samples of ``dataset`` at rate ``q``, drawn from ``sampler``
    (see :class:`PoissonBatchSampler`, also for ``shard``) or a new sampler seeded with
    ``seed`` (``loader_kwargs`` such as ``num_workers`` or ``pin_memory`` are passed on).
    ``loader.sample_rate`` is q."""
    n = len(dataset)
    if n == 0:
        raise ValueError("cannot sample from an empty dataset")
    batches = PoissonBatchSampler(n, q, steps=steps, seed=seed, sampler=sampler, shard=shard)
    loader = PoissonLoader(dataset, batch_sampler=batches,
                           collate_fn=_EmptySafeCollate(dataset, collate_fn or default_collate),
                           **loader_kwargs)
    loader.sample_rate = q
    return loader


def sample_rate_of(loader: DataLoader, processes: int = 1) -> float:
    """q = expected batch size / n for a loader to be replaced by Poisson sampling; with
    several ``processes`` its ``batch_size`` is each one's, as with a DistributedSampler, and
    the expected sample ``processes * batch_size``."""
    n = len(loader.dataset)
    size = loader.batch_size
    if size is None:  # a custom batch_sampler: use its number of batches per epoch
        return 1.0 / len(loader)
    if not 0 < size * processes <= n:
        per = f" times {processes} processes" if processes > 1 else ""
        raise ValueError(f"batch_size {size}{per} must be in [1, len(dataset) = {n}]")
    return size * processes / n


def check_whole_dataset(loader: DataLoader) -> None:
    """Refuse a loader whose sampler leaves records out or weights them: the Poisson loader
    replacing it samples every record of the dataset at rate q, so it would train on the
    records left out (a SubsetRandomSampler's held-out split) or drop the weights."""
    batches = loader.batch_size is None  # a custom batch_sampler
    sampler = loader.batch_sampler if batches else loader.sampler
    if isinstance(sampler, (SequentialSampler, RandomSampler, DistributedSampler)):
        return
    name, n = type(sampler).__name__, len(loader.dataset)
    if isinstance(sampler, WeightedRandomSampler):
        raise ValueError("the loader's WeightedRandomSampler would be dropped: Poisson sampling "
                         "draws every record with the same probability q, as the accountants "
                         "assume; weight the examples' losses, or resample the dataset, instead")
    try:
        size = len(sampler)
    except TypeError:
        raise ValueError(f"the loader's {name} has no length, so which records it draws cannot "
                         f"be checked: pass the records to train on as the dataset") from None
    drawn = set()
    for item in itertools.islice(iter(sampler), size):
        drawn.update(int(i) for i in item) if batches else drawn.add(int(item))
    if len(drawn & set(range(n))) < n:
        raise ValueError(f"the loader's {name} draws {len(drawn)} of the dataset's {n} records "
                         f"in an epoch, but make_private samples every record of the dataset "
                         f"(Poisson, at rate q): the others would be trained on too. Pass the "
                         f"records to train on as the dataset (torch.utils.data.Subset(dataset, "
                         f"indices))")
