"""Checkpoints of a private run: ``optimizer.state_dict()`` holds the aggregator's state beside
the wrapped optimizer's, and a run made private again on the same ledger continues: its
steps numbered on, adaptive clipping from the checkpoint's clip; a checkpoint of more steps
than the ledger holds is refused with nothing loaded."""

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpcore.ledger import SumQueryEvent
from dpcore_torch import make_private


def private(ledger, seed):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(80, 5, generator=g), torch.randint(0, 3, (80,), generator=g))
    return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                        DataLoader(data, batch_size=16), max_grad_norm=0.05,
                        noise_multiplier=1.0, clip_policy="adaptive", ledger=ledger, seed=seed)


def train(model, opt, loader, steps):
    for (x, y), _ in zip(loader, range(steps)):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def clips(ledger):
    return [e.clip for e in ledger.events
            if isinstance(e, SumQueryEvent) and not e.group.startswith("unclipped")]


def test_a_checkpoint_resumes_the_run_on_its_ledger(tmp_path):
    path = tmp_path / "run.jsonl"
    model, opt, loader = private(path, seed=0)
    train(model, opt, loader, 3)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    opt.ledger.close()
    assert opt.state_dict()["dpcore"]["steps"] == 3
    moved = opt.state_dict()["dpcore"]["clips"][0]
    assert moved != pytest.approx(0.05)  # the records' norms are far above the first clip

    buffer.seek(0)
    checkpoint = torch.load(buffer)
    model, opt, loader = private(path, seed=0)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    assert opt.aggregator.start_step == 3 and opt.state  # momentum buffers are back
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    train(model, opt, loader, 1)
    scheduler.step()  # the wrapped optimizer's groups are still the ones a scheduler moves
    assert opt.original_optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    assert opt.aggregator.step == 3
    assert len(clips(opt.ledger)) == 4 and clips(opt.ledger)[3] == pytest.approx(moved)
    opt.ledger.close()


def test_a_checkpoint_ahead_of_the_ledger_is_refused_and_nothing_loaded(tmp_path):
    model, opt, loader = private(tmp_path / "run.jsonl", seed=0)
    train(model, opt, loader, 2)
    state = opt.state_dict()
    opt.ledger.close()
    model, fresh, loader = private(None, seed=0)  # the run's ledger forgotten
    with pytest.raises(ValueError, match="after 2 steps, but the ledger holds 0"):
        fresh.load_state_dict(state)
    assert not fresh.state and fresh.aggregator.mechanism.groups[0].clip == 0.05


def test_plain_optimizer_states_load_either_way():
    """A plain SGD's state loads into the private optimizer, and the private one's into a
    plain SGD (which leaves the aggregator's entry aside)."""
    model, opt, loader = private(None, seed=0)
    train(model, opt, loader, 1)
    plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plain.load_state_dict(opt.state_dict())
    assert plain.state_dict()["state"].keys() == opt.original_optimizer.state_dict()["state"].keys()
    opt.load_state_dict(plain.state_dict())


def test_a_resumed_adaptive_run_refuses_a_plain_optimizer_state(tmp_path):
    """Without the 'dpcore' entry, adaptive clipping started again from max_grad_norm (0.05,
    not the run's 0.0598), silently."""
    path = tmp_path / "run.jsonl"
    model, opt, loader = private(path, seed=0)
    train(model, opt, loader, 3)
    plain = opt.original_optimizer.state_dict()
    opt.ledger.close()
    model, opt, loader = private(path, seed=0)
    with pytest.raises(ValueError, match="no 'dpcore' entry .* adaptive clipping"):
        opt.load_state_dict(plain)
    assert not opt.state
    opt.ledger.close()


def test_a_checkpoint_torch_refuses_loads_nothing_of_the_aggregator(tmp_path):
    """torch refused the optimizer's part after the aggregator's had been loaded: the clip
    was the checkpoint's."""
    path = tmp_path / "run.jsonl"
    model, opt, loader = private(path, seed=0)
    train(model, opt, loader, 3)
    state = opt.state_dict()
    opt.ledger.close()
    state["param_groups"][0]["params"] = state["param_groups"][0]["params"][:2]  # not ours
    model, fresh, loader = private(path, seed=0)
    with pytest.raises(ValueError):
        fresh.load_state_dict(state)
    assert fresh.aggregator.mechanism.groups[0].clip == 0.05 and not fresh.state
    fresh.ledger.close()
