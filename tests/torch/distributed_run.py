"""The processes of tests/torch/test_torch_distributed.py, started by torchrun:

    python -m torch.distributed.run --standalone --nproc_per_node 2 distributed_run.py OUT

Each runs the scenarios below with ``make_private(..., distributed=True)`` and saves what it
saw to OUT/rank{r}.pt, which the tests compare with single-process runs."""

import math
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpcore
from dpcore_torch import BatchNormStatistics, make_private

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


def adaptive(batch_size: int, **options) -> dict:
    """The MLP trained with adaptive clipping and seed 5: the clips after each step, the
    ledger's events and the trained weights."""
    model = mlp()
    model, opt, loader = make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.5),
        DataLoader(data(), batch_size=batch_size), noise_multiplier=0.7, max_grad_norm=0.3,
        seed=5, clip_policy="adaptive", **options)
    clips = []
    for x, y, _ in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        clips.append([g.clip for g in opt.aggregator.mechanism.groups])
    return {"clips": clips, "events": list(opt.ledger.events),
            "params": [p.detach().clone() for p in model.parameters()]}


def batch_norm(batch_size: int, **options) -> dict:
    """An MLP with a BatchNorm1d whose statistics are released privately, trained with seed
    5: each step's released statistics, the ledger's events, the trained weights and the
    running statistics."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))
    model, opt, loader = make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.5),
        DataLoader(data(), batch_size=batch_size), noise_multiplier=0.7, max_grad_norm=0.3,
        seed=5, batch_norm=BatchNormStatistics(2.0, 3.0), **options)
    released = []
    for x, y, _ in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        released.append(opt.engine.batch_norm.released["1"])
        opt.step()
    return {"released": released, "events": list(opt.ledger.events),
            "params": [p.detach().clone() for p in model.parameters()],
            "buffers": [b.clone() for b in model.buffers()]}


LOSS_METRIC = dpcore.Mechanism((dpcore.Group("loss", ("loss",), 1.0, 2.0),))


def metrics(batch_size: int, **options) -> dict:
    """The MLP trained with seed 5, each step's loss released by ``optimizer.release``
    (before step() on even steps, after it on odd ones): the released losses, the ledger's
    events and the trained weights."""
    model = mlp()
    model, opt, loader = make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.5),
        DataLoader(data(), batch_size=batch_size), noise_multiplier=0.7, max_grad_norm=0.3,
        seed=5, **options)
    released = []
    for k, (x, y, _) in enumerate(loader):
        opt.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        losses.mean().backward()
        values = {"loss": losses.detach()[:, None]}
        if k % 2 == 0:
            released.append(opt.release(values, LOSS_METRIC)["loss"])
        opt.step()
        if k % 2 == 1:
            released.append(opt.release(values, LOSS_METRIC)["loss"])
    return {"released": released, "events": list(opt.ledger.events),
            "params": [p.detach().clone() for p in model.parameters()]}


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


def with_a_nan_record():
    """(model, optimizer, batch) at q = 1 over 16 records, record 1 (process 1's) NaN."""
    ds = data(16)
    ds.tensors[0][1, 0] = math.nan
    model = mlp()
    model, opt, loader = make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.5), DataLoader(ds, batch_size=8),
        noise_multiplier=1.0, max_grad_norm=1.0, seed=0, distributed=True)
    return model, opt, next(iter(loader))


def outcome(step) -> tuple[str, str] | None:
    """None if ``step()`` returns, else the type and message of what it raised."""
    try:
        step()
    except Exception as raised:
        return type(raised).__name__, str(raised)
    return None


def nan_record(out: Path, rank: int) -> dict:
    """q = 1, a NaN in record 1 (process 1's): both processes raise at the step, neither
    releases; the next step (without it) runs in both. A metric of the records, the NaN
    among them, is refused in both before either records it."""
    model, opt, (x, y, index) = with_a_nan_record()
    F.cross_entropy(model(x), y).backward()
    error = outcome(opt.step)
    after_failure = [type(e).__name__ for e in opt.ledger.events]
    keep = index != 1
    opt.zero_grad()
    F.cross_entropy(model(x[keep]), y[keep]).backward()
    opt.step()
    metric = outcome(lambda: opt.release({"loss": x[:, :1]}, LOSS_METRIC))
    return {"error": error, "after_failure": after_failure, "metric": metric,
            "events": [type(e).__name__ for e in opt.ledger.events],
            "params": [p.detach().clone() for p in model.parameters()]}


