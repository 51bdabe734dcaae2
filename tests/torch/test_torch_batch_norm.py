"""BatchNorm with privately released statistics (make_private(..., batch_norm=...)) against
float64 oracles: the released statistics are the clipped sums plus the recorded noise, the
gradients those of the model normalised by them as constants, example by example; the
noise has the std the ledger records; the step's queries are priced together."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpcore
from dpcore.ledger import SamplingEvent, SumQueryEvent
from dpcore_torch import BatchNormStatistics, make_private


def convnet():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(3 * 6 * 6, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 3))


def dataset(n=60, seed=1):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 1, 8, 8, generator=g) * 2 + 0.5,
                         torch.randint(0, 3, (n,), generator=g))


def private(model, settings=BatchNormStatistics(3.0, 4.0), *, batch_size=20, **options):
    options.setdefault("noise_multiplier", 1.0)
    options.setdefault("max_grad_norm", 1.0)
    return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                        DataLoader(dataset(), batch_size=batch_size), batch_norm=settings,
                        **options)


def oracle_forward(model, x, released):
    """The model in float64, every BatchNorm normalising with its layer's released (mean,
    var) as constants; also the BatchNorm layers' inputs."""
    twin = copy.deepcopy(model).double()
    inputs = {}
    h = x.double()
    for name, layer in twin.named_children():
        if isinstance(layer, nn.modules.batchnorm._BatchNorm):
            inputs[name] = h
            mean, var = (t.double() for t in released[name])
            h = F.batch_norm(h, mean, var, layer.weight, layer.bias, False, 0.0, layer.eps)
        else:
            h = layer(h)
    return twin, h, inputs


def per_example_oracle(model, x, y, released, clip):
    """sum_i min(1, clip / ||g_i||) g_i over q n = 20 in float64, g_i the gradient of example
    i's loss alone in the model normalised by the released statistics."""
    total = None
    for i in range(len(x)):
        twin, out, _ = oracle_forward(model, x[i:i + 1], released)
        grads = torch.autograd.grad(F.cross_entropy(out, y[i:i + 1]), list(twin.parameters()))
        norm = torch.sqrt(sum(g.square().sum() for g in grads))
        factor = min(1.0, clip / float(norm))
        total = [factor * g for g in grads] if total is None else [
            t + factor * g for t, g in zip(total, grads)]
    return [t / 20 for t in total]


@pytest.mark.parametrize("mode", ["auto", "vmap"])
@pytest.mark.parametrize("clip", [1e6, 0.05])
def test_statistics_are_the_clipped_release_and_gradients_those_of_its_constants(mode, clip):
    """The noise's normals recorded as the generator hands them out: each layer's released
    mean and variance are its records' per-channel (mean, mean square), clipped jointly to 2,
    summed, plus 0.5 * 2 times the recorded normals, over q n (float64 oracle). The gradient
    (its noise zero) is the sum of the examples' clipped gradients, each taken one example
    at a time in the float64 model normalised by the released statistics as constants, over
    q n: with a clip above every norm, and with one below every norm."""
    model = convnet()
    mechanism = dpcore.flat([n for n, _ in model.named_parameters()], clip, 0.0)
    model, opt, _ = private(model, BatchNormStatistics(2.0, 0.5), clipping=mechanism,
                            noise_multiplier=None, seed=3, mode=mode)
    drawn, draw = [], opt.aggregator.standard_normal

    def recorded(rng, shape, like):
        rng, normals = draw(rng, shape, like)
        drawn.append(normals.clone())
        return rng, normals

    opt.aggregator.standard_normal = recorded
    x, y = dataset()[:17]  # a sample of 17 records; the averages divide by q n = 20
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    released = opt.engine.batch_norm.released
    before = copy.deepcopy(model)  # a plain copy: the weights the step's gradient is of
    opt.step()
    qn = opt.aggregator.expected_size  # 20: q = 1/3 of 60
    assert qn == pytest.approx(20)
    _, _, inputs = oracle_forward(before, x, released)
    for k, name in enumerate(["1", "5"]):  # the layers' draws, in call order
        rows = inputs[name].flatten(2) if inputs[name].dim() > 2 else inputs[name][:, :, None]
        vectors = torch.cat([rows.mean(2), rows.square().mean(2)], 1)
        factors = (2.0 / vectors.norm(dim=1)).clamp(max=1.0)
        assert factors.min() < 0.99 and factors.max() == 1.0, factors  # some rows clipped
        noisy = ((factors[:, None] * vectors).sum(0) + 1.0 * drawn[k].double()) / qn
        c = vectors.shape[1] // 2
        torch.testing.assert_close(released[name][0].double(), noisy[:c], rtol=1e-5, atol=1e-6)
        var = (noisy[c:] - noisy[:c] ** 2).clamp(min=0)
        torch.testing.assert_close(released[name][1].double(), var, rtol=1e-5, atol=1e-6)
    expected = per_example_oracle(before, x, y, released, clip)
    for (name, p), e in zip(model.named_parameters(), expected):
        torch.testing.assert_close(p.grad.double(), e, rtol=1e-5, atol=2e-6, msg=name)


