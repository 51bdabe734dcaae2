"""Private training over several processes (``torch.distributed``): one Poisson sample, one
noise draw and one release per step, whatever the number of processes.

Every process holds the whole dataset and a copy of the model. When the model is made
private, the processes check that they hold the same model (names, shapes, dtypes) and the
same mechanism, q and n, copy process 0's parameters, buffers and ledger events (a resumed
run: process 0 reopened its ledger file) to the others. At each step:

1. **sampling**: every process draws a Poisson sample of ``range(n)`` at rate q and keeps the
   records i with i % world == rank, its shard. Each record's inclusion is one process's
   Bernoulli(q) draw, independent of every other record's, so the union of the shards is a
   Poisson sample of the n records at rate q, whatever the seeds (with one seed, the processes
   draw the same sample and split it);
2. **clipping**: each process clips its examples' gradients and adds their sums into zeros,
   except process 0, which adds them into the step's noise
   (:meth:`dpcore.PrivateAggregator.noise_draws` with ``noise=False`` elsewhere);
3. **agreement**: the processes learn, in one small ``all_reduce``, whether each of them got
   that far (a micro-batch of the step failing earlier counts) and whether they took the
   same step (step number, q, n, mechanism: a process clipping at another bound than the
   ledger of process 0 says would break the guarantee). A step that failed or differs in one
   raises in all, before anything is released or summed, so they stay in step;
4. **release**: each divides by q n and the results are summed over the processes
   (``all_reduce``, with a flag that makes all raise if a release failed in one, e.g. its
   ledger write): sum_r (S_r + [r = 0] N) / (q n), the private average of the union with
   one noise draw. Every process applies it, so the models stay equal. Adaptive clipping's
   counts of unclipped records go into the same sum, and every process moves its clips
   from the sum, so they stay equal too.

The per-process sums S_r are not private on their own: the processes, which all hold the
whole dataset, exchange them in the ``all_reduce``, and only the sum leaves it. Every
process's ledger holds the same events; only process 0 writes a ledger file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from itertools import chain
from typing import Callable

import torch
import torch.distributed as dist

from dpcore import Ledger
from dpcore.aggregation import NonFiniteNormError

_NONE, _NONFINITE, _OTHER = 0, 1, 2  # what failed, in the agreement's flag (the worst wins)


def _release_taken(aggregator, per_record: Mapping, mechanism) -> str:
    """What makes a release of ``mechanism`` the same in every process (formed in the
    agreement, so it must not raise: the release's own checks name bad values)."""
    try:
        values = sorted((str(leaf), tuple(v.shape[1:]), str(v.dtype))
                        for leaf, v in per_record.items())
    except Exception:  # not a mapping of arrays
        values = type(per_record).__name__
    return f"a release at step {aggregator.step} of {values} by {mechanism}"


class Workers:
    """The processes of the default ``torch.distributed`` group, seen from one of them, whose
    model lives on ``device`` (where the collectives' tensors go). Every method is a
    collective: each process calls it at the same point, and it raises in all or in none."""

    def __init__(self, device):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "distributed=True needs torch.distributed initialised in every process "
                "(torch.distributed.init_process_group, e.g. under torchrun) before "
                "make_private")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device(device)

    @property
    def shard(self) -> tuple[int, int]:
        """(rank, world): this process keeps the sampled records i with i % world == rank."""
        return self.rank, self.world

    @property
    def draws_noise(self) -> bool:
        """Whether this process draws the step's noise (process 0 alone does)."""
        return self.rank == 0

    @torch.no_grad()
    def copy_model(self, module: torch.nn.Module) -> None:
        """Make every process's parameters and buffers process 0's, once every process is
        seen to hold the same names, shapes and dtypes."""
        tensors = list(chain(module.named_parameters(), module.named_buffers()))
        kinds = [(name, tuple(t.shape), str(t.dtype)) for name, t in tensors]
        every = [None] * self.world
        dist.all_gather_object(every, kinds)  # the same list in every process: all raise
        for rank, other in enumerate(every):
            if other != every[0]:
                first = next((a, b) for a, b in zip(every[0] + [None], other + [None])
                             if a != b)
                raise ValueError(f"process {rank}'s model differs from process 0's: "
                                 f"{first[1]} against {first[0]} (name, shape, dtype); make "
                                 f"the same model in every process")
        for _, tensor in tensors:
            dist.broadcast(tensor, src=0)

    def share_ledger(self, ledger: Ledger) -> None:
        """Start every process's ledger from process 0's events (a resumed run: process 0
        reopened its file), so that every process prices the steps alike."""
        events = [list(ledger.events) if self.rank == 0 else None]
        dist.broadcast_object_list(events, src=0)
        error = None
        if self.rank != 0 and list(ledger.events) != events[0]:
            if ledger.events:
                error = ValueError(f"process {self.rank}'s ledger holds {len(ledger.events)} "
                                   f"events that are not process 0's {len(events[0])}: give "
                                   f"a ledger (path) to process 0 only")
            else:
                ledger.write(*events[0])
        self.settle(error)

    def agree(self, work: Callable[[], object], taken: Callable[[], str] = str):
        """``work()``, once :meth:`settle` has seen its error (if any) and ``taken()``, what
        makes it the same in every process."""
        error = result = None
        try:
            result = work()
        except BaseException as raised:  # re-raised by settle, in every process
            error = raised
        self.settle(error, taken())
        return result

    def settle(self, error: BaseException | None, taken: str = "") -> None:
        """Raise in every process if ``error`` is not None in any (that process raises it;
        the others a ``NonFiniteNormError`` if it was one, else a ``RuntimeError``), or if
        ``taken`` differs between processes; so no process waits for another in a sum, and
        none releases a step the others took otherwise."""
        code = int.from_bytes(hashlib.blake2b(taken.encode(), digest_size=7).digest(), "big")
        kind = (_NONE if error is None else
                _NONFINITE if isinstance(error, NonFiniteNormError) else _OTHER)
        flags = torch.tensor([kind, code, -code], dtype=torch.int64, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # the worst failure; largest, smallest code
        worst, largest, smallest = flags.tolist()
        if error is not None:
            raise error
        if worst == _NONFINITE:
            raise NonFiniteNormError("a record of another process has a NaN or infinite norm "
                                     "(its error says which); nothing was released")
        if worst == _OTHER:
            raise RuntimeError("the step failed in another process (its error says why); "
                               "nothing was released")
        if largest != -smallest:
            raise ValueError(f"the processes disagree: process {self.rank} has {taken}. Call "
                             f"make_private with the same arguments in every process and "
                             f"take the same steps; nothing was released")

    def release_extra(self, aggregator, per_record: Mapping[str, torch.Tensor],
                      mechanism) -> dict[str, torch.Tensor]:
        """``aggregator.release(per_record, mechanism=mechanism)`` of the step's union:
        each process releases its share's clipped sums over q n (process 0 with the noise)
        and the results are added up, leaf by leaf in the mechanism's order. Before any of
        them records it, the processes check that they release the same values (leaves,
        shapes, dtypes) under the same mechanism (a process clipping at another bound than
        process 0's ledger says would break the guarantee) at the same step, and that the
        share of each is valid (a NaN value): otherwise all raise, and their ledgers stay
        alike."""
        settled = False

        def agree(error):
            nonlocal settled
            self.settle(error, _release_taken(aggregator, per_record, mechanism))
            settled = True

        error = released = None
        try:
            released = aggregator.release(per_record, mechanism=mechanism,
                                          noise=self.draws_noise, agree=agree)
        except BaseException as raised:
            if not settled:  # raised in every process by the agreement: nothing to add up
                raise
            error = raised
        like = {leaf: per_record[leaf].new_zeros(per_record[leaf].shape[1:])
                for leaf in mechanism.leaves}
        return self.sum_(released, like, error)

    @torch.no_grad()
    def sum_(self, tensors: Mapping[str, torch.Tensor] | None, like: Mapping[str, torch.Tensor],
             error: BaseException | None = None) -> dict[str, torch.Tensor]:
        """``tensors`` summed over the processes, in one ``all_reduce`` per (dtype, device),
        their pieces in the order of ``like`` (the same in every process). A process whose
        release raised ``error`` passes ``tensors=None`` (zeros shaped ``like``); its flag,
        added to the first sum, makes every process raise."""
        if tensors is None:
            tensors = {name: torch.zeros_like(t) for name, t in like.items()}
        kinds: dict[tuple, list[str]] = {}
        for name in like:
            t = tensors[name]
            kinds.setdefault((t.dtype, t.device), []).append(name)
        out, failed = {}, 0.0
        for k, names in enumerate(kinds.values()):
            pieces = [tensors[name].reshape(-1) for name in names]
            flag = pieces[0].new_full((int(k == 0),), float(error is not None))
            flat = torch.cat([*pieces, flag])
            dist.all_reduce(flat)
            if k == 0:
                failed = flat[-1].item()
            sums = flat[:flat.numel() - flag.numel()]
            for name, piece in zip(names, sums.split([t.numel() for t in pieces])):
                out[name] = piece.view(tensors[name].shape)
        if error is not None:
            raise error
        if failed:
            raise RuntimeError("the release failed in another process (its error says why); "
                               "nothing was applied")
        return out