def other_clip(out: Path, rank: int) -> dict:
    """Process 1 clips at 2.0, process 0 (whose ledger is the file) at 1.0: both refuse at
    make_private. A clip moving otherwise in one process (a schedule of its own) is refused
    at the step where it differs, before anything of it is released."""
    made = outcome(lambda: make_private(
        mlp(), torch.optim.SGD(mlp().parameters(), lr=0.5), DataLoader(data(), batch_size=4),
        noise_multiplier=1.0, max_grad_norm=1.0 + rank, distributed=True))
    model = mlp()
    model, opt, loader = make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.5), DataLoader(data(), batch_size=4),
        noise_multiplier=1.0, max_grad_norm=1.0, seed=0, distributed=True,
        clip_policy=dpcore.ClipSchedule(lambda step: 1.0 if step == 0 else 1.0 + rank))
    taken = []
    for x, y, _ in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        taken.append(outcome(opt.step))
    return {"made": made, "taken": taken,
            "events": [type(e).__name__ for e in opt.ledger.events],
            "params": [p.detach().clone() for p in model.parameters()]}


def failed_micro_batch(out: Path, rank: int) -> dict:
    """q = 1 in micro-batches of 2 records: process 1's second holds the NaN record 1 (its
    accumulate() keeps the error and drops its later micro-batches); both processes' step()
    raises, and both then train the next sample alike. A metric released between
    accumulate() and step() is refused in both (their numbers of micro-batches differ)."""
    model, opt, (x, y, index) = with_a_nan_record()
    raised = []
    for step in range(2):
        for part in range(0, len(x), 2):
            keep = slice(part, part + 2)
            if step == 1 and (index[keep] == 1).any():
                continue
            opt.zero_grad()
            F.cross_entropy(model(x[keep]), y[keep]).backward()
            raised.append(("accumulate", step, outcome(opt.accumulate)))
        if step == 1:
            values = {"loss": torch.zeros(2, 1)}
            raised.append(("release", step, outcome(lambda: opt.release(values, LOSS_METRIC))))
        raised.append(("step", step, outcome(opt.step)))
    return {"raised": raised, "events": [type(e).__name__ for e in opt.ledger.events],
            "params": [p.detach().clone() for p in model.parameters()]}


def resumed(out: Path, rank: int) -> dict:
    """Two steps into ledger.jsonl, then a second make_private on the same path: process 0
    reopens the file, process 1 starts from its events, and both price the run alike and
    number its steps alike."""
    path = out / "resumed.jsonl"
    epsilons, starts = [], []
    for _ in range(2):
        model = mlp()
        model, opt, loader = make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.5),
            DataLoader(data(), batch_size=4), noise_multiplier=1.0, max_grad_norm=1.0,
            distributed=True, ledger=path)
        starts.append(opt.aggregator.start_step)
        for (x, y, _), _ in zip(loader, range(2)):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        epsilons.append(opt.epsilon(1e-5))
        opt.ledger.close()
    return {"epsilons": epsilons, "events": len(opt.ledger.events), "starts": starts,
            "step": opt.aggregator.step}


def refusals(out: Path, rank: int) -> dict:
    """A float64 model in process 1 only is refused at make_private in both; a release whose
    ledger write fails in process 0 (its file closed) fails in both."""
    model = mlp().double() if rank == 1 else mlp()
    dtype = outcome(lambda: make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.5), DataLoader(data(), batch_size=4),
        noise_multiplier=1.0, max_grad_norm=1.0, distributed=True))
    model = mlp()
    model, opt, loader = make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.5), DataLoader(data(), batch_size=4),
        noise_multiplier=1.0, max_grad_norm=1.0, distributed=True,
        ledger=out / "closed.jsonl")
    x, y, _ = next(iter(loader))
    F.cross_entropy(model(x[:1]), y[:1]).backward()
    opt.accumulate()  # the sampling event is written
    opt.ledger.close()
    opt.zero_grad()
    F.cross_entropy(model(x[1:]), y[1:]).backward()
    return {"dtype": dtype, "release": outcome(opt.step)}


