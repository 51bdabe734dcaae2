"""Private training over several processes (``torch.distributed``): one Poisson sample, one
noise draw and one release per step, whatever the number of processes.

Every process holds the whole dataset and a copy of the model (made equal to process 0's
when the model is made private). At each step:

1. **sampling**: every process draws a Poisson sample of ``range(n)`` at rate q and keeps the
   records i with i % world == rank, its shard. Each record's inclusion is one process's
   Bernoulli(q) draw, independent of every other record's, so the union of the shards is a
   Poisson sample of the n records at rate q, whatever the seeds (with one seed, the processes
   draw the same sample and split it);
2. **clipping**: each process clips its examples' gradients and adds their sums into zeros,
   except process 0, which adds them into the step's noise
   (:meth:`dpcore.PrivateAggregator.noise_draws` with ``noise=False`` elsewhere);
3. **agreement**: the processes learn, in one small ``all_reduce``, whether each of them got
   that far and whether they took the same step (step number, q, n, mechanism: a process
   clipping at another bound than the ledger of process 0 says would break the guarantee).
   A step that failed or differs in one (a NaN record, a refused budget, other arguments)
   raises in all, before anything is released or summed, so they stay in step;
4. **release**: each divides by q n and the results are summed over the processes
   (``all_reduce``): sum_r (S_r + [r = 0] N) / (q n), the private average of the union with
   one noise draw. Every process applies it, so the models stay equal.

The per-process sums S_r are not private on their own; they leave a process only inside that
sum. Every process's ledger holds the same events (it made the same steps with the same
mechanism); only process 0 writes a ledger file.
"""

from __future__ import annotations

import hashlib
from collections.abc import MutableMapping
from itertools import chain
from typing import Callable

import torch
import torch.distributed as dist


class Workers:
    """The processes of the default ``torch.distributed`` group, seen from one of them, whose
    model lives on ``device`` (where the collectives' tensors go)."""

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
        """Make every process's parameters and buffers process 0's."""
        for tensor in chain(module.parameters(), module.buffers()):
            dist.broadcast(tensor, src=0)

    def agree(self, work: Callable[[], object], step: Callable[[], str]) -> None:
        """Run ``work``, then raise in every process if it raised in any (the one that
        failed raises its own error) or if ``step()``, a description of the step taken,
        differs between processes; so no process waits for another in a sum, and none
        releases a step the others took otherwise."""
        error = None
        try:
            work()
        except BaseException as raised:  # re-raised below, in every process
            error = raised
        taken = step()
        code = int.from_bytes(hashlib.blake2b(taken.encode(), digest_size=7).digest(), "big")
        flags = torch.tensor([error is not None, code, -code], dtype=torch.int64,
                             device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # any failure; the largest, smallest code
        failed, largest, smallest = flags.tolist()
        if error is not None:
            raise error
        if largest != -smallest:
            raise ValueError(f"the processes took different steps; process {self.rank} took "
                             f"{taken}. Call make_private with the same arguments in every "
                             f"process and take the same steps; nothing was released")
        if failed:
            raise RuntimeError("the step failed in another process (its error says why); "
                               "nothing was released")

    @torch.no_grad()
    def sum_(self, tensors: MutableMapping[str, torch.Tensor]) -> None:
        """Replace every tensor by its sum over the processes, in one ``all_reduce`` per
        (dtype, device)."""
        kinds: dict[tuple, list[str]] = {}
        for name, t in tensors.items():
            kinds.setdefault((t.dtype, t.device), []).append(name)
        for names in kinds.values():
            flat = torch.cat([tensors[name].reshape(-1) for name in names])
            dist.all_reduce(flat)
            for name, piece in zip(names, flat.split([tensors[n].numel() for n in names])):
                tensors[name] = piece.view(tensors[name].shape)