def test_statistics_noise_has_the_std_the_ledger_records_and_the_step_its_total_z(tmp_path):
    """Zero inputs to a BatchNorm1d(256): its released mean times q n is the noise, of std
    z_bn * clip = 6 (40 steps: 10,240 values, relative standard error 0.7%, 4 of them
    allowed, so a 10% error fails). Each step's events are its sampling, the statistics'
    query and the gradient's; Eq. (1) over them gives the noise_multiplier asked for."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 256), nn.BatchNorm1d(256), nn.Linear(256, 2))
    nn.init.zeros_(model[0].weight)
    nn.init.zeros_(model[0].bias)
    data = TensorDataset(torch.zeros(400, 8), torch.zeros(400, dtype=torch.long))
    model, opt, loader = make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.0), DataLoader(data, batch_size=20),
        noise_multiplier=0.9, max_grad_norm=1.0, seed=5, ledger=tmp_path / "run.jsonl",
        batch_norm=BatchNormStatistics(3.0, 2.0))
    means = []
    for _ in range(2):  # 20 steps an epoch
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            means.append(opt.engine.batch_norm.released["1"][0] * opt.aggregator.expected_size)
            opt.step()
    noise = torch.cat(means).double()
    event = SumQueryEvent("1.statistics", 3.0, 6.0)
    assert event in opt.ledger.events
    tolerance = 4 / math.sqrt(2 * noise.numel())
    assert abs(noise.std().item() / 6.0 - 1) < tolerance < 0.03
    assert abs(noise.mean().item()) < 4 * 6.0 / math.sqrt(noise.numel())
    kinds = [type(e) for e in opt.ledger.events[:4]]
    assert kinds == [SamplingEvent, SumQueryEvent, SumQueryEvent, SamplingEvent]
    assert opt.ledger.events[1].group == "1.statistics" and opt.ledger.events[2].group == "all"
    (step,) = opt.ledger.steps()
    assert step.count == 40 and step.noise_multiplier == pytest.approx(0.9)
    # the gradient's share: 1/0.9^2 - 1/2^2 = 1/z_g^2
    assert opt.noise_multiplier == pytest.approx((0.9 ** -2 - 0.25) ** -0.5)


def test_target_epsilon_covers_the_statistics():
    model, opt, loader = private(convnet(), BatchNormStatistics(3.0, 5.0), seed=0,
                                 noise_multiplier=None, target_epsilon=3.0, target_delta=1e-5,
                                 epochs=2)
    for _ in range(2):
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    assert opt.epsilon(1e-5) == pytest.approx(3.0, rel=1e-3) and opt.epsilon(1e-5) <= 3.0
    assert len([e for e in opt.ledger.events if isinstance(e, SumQueryEvent)]) == 3 * 6


def test_eval_mode_copies_and_detach_see_a_plain_batch_norm():
    """Eval mode normalises with the running statistics (moved by the releases) and
    releases nothing; a copy of the model is the plain model; detach restores it."""
    model, opt, loader = private(convnet(), seed=0)
    x, y = next(iter(loader))
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    events = len(opt.ledger.events)
    bn = model[1]
    assert float(bn.num_batches_tracked) == 1 and not torch.equal(bn.running_mean,
                                                                 torch.zeros(3))
    model.eval()
    h = model[0](x)
    expected = F.batch_norm(h, bn.running_mean, bn.running_var, bn.weight, bn.bias, False,
                            0.0, bn.eps)
    torch.testing.assert_close(bn(h), expected)
    model(x)
    assert len(opt.ledger.events) == events
    twin = copy.deepcopy(model)
    assert "forward" not in twin[1].__dict__ and type(twin[1]) is nn.BatchNorm2d
    torch.testing.assert_close(twin[1].running_mean, bn.running_mean)
    opt.engine.detach()
    assert "forward" not in bn.__dict__


def test_what_cannot_be_priced_or_bound_is_refused():
    """Nothing released or recorded beyond what the refused call's step had."""
    model, opt, loader = private(convnet(), seed=0)
    x, y = next(iter(loader))
    opt.zero_grad()
    with torch.no_grad(), pytest.raises(RuntimeError, match="without gradients"):
        model(x)
    assert opt.ledger.events == ()
    out = model(x)
    recorded = len(opt.ledger.events)  # the step's sampling and the statistics' queries
    assert recorded == 3
    with pytest.raises(RuntimeError, match="ran twice in training mode in one step"):
        model(x)
    assert len(opt.ledger.events) == recorded
    F.cross_entropy(out, y).backward()
    with pytest.raises(ValueError, match=r"accumulate\(\) with BatchNorm"):
        opt.accumulate()
    opt.step()  # the step goes on
    assert len(opt.ledger.events) == recorded + 1
    opt.engine.detach()

    with pytest.raises(ValueError, match=r"raise the statistics' noise_multiplier above 2\.828"):
        private(convnet(), BatchNormStatistics(3.0, 2.5), noise_multiplier=2.0)
    _, opt, _ = private(convnet(), noise_multiplier=0.0)  # a non-private run, not 1/0
    assert opt.noise_multiplier == 0.0
    opt.engine.detach()
    with pytest.raises(ValueError, match="has no BatchNorm layer"):
        private(nn.Sequential(nn.Flatten(), nn.Linear(64, 3)))
    with pytest.raises(TypeError, match="BatchNormStatistics"):
        private(convnet(), (3.0, 2.0))
    with pytest.raises(ValueError, match="track_running_stats=False"):
        private(nn.Sequential(nn.Flatten(), nn.Linear(64, 3),
                              nn.BatchNorm1d(3, track_running_stats=False)))
    with pytest.raises(TypeError, match="nn.BatchNorm1d/2d/3d"):
        private(nn.Sequential(nn.Flatten(), nn.Linear(64, 3), nn.SyncBatchNorm(3)))
    with pytest.raises(ValueError, match="clip"):
        BatchNormStatistics(0.0, 1.0)
    model = convnet()  # without batch_norm=: refused, the message says how
    with pytest.raises(dpcore_torch_errors(), match="batch_norm=BatchNormStatistics"):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(dataset()), noise_multiplier=1.0, max_grad_norm=1.0)