def other_settings(out: Path, rank: int) -> dict:
    """Settings of process 1's own, each refused at make_private in both processes: another
    learning rate, loss reduction, BatchNorm statistics clip or declared metric clip (the
    models would part, or a process would clip at another bound than process 0's ledger
    says); a function among the optimizer's settings is compared by its type, not its address;
    a ledger path given to process 1 is named in a warning (process 0 writes it)."""
    def made(lr=0.5, **options):
        model = mlp() if "batch_norm" not in options else nn.Sequential(
            nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))
        return outcome(lambda: make_private(
            model, torch.optim.SGD(model.parameters(), lr=lr), DataLoader(data(), batch_size=4),
            noise_multiplier=1.0, max_grad_norm=1.0, distributed=True, **options))

    metric = dpcore.Mechanism((dpcore.Group("loss", ("loss",), 1.0 + rank, 4.0),))
    refused = {"lr": made(lr=0.5 + rank),
               "loss_reduction": made(loss_reduction="sum" if rank else "mean"),
               "batch_norm": made(batch_norm=BatchNormStatistics(0.5 + 500 * rank, 3.0)),
               "metrics": made(metrics=[metric])}
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    optimizer.param_groups[0]["warmup"] = lambda step: 1.0  # its repr holds its address
    accepted = outcome(lambda: make_private(
        model, optimizer, DataLoader(data(), batch_size=4), noise_multiplier=1.0,
        max_grad_norm=1.0, distributed=True))
    model = mlp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, opt, _ = make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.5), DataLoader(data(), batch_size=4),
            noise_multiplier=1.0, max_grad_norm=1.0, distributed=True,
            ledger=out / f"rank{rank}-ledger.jsonl")
    opt.ledger.close()
    return {"refused": refused, "accepted": accepted,
            "warnings": [str(w.message) for w in caught],
            "ledger_files": sorted(p.name for p in out.glob("rank*-ledger.jsonl"))}


TWO_GROUPS = dpcore.Mechanism((dpcore.Group("ga", ("a",), 1.0, 0.0),
                               dpcore.Group("gb", ("b",), 1000.0, 0.0)))


def other_releases(out: Path, rank: int) -> dict:
    """At q = 1 (8 records a process), metrics released by both processes: with another clip
    in process 1, refused in both before either records it; with the values' keys in
    another order in process 1, each value released by its own group (every record's
    a = b = 100: a clipped to 1, b not)."""
    model = mlp()
    model, opt, loader = make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.5),
        DataLoader(data(16), batch_size=8), noise_multiplier=1.0, max_grad_norm=1.0,
        seed=0, distributed=True)
    x, y, _ = next(iter(loader))
    F.cross_entropy(model(x), y).backward()
    opt.step()
    events = len(opt.ledger.events)
    other = dpcore.Mechanism((dpcore.Group("loss", ("loss",), 1.0 + 999 * rank, 0.0),))
    clip = outcome(lambda: opt.release({"loss": torch.full((8, 1), 100.0)}, other))
    recorded = len(opt.ledger.events) - events
    values = {"a": torch.full((8, 1), 100.0), "b": torch.full((8, 1), 100.0)}
    if rank == 1:
        values = dict(reversed(values.items()))
    released = opt.release(values, TWO_GROUPS)
    return {"clip": clip, "recorded": recorded, "released": released}


def other_samples(out: Path, rank: int) -> dict:
    """Process 1 steps on the loader's second batch while process 0 steps on its first (a
    loop that skipped a batch); in a second run, process 1 steps on a batch of another
    DataLoader: both refused in both processes, nothing released."""
    outcomes, events = {}, {}
    for case in ("skipped", "foreign"):
        model = mlp()
        model, opt, loader = make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.5),
            DataLoader(data(), batch_size=4), noise_multiplier=1.0, max_grad_norm=1.0, seed=0,
            distributed=True)
        batches = iter(loader)
        if rank == 1 and case == "skipped":
            next(batches)
        if rank == 1 and case == "foreign":
            batches = iter(DataLoader(data(), batch_size=4))
        x, y, _ = next(batches)
        F.cross_entropy(model(x), y).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # process 1's: a batch of another loader
            outcomes[case] = outcome(opt.step)
        events[case] = [type(e).__name__ for e in opt.ledger.events]
    return {"outcomes": outcomes, "events": events}


def main(out: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    out = Path(out)
    rank = dist.get_rank()
    results = {"world": dist.get_world_size(), "same_seed": same_seed(out, rank),
               "adaptive": adaptive(BATCH, distributed=True),
               "batch_norm": batch_norm(BATCH, distributed=True),
               "metrics": metrics(BATCH, distributed=True),
               "noise": noise(out, rank, secure=False),
               "secure_noise": noise(out, rank, secure=True),
               "nan_record": nan_record(out, rank), "other_clip": other_clip(out, rank),
               "failed_micro_batch": failed_micro_batch(out, rank),
               "resumed": resumed(out, rank), "refusals": refusals(out, rank),
               "other_settings": other_settings(out, rank),
               "other_releases": other_releases(out, rank),
               "other_samples": other_samples(out, rank)}
    torch.save(results, out / f"rank{rank}.pt")
    dist.barrier()  # both done before either tears the group down
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
