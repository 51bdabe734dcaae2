"""make_private with moving clips and a budget: the ledger's clip is the clip applied, at the
same step; adaptive clipping costs its total z; training stops when the budget is spent."""

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import dpcore  # noqa: E402
from dpcore.accounting import epsilon  # noqa: E402
from dpcore.ledger import SumQueryEvent  # noqa: E402
from dpcore.schedules import step_decay  # noqa: E402
from dpcore_torch import make_private  # noqa: E402


def setup(n=40, batch=8, **kwargs):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    data = TensorDataset(torch.randn(n, 4), torch.randn(n, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the model, hence norms, stay put
    return (data,) + make_private(model, opt, DataLoader(data, batch_size=batch), seed=0,
                                  **kwargs)


def test_scheduled_clip_in_the_ledger_is_the_clip_applied_at_that_step():
    schedule = dpcore.ClipSchedule(step_decay(every=1, factor=0.5), hold="noise_multiplier")
    data, model, opt, _ = setup(noise_multiplier=0.0, max_grad_norm=1.0, clip_policy=schedule)
    x, y = data.tensors[0][:1] * 100, data.tensors[1][:1]  # one record, norm far above the clip
    for step in range(4):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        released = torch.cat([p.grad.flatten() for p in model.parameters()]).norm() * 8
        clips = [e.clip for e in opt.ledger.events if isinstance(e, SumQueryEvent)]
        assert len(clips) == step + 1
        assert released.item() == pytest.approx(clips[-1], rel=1e-5)
        assert clips[-1] == pytest.approx(0.5 ** step)


def test_adaptive_clipping_turns_on_with_one_argument_at_the_same_cost():
    # q n = 80 records a step: the default count noise sigma_b = q n / 20 = 4 > z / 2
    data, model, opt, loader = setup(n=400, batch=80, noise_multiplier=1.2, max_grad_norm=0.1,
                                     clip_policy="adaptive")
    for x, y in loader:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    steps = opt.ledger.steps()
    assert sum(s.count for s in steps) == len(loader)
    assert all(s.noise_multiplier == pytest.approx(1.2, rel=1e-12) for s in steps)
    clips = [e.clip for e in opt.ledger.events if isinstance(e, SumQueryEvent)
             and e.group == "all"]
    assert clips[0] == pytest.approx(0.1) and clips[-1] != pytest.approx(0.1)


@pytest.mark.parametrize("policy", ["Adaptive", "quantile", 0.5])
def test_an_unknown_clip_policy_is_refused_by_name(policy):
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)
    with pytest.raises(ValueError, match=f"clip_policy must be None .*got {policy!r}"):
        make_private(model, opt, loader, noise_multiplier=1.0, max_grad_norm=1.0,
                     clip_policy=policy)
    make_private(model, opt, loader, noise_multiplier=1.0, max_grad_norm=1.0)  # model as it was


def test_training_stops_cleanly_when_the_budget_is_spent():
    budget = dpcore.PrivacyBudget(target_epsilon=3.0, delta=1e-5, accountant="rdp")
    data, model, opt, loader = setup(noise_multiplier=1.0, max_grad_norm=1.0, budget=budget)
    taken = 0
    while opt.next_step_fits():
        x, y = data.tensors[0][:8], data.tensors[1][:8]
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        taken += 1
    assert taken > 0
    assert epsilon(opt.ledger, 1e-5, accountant="rdp") <= 3.0
    with pytest.raises(dpcore.BudgetExhaustedError):
        opt.step()
    assert sum(s.count for s in opt.ledger.steps()) == taken


def test_records_within_the_clip_count_as_unclipped_whatever_the_clip():
    """PyTorch forms S / max(norm, S) as S * (1 / max(norm, S)), 0.99999994 for about one
    clip in eight in float32: records within the clip were counted as clipped, so adaptive
    clipping moved the clip away from the quantile."""
    from dpcore.adaptive import AdaptiveClipping, QuantileClipping
    from dpcore.aggregation import clip_factors

    clips = torch.rand(3000, generator=torch.Generator().manual_seed(0)).double() * 10 + 0.01
    adaptive = AdaptiveClipping(dpcore.flat(["w"], 1.0, 1.0), QuantileClipping(), 100.0)
    for clip in clips.tolist():
        norms = torch.tensor([[0.0], [clip * 0.5], [clip], [clip * 2]])  # 3 within, 1 beyond
        counts = adaptive.count_sums(clip_factors(norms, [clip]))
        assert counts["unclipped_count:all"].item() == 3 - 0.5 * 4, clip
