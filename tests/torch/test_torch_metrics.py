"""Metrics of a step's sample released by ``optimizer.release``: the clipped average of the
batch last passed forward (float64 oracle) as a query of that batch's step, before or after
``optimizer.step()``, priced with the step (also by a budget, when declared)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpcore
from dpcore.ledger import SamplingEvent, SumQueryEvent
from dpcore_torch import make_private

ACCURACY = dpcore.Mechanism((dpcore.Group("accuracy", ("correct", "loss"), 1.0, 0.0),))


def private(**options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(80, 5, generator=g), torch.randint(0, 3, (80,), generator=g))
    options.setdefault("noise_multiplier", 1.0)
    return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                        DataLoader(data, batch_size=8), max_grad_norm=1.0, seed=0, **options)


def metric(out, y):
    """Per record: correct (0/1) and its loss, scaled so that some records are clipped."""
    loss = F.cross_entropy(out, y, reduction="none").detach()
    return {"correct": (out.argmax(1) == y).double()[:, None], "loss": 2 * loss.double()[:, None]}


def oracle(values, expected_size):
    joined = torch.cat([values["correct"], values["loss"]], 1)
    factors = (1.0 / joined.norm(dim=1)).clamp(max=1.0)
    return (factors[:, None] * joined).sum(0) / expected_size


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_metric_lands_on_its_batchs_step(when):
    """Before optimizer.step() the release begins the batch's step (its sampling event first,
    the gradient's queries after the metric's); after it, the metric joins the step just
    taken. Either way one sampling event per step, and the value is the clipped average."""
    model, opt, loader = private()
    for k, (x, y) in enumerate(loader):
        opt.zero_grad()
        out = model(x)
        F.cross_entropy(out, y).backward()
        values = metric(out, y)
        if when == "before":
            released = opt.release(values, ACCURACY)
        opt.step()
        if when == "after":
            released = opt.release(values, ACCURACY)
        got = torch.cat([released["correct"], released["loss"]])
        torch.testing.assert_close(got, oracle(values, opt.aggregator.expected_size))
        if k == 2:
            break
    kinds = [(type(e).__name__, getattr(e, "group", None)) for e in opt.ledger.events]
    step = [("SamplingEvent", None), ("SumQueryEvent", "accuracy"), ("SumQueryEvent", "all")]
    if when == "after":
        step = [step[0], step[2], step[1]]
    assert kinds == step * 3


def test_a_metric_under_a_budget_must_be_declared():
    noisy = dpcore.Mechanism((dpcore.Group("accuracy", ("correct", "loss"), 1.0, 4.0),))
    budget = dpcore.PrivacyBudget(8.0, 1e-5, accountant="rdp")
    model, opt, loader = private(budget=budget, metrics=[noisy])
    assert opt.aggregator.next_noise_multiplier() == pytest.approx(1.0)  # the step's total
    assert opt.noise_multiplier == pytest.approx((1 - 1 / 16) ** -0.5)  # the gradient's share
    x, y = next(iter(loader))
    out = model(x)
    F.cross_entropy(out, y).backward()
    opt.step()
    opt.release(metric(out, y), noisy)
    with pytest.raises(RuntimeError, match="released this extra mechanism already"):
        opt.release(metric(out, y), noisy)
    undeclared = dpcore.Mechanism((dpcore.Group("other", ("correct", "loss"), 1.0, 4.0),))
    with pytest.raises(RuntimeError, match="not given as extra"):
        opt.release(metric(out, y), undeclared)
    assert [type(e) for e in opt.ledger.events] == [SamplingEvent] + [SumQueryEvent] * 2


def test_the_target_epsilon_covers_the_metrics_released_every_step():
    """The calibrated z is the step's total: a declared metric takes its share from the
    gradient's (1/z_g^2 = 1/z^2 - 1/z_m^2), so the run with a metric released at every
    step spends the target epsilon, not more."""
    noisy = dpcore.Mechanism((dpcore.Group("accuracy", ("correct", "loss"), 1.0, 2.0),))
    model, opt, loader = private(noise_multiplier=None, target_epsilon=3.0, target_delta=1e-5,
                                 epochs=2, metrics=[noisy])
    for _ in range(2):
        for x, y in loader:
            opt.zero_grad()
            out = model(x)
            F.cross_entropy(out, y).backward()
            opt.step()
            opt.release(metric(out, y), noisy)
    steps = opt.ledger.steps()
    assert sum(s.count for s in steps) == 20 and len(steps) == 1
    z = steps[0].noise_multiplier
    assert opt.noise_multiplier == pytest.approx((z ** -2 - 0.25) ** -0.5, rel=1e-12)
    assert opt.epsilon(1e-5) == pytest.approx(3.0, rel=2e-3)
    with pytest.raises(ValueError, match=r"metrics \['accuracy'\] spend all of the step's"):
        private(noise_multiplier=2.5, metrics=[noisy])
    with pytest.raises(TypeError, match="metrics must hold dpcore Mechanisms"):
        private(metrics=["accuracy"])


def test_no_metric_before_the_first_batch():
    _, opt, _ = private()
    with pytest.raises(RuntimeError, match="no sample to release from"):
        opt.release({"correct": torch.zeros(2, 1), "loss": torch.zeros(2, 1)}, ACCURACY)
    assert opt.ledger.events == ()
