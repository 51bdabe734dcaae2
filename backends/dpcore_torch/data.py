"""Poisson-sampled batches for a torch ``Dataset``.

Each step every record joins the batch independently with probability q (batch size
Binomial(n, q), possibly zero), drawn by :class:`dpcore.PoissonSampler`. This, not shuffled
fixed-size batches, is the sampling the accountants' amplification analysis assumes. An empty
batch is a batch of zero examples with the same structure as a non-empty one, so the training
loop runs a (pure-noise) step for it instead of skipping it: skipping would make the number of
released steps depend on the data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Iterator

from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.dataloader import default_collate

from dpcore import PoissonSampler


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
        for _ in range(self.steps):
            sample = self.sampler.sample()
            if self.shard is not None:
                rank, world = self.shard
                sample = sample[sample % world == rank]
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
        return _no_rows(self.collate([self.dataset[0]]))


def _no_rows(batch):
    """The zero-example version of ``batch``, a collated batch of one example."""
    if hasattr(batch, "shape") and len(batch.shape):
        return batch[:0]
    if isinstance(batch, Mapping):
        return type(batch)({key: _no_rows(value) for key, value in batch.items()})
    if isinstance(batch, (list, tuple)):
        if all(_is_value(item) for item in batch):  # one value per example
            return type(batch)()
        items = [_no_rows(item) for item in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    raise TypeError(
        f"cannot form an empty Poisson sample: the collated batch holds a "
        f"{type(batch).__name__} that is neither a tensor nor a list with one value per "
        f"example, and it would carry an unsampled record's data. Make collate_fn return "
        f"tensors or lists of per-example values")


def _is_value(item) -> bool:
    """Whether ``item`` is a per-example value in a list (not a tensor or a container)."""
    return not (hasattr(item, "shape") or isinstance(item, (Mapping, list, tuple)))


class PoissonLoader(DataLoader):
    """A DataLoader of Poisson samples that counts the samples it has handed out
    (``samples_given``), so that a step can tell which sample its micro-batches came from."""

    samples_given = 0

    def __iter__(self):
        for batch in super().__iter__():
            self.samples_given += 1
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


def steps_per_epoch(q: float) -> int:
    """Steps that visit n records in expectation: round(1 / q)."""
    return max(1, math.floor(1 / q + 0.5))

