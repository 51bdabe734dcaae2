"""The processes of tests/torch/test_torch_distributed.py, started by torchrun:

    python -m torch.distributed.run --standalone --nproc_per_node 2 distributed_run.py OUT

Each runs the scenarios below with ``make_private(..., distributed=True)`` and saves what it
saw to OUT/rank{r}.pt, which the tests compare with single-process runs."""

import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpcore_torch import make_private

N, BATCH, STEPS = 40, 4, 5  # q = 2 * 4 / 40


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def data(n=N):
    """(x, y, index): the index shows which records each process was given."""
    gen = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 6, generator=gen),
                         torch.randint(0, 3, (n,), generator=gen), torch.arange(n))


def train(model, opt, loader):
    """One pass over the loader; the record indices of each batch."""
    seen = []
    for x, y, index in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        seen.append(index.tolist())
    return seen


def same_seed(out: Path, rank: int) -> dict:
    """The MLP trained with seed 5; process 1 starts from other weights (make_private makes
    them process 0's)."""
    model = mlp()
    if rank == 1:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    model, opt, loader = make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.5), DataLoader(data(), batch_size=BATCH),
        noise_multiplier=0.7, max_grad_norm=0.3, seed=5, distributed=True,
        ledger=out / "ledger.jsonl")
    seen = train(model, opt, loader)
    opt.ledger.close()
    return {"seen": seen, "q": opt.aggregator.q, "events": list(opt.ledger.events),
            "params": [p.detach().clone() for p in model.parameters()],
            "in_memory": opt.ledger.path is None}


def noise(out: Path, rank: int, secure: bool) -> dict:
    """Zero gradients, unseeded: each step's release times q n is the noise alone."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64, bias=False)
    ds = TensorDataset(torch.randn(100, 64), torch.zeros(100), torch.arange(100))
    model, opt, loader = make_private(
        model, torch.optim.SGD(model.parameters(), lr=1.0), DataLoader(ds, batch_size=5),
        noise_multiplier=1.3, max_grad_norm=0.7, distributed=True, secure=secure)
    released = []
    for x, _, _ in loader:
        opt.zero_grad()
        (model(x) * 0).sum().backward()
        opt.step()
        released.append(model.weight.grad.flatten() * opt.aggregator.expected_size)
    return {"noise": torch.cat(released), "weight": model.weight.detach().clone()}


def nan_record(out: Path, rank: int) -> dict:
    """q = 1, a NaN in record 1 (process 1's): both processes raise at the step, neither
    releases; the next step (without it) runs in both."""
    ds = data(16)
    ds.tensors[0][1, 0] = math.nan
    model = mlp()
    model, opt, loader = make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.5), DataLoader(ds, batch_size=8),
        noise_multiplier=1.0, max_grad_norm=1.0, seed=0, distributed=True)
    x, y, index = next(iter(loader))
    F.cross_entropy(model(x), y).backward()
    try:
        opt.step()
        error = None
    except Exception as raised:
        error = (type(raised).__name__, str(raised))
    after_failure = [type(e).__name__ for e in opt.ledger.events]
    keep = index != 1
    opt.zero_grad()
    F.cross_entropy(model(x[keep]), y[keep]).backward()
    opt.step()
    return {"error": error, "after_failure": after_failure,
            "events": [type(e).__name__ for e in opt.ledger.events],
            "params": [p.detach().clone() for p in model.parameters()]}


def other_clip(out: Path, rank: int) -> dict:
    """Process 1 clips at 2.0, process 0 (whose ledger is the file) at 1.0: both raise at
    the first step, before anything is released."""
    model = mlp()
    model, opt, loader = make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.5), DataLoader(data(), batch_size=4),
        noise_multiplier=1.0, max_grad_norm=1.0 + rank, seed=0, distributed=True)
    x, y, _ = next(iter(loader))
    F.cross_entropy(model(x), y).backward()
    try:
        opt.step()
        error = None
    except Exception as raised:
        error = (type(raised).__name__, str(raised))
    return {"error": error, "events": [type(e).__name__ for e in opt.ledger.events],
            "params": [p.detach().clone() for p in model.parameters()]}


def main(out: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    out = Path(out)
    rank = dist.get_rank()
    results = {"world": dist.get_world_size(), "same_seed": same_seed(out, rank),
               "noise": noise(out, rank, secure=False),
               "secure_noise": noise(out, rank, secure=True),
               "nan_record": nan_record(out, rank), "other_clip": other_clip(out, rank)}
    torch.save(results, out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
