"""A linear layer class of another library (GPT-2's Conv1D: x @ weight + bias, weight of shape
(in, out)) registered with register_linear takes the Linear rule: per-example gradients
against a float64 one-example-at-a-time oracle, ghost norms against materialised ones, and a
class whose forward is not that map refused at its first call."""

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from dpcore_torch import PerExampleEngine, register_linear  # noqa: E402
from dpcore_torch.fallback import FallbackUnit  # noqa: E402
from dpcore_torch.layers import RULES  # noqa: E402


class Conv1D(nn.Module):
    """As transformers.pytorch_utils.Conv1D: the positions flattened, weight (nx, nf)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.3)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class Plain(nn.Module):
    """F.linear with a weight (out, in) and no bias."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) * 0.3)
        self.bias = None

    def forward(self, x):
        return nn.functional.linear(x, self.weight)


class NotLinear(Conv1D):
    def forward(self, x):
        return torch.relu(super().forward(x))


@pytest.fixture(autouse=True)
def registry():
    saved = dict(RULES)
    register_linear(Conv1D, transposed=True)
    register_linear(Plain)
    register_linear(NotLinear, transposed=True)
    yield
    RULES.clear()
    RULES.update(saved)


class Block(nn.Module):
    def __init__(self, layer=Conv1D):
        super().__init__()
        self.attn = layer(48, 16)
        self.proj = Plain(48, 20)
        self.head = nn.Linear(20, 3)

    def forward(self, x):
        h = torch.tanh(self.proj(torch.tanh(self.attn(x))))
        return self.head(h.flatten(1, -2).mean(1) if h.dim() > 2 else h)


def oracle(model, x):
    rows = [torch.autograd.grad((model(x[i:i + 1]) ** 2).sum(), list(model.parameters()))
            for i in range(x.shape[0])]
    return {n: torch.stack([r[k] for r in rows])
            for k, (n, _) in enumerate(model.named_parameters())}


@pytest.mark.parametrize("shape", [(6, 7, 16), (1, 7, 16), (6, 2, 3, 16), (6, 16)])
@pytest.mark.parametrize("prefer", ["memory", "time"])
def test_registered_layers_take_the_linear_rule_and_match_the_oracle(shape, prefer):
    torch.manual_seed(0)
    model = Block().double()
    x = torch.randn(*shape, dtype=torch.float64)
    expected = oracle(copy.deepcopy(model), x)
    engine = PerExampleEngine(model, loss_reduction="sum", prefer=prefer)
    assert not any(isinstance(u, FallbackUnit) for u in engine.units)
    out = model(x)
    (out ** 2).sum().backward()
    names = list(engine.params)
    norms = engine.sq_norms(names)  # ghost (or materialised, with prefer="time") first
    exact = torch.stack([expected[n].flatten(1).square().sum(1) for n in names], 1)
    assert torch.allclose(norms, exact, rtol=1e-8)
    c = torch.rand(shape[0], 1, dtype=torch.float64)
    sums = engine.clipped_sums(c, dict.fromkeys(names, 0))  # book-keeping
    for n in names:
        assert torch.allclose(sums[n], torch.einsum("b,b...->...", c[:, 0], expected[n]),
                              rtol=1e-9), n
    engine.clear()
    (model(x) ** 2).sum().backward()
    got = engine.per_example_grads()
    for n, e in expected.items():
        assert torch.allclose(got[n], e, rtol=1e-10, atol=1e-12), n
    engine.detach()
    assert torch.equal(model(x), out.detach())  # the class's own forward, as before


def test_a_registered_class_that_is_not_linear_is_refused_at_its_first_call():
    model = Block(NotLinear)
    PerExampleEngine(model)
    with pytest.raises(ValueError, match="NotLinear.forward does not compute x @ weight"):
        model(torch.randn(2, 3, 16))


def test_only_modules_are_registered_and_dpcores_own_rules_stay():
    with pytest.raises(TypeError, match="nn.Module subclass"):
        register_linear(len)
    with pytest.raises(ValueError, match="rule of dpcore's own"):
        register_linear(nn.Linear)


def test_registered_layers_run_under_autocast():
    """Under bfloat16 autocast the first-call check compares the rule's output with the
    class's own at the output's precision (the two agree exactly on this CPU)."""
    torch.manual_seed(3)
    model = Block()
    engine = PerExampleEngine(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(4, 7, 16))
    out.float().sum().backward()
    assert torch.isfinite(engine.sq_norms(list(engine.params))).all()