def dpcore_torch_errors():
    from dpcore_torch import NotPerExampleError

    return NotPerExampleError


def test_an_empty_sample_releases_noise_for_the_statistics_and_the_gradient():
    model, opt, _ = private(convnet(), seed=0)
    x, y = dataset()[:0]
    opt.zero_grad()
    out = model(x)
    assert out.shape == (0, 3)
    F.cross_entropy(out, y, reduction="sum").backward()
    opt.step()
    released = opt.engine.batch_norm.released
    assert set(released) == {"1", "5"} and released["1"][0].abs().min() > 0  # pure noise
    assert [type(e) for e in opt.ledger.events] == [SamplingEvent] + [SumQueryEvent] * 3
    assert all(p.grad.abs().max() > 0 for p in model.parameters())


def test_a_budget_prices_the_statistics_and_stops_at_the_forward_pass():
    """Under a budget the step begins at the forward pass, so the step that would exceed it
    is refused there (BudgetExhaustedError, nothing recorded); the steps taken, statistics
    included, stay within the target."""
    model, opt, loader = private(convnet(), BatchNormStatistics(3.0, 2.0), seed=0,
                                 budget=dpcore.PrivacyBudget(6.0, 1e-5, accountant="rdp"))
    assert opt.aggregator.next_noise_multiplier() == pytest.approx(1.0)  # the step's total
    taken = 0
    with pytest.raises(dpcore.BudgetExhaustedError):
        while True:
            for x, y in loader:
                opt.zero_grad()
                out = model(x)
                F.cross_entropy(out, y).backward()
                opt.step()
                taken += 1
    events = opt.ledger.events
    assert isinstance(events[-1], SumQueryEvent) and events[-1].group == "all"
    assert opt.ledger.steps()[0].count == taken and taken > 3
    rdp = {"accountant": "rdp"}
    assert opt.epsilon(1e-5, **rdp) <= 6.0 < dpcore.accounting.epsilon(
        [(1 / 3, 1.0, taken + 1)], 1e-5, **rdp)


@pytest.mark.parametrize("compile_first", [True, False])
def test_a_compiled_model_releases_the_same_statistics_and_steps(compile_first):
    """torch.compile (dynamo, the eager backend) before or after make_private: the release
    runs outside the traced graph, and three steps give the uncompiled model's statistics,
    ledger and parameters."""
    import torch._dynamo

    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        model = convnet()
        if compiled and compile_first:
            model = torch.compile(model, backend="eager")
        model, opt, _ = private(model, seed=0)
        if compiled and not compile_first:
            model = torch.compile(model, backend="eager")
        x, y = dataset()[:19]
        released = []
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            (first,) = [v for k, v in opt.engine.batch_norm.released.items()
                        if k.endswith("1")]  # "_orig_mod.1" inside a compiled wrapper
            released.append(first[1])
            opt.step()
        events = [repr(e).replace("_orig_mod.", "") for e in opt.ledger.events]
        runs.append((released, events, [p.detach().clone() for p in model.parameters()]))
    (eager, events, weights), (compiled, compiled_events, compiled_weights) = runs
    assert compiled_events == events
    for a, b in zip(eager + weights, compiled + compiled_weights, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
