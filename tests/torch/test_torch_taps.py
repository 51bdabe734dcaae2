"""A fallback module's own parameters used by broadcasting operations (x + p, x * p,
p.expand(B, ...)) take their per-example gradients from the operations' backprops (taps);
any other use, or a use the taps cannot see, leaves the call to the replay. Both against a
float64 one-example-at-a-time oracle."""

import copy
import dataclasses

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from dpcore_torch import NotPerExampleError, PerExampleEngine  # noqa: E402
from dpcore_torch.fallback import FallbackUnit  # noqa: E402

T, D = 4, 6


class Scaled(torch.autograd.Function):
    """x * p with its own backward: a use of p the torch function mode does not see (its
    forward runs without gradients)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, p):
        return x * p

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, p = ctx.saved_tensors
        return g * p, (g * x).sum_to_size(p.shape)


class Uses(nn.Module):
    """Parameters of its own used in one of several ways, between two Linear layers."""

    def __init__(self, form):
        super().__init__()
        self.form = form
        self.token = nn.Parameter(torch.randn(1, 1, D))
        self.position = nn.Parameter(torch.randn(1, T + 1, D))
        self.gain = nn.Parameter(torch.randn(D))
        self.bias = nn.Parameter(torch.randn(T + 1, D))

    def forward(self, x):
        token = self.token.expand(x.shape[0], -1, -1)
        h = torch.cat([token, x], 1)
        if self.form == "broadcast":  # every tapped form
            h = h + self.position
            h = self.gain * torch.tanh(h) - self.bias
            h = torch.add(h, self.bias, alpha=0.5) * self.gain
            h = torch.sub(self.position.expand_as(h), h, alpha=2.0) + h * 0.3
            h = self.position - h
            h = h + torch.tanh(h) * self.gain.detach() * self.gain.shape[0]  # no use
            h.mul_(2.0)  # in place after a tapped result
            return h
        if self.form == "matmul":  # not a broadcasting form: replayed
            return h @ torch.diag(self.gain) + self.position + self.bias
        if self.form == "index":
            return h * self.gain[0] + self.position + self.bias
        if self.form == "invisible":  # a use only autograd sees: the check sends it back
            return Scaled.apply(h + self.position, self.gain) + self.bias
        raise ValueError(self.form)


class Model(nn.Module):
    def __init__(self, form):
        super().__init__()
        self.embed = nn.Linear(3, D)
        self.uses = Uses(form)
        self.head = nn.Linear(D, 2)

    def forward(self, x):
        return self.head(self.uses(self.embed(x)).mean(1))


def oracle(model, x):
    named = list(model.named_parameters())
    rows = [torch.autograd.grad((model(x[i:i + 1]) ** 2).sum(), [p for _, p in named],
                                allow_unused=True) for i in range(x.shape[0])]
    return {n: torch.stack([torch.zeros_like(p) if r[k] is None else r[k] for r in rows])
            for k, (n, p) in enumerate(named)}


def per_example(model, x):
    engine = PerExampleEngine(model, loss_reduction="sum")
    (model(x) ** 2).sum().backward()
    (unit,) = [u for u in engine.units if isinstance(u, FallbackUnit)]
    (call,) = unit.calls
    tapped = call.taps.grads(torch.float64) is not None
    return engine.per_example_grads(), tapped


@pytest.mark.parametrize("form, tapped", [("broadcast", True), ("matmul", False),
                                          ("index", False), ("invisible", False)])
@pytest.mark.parametrize("batch", [1, 5])
def test_taps_or_the_replay_match_the_oracle(form, tapped, batch):
    torch.manual_seed(0)
    model = Model(form).double()
    x = torch.randn(batch, T, 3, dtype=torch.float64)
    expected = oracle(copy.deepcopy(model), x)
    got, used_taps = per_example(model, x)
    assert used_taps == tapped
    for n, e in expected.items():
        assert torch.allclose(got[n], e, rtol=1e-10, atol=1e-12), n


def test_taps_stay_within_rounding_in_float32():
    """The check of the summed taps against the received gradient passes in float32 for a
    batch of 512 (its bound is the rounding of the sums, not a fixed tolerance)."""
    torch.manual_seed(1)
    model = Model("broadcast")
    x = torch.randn(512, T, 3)
    got, used_taps = per_example(model, x)
    assert used_taps
    expected = oracle(copy.deepcopy(model).double(), x.double())
    for n, e in expected.items():
        assert torch.allclose(got[n].double(), e, rtol=1e-4, atol=1e-5 * e.abs().max()), n


class Moving(nn.Module):
    """A bias added where axis 0 is not the batch, or after the batch is reordered: row i of
    the backprop there is not example i's, so the taps must not credit it to example i."""

    def __init__(self, form):
        super().__init__()
        self.form = form
        self.bias = nn.Parameter(torch.randn(D))
        self.gain = nn.Parameter(torch.randn(1))
        self.head = nn.Linear(D, 2)

    def forward(self, x):  # x (B, T, D) with B == T
        if self.form == "time-major":
            h = torch.tanh(x.transpose(0, 1) + self.bias).transpose(0, 1)
        elif self.form == "sorted":
            order = x[:, 0, 0].argsort()
            h = torch.tanh(x[order] + self.bias)[order.argsort()]
        elif self.form == "heads":  # the gain expanded over B == H heads, not the batch
            h = x * self.gain.expand(x.shape[1], 1, 1).transpose(0, 1)
        elif self.form == "set in place":  # the parameter written into the activations
            h = x.clone()
            h[:, :, 0] = self.gain
        return self.head(h.mean(1))


@pytest.mark.parametrize("form", ["time-major", "sorted", "heads", "set in place"])
def test_uses_whose_rows_are_not_the_examples_go_to_the_replay(form):
    """Each example's gradient depends on its own record only (a change of record 3 leaves
    example 0's gradient as the oracle has it), in float32 too."""
    torch.manual_seed(3)
    for dtype in (torch.float64, torch.float32):
        model = Moving(form).to(dtype)
        x = torch.randn(T, T, D, dtype=dtype)
        expected = oracle(copy.deepcopy(model).double(), x.double())
        engine = PerExampleEngine(model, loss_reduction="sum")
        (model(x) ** 2).sum().backward()
        (unit,) = [u for u in engine.units if isinstance(u, FallbackUnit)]
        assert unit.calls[0].taps.grads(dtype) is None
        got = engine.per_example_grads()
        for n, e in expected.items():
            assert torch.allclose(got[n].double(), e, rtol=1e-5, atol=1e-6), (n, dtype)


class Mixing(nn.Module):
    """A module whose output for an example depends on the other examples."""

    def __init__(self, form):
        super().__init__()
        self.form = form
        self.bias = nn.Parameter(torch.randn(D))

    def forward(self, x):
        if self.form == "batch statistics":
            return (x - x.mean(0)) * self.bias
        buffer = torch.zeros_like(x)  # "aliased buffer": the batch written into a buffer,
        alias = buffer[:]             # read reversed through a view made before
        buffer.add_(x)
        return torch.tanh(alias[torch.arange(x.shape[0]).flip(0)] + self.bias)


@pytest.mark.parametrize("form", ["batch statistics", "aliased buffer"])
def test_a_module_mixing_the_examples_is_refused(form):
    """Neither tapped (its rows are not followed to the end) nor replayed: its output for
    example i in the batch is not its output for example i alone, which the replay checks,
    so each "per-example" gradient would depend on other records."""
    torch.manual_seed(4)
    model = Mixing(form).double()
    engine = PerExampleEngine(model, loss_reduction="sum")
    (model(torch.randn(5, T, D, dtype=torch.float64)) ** 2).sum().backward()
    (unit,) = [u for u in engine.units if isinstance(u, FallbackUnit)]
    assert unit.calls[0].taps.grads(torch.float64) is None
    with pytest.raises(ValueError, match="mixes the examples of a batch"):
        engine.per_example_grads()


REVERSED = [3, 2, 1, 0]  # with B = 4: row k of a result is example 3 - k's


@torch.jit.script
def _flipped(h: torch.Tensor) -> torch.Tensor:
    return h.flip(0)  # a scripted function: no torch function mode sees its operations


class Hidden(nn.Module):
    """Examples mixed in ways a row tracker could miss (from an audit); B = D = 4."""

    def __init__(self, form):
        super().__init__()
        self.form = form
        self.bias = nn.Parameter(torch.randn(4))
        self.attn = nn.MultiheadAttention(4, 1, batch_first=True)

    def forward(self, x):
        o = torch.tanh(x) + self.bias  # a tapped use
        if self.form == "expand to a new axis of B":
            z = o.expand(4, 4, 4)  # z[j] holds the whole batch
            return torch.tanh((z * torch.eye(4)[REVERSED][:, :, None]).sum(1))
        if self.form == "a Python bool index":  # (4, B, D): axis 0 is the index's
            z = o[:, None, :] * torch.ones(3, 1)
            return torch.tanh(z[:, torch.tensor([2, 1, 0, 0]), :, True].sum(1))
        if self.form == "a view of a buffer":
            buffer = torch.zeros(4, 4)
            buffer.view_as(o).copy_(o)
            return torch.tanh(buffer.flip(0))
        if self.form == "attention by keyword":
            h = self.attn(query=o[:, None], key=o[:, None], value=o[:, None],
                          need_weights=False)[0]
            return h[:, 0].flip(0)
        if self.form == "a scripted flip":
            return _flipped(o)
        return torch.tanh(o * o.new_tensor(o).flip(0))  # "a copy by new_tensor"


@pytest.mark.filterwarnings("ignore:To copy construct", "ignore:`torch.jit.script` is")
@pytest.mark.parametrize("form", ["expand to a new axis of B", "a Python bool index",
                                  "a view of a buffer", "attention by keyword",
                                  "a copy by new_tensor", "a scripted flip"])
def test_examples_mixed_out_of_sight_are_never_credited_by_taps(form):
    """None of these is tapped; the replay refuses them (its output check, or torch.func),
    never giving a gradient that depends on another record. (The independence check, off
    here, refuses the attention form already at its forward pass.)"""
    torch.manual_seed(5)
    model = Hidden(form)
    engine = PerExampleEngine(model, loss_reduction="sum", check_independence=False)
    (model(torch.randn(4, 4)) ** 2).sum().backward()
    unit = next(u for u in engine.units if isinstance(u, FallbackUnit)
                and u.module is model)
    assert unit.calls[0].taps.grads(torch.float32) is None
    with pytest.raises((ValueError, RuntimeError)):
        engine.per_example_grads()


class Keyword(nn.Module):
    """A per-example tensor passed by keyword (against the fallback's contract), used
    reversed: it is not shared, so its use is not tapped."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(4))

    def forward(self, x, condition=None):
        return torch.tanh(x + self.bias) * condition.flip(0)


def test_a_per_example_tensor_by_keyword_is_not_tapped():
    model = Keyword()
    engine = PerExampleEngine(model, loss_reduction="sum")
    (model(torch.randn(4, 4), condition=torch.randn(4, 4)) ** 2).sum().backward()
    (unit,) = [u for u in engine.units if isinstance(u, FallbackUnit)]
    assert unit.calls[0].taps.grads(torch.float32) is None
    with pytest.raises(ValueError):
        engine.per_example_grads()


@dataclasses.dataclass
class Output:
    value: torch.Tensor


class Boxed(nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return Output(x + self.bias)


def test_outputs_in_an_object_dpcore_cannot_look_into_are_refused():
    """Their backprops could not be kept: the gradient would silently be zero."""
    model = Boxed()
    PerExampleEngine(model)
    with pytest.raises(TypeError, match="returned a Output holding tensors"):
        model(torch.randn(3, 4))


def test_a_layer_norm_over_the_batch_axis_is_refused():
    norm = nn.LayerNorm([4, 3])
    PerExampleEngine(norm)
    with pytest.raises(NotPerExampleError, match="normalises over axis 0"):
        norm(torch.randn(4, 3))


def test_an_empty_batch_gives_empty_gradients():
    model = Model("broadcast")
    engine = PerExampleEngine(model, loss_reduction="sum")
    model(torch.randn(0, T, 3)).sum().backward()
    got = engine.per_example_grads()
    assert all(g.shape[0] == 0 for g in got.values())


def test_a_dropped_record_sends_the_call_to_the_replay():
    torch.manual_seed(2)
    model = Model("broadcast").double()
    x = torch.randn(4, T, 3, dtype=torch.float64)
    x[1, 0, 0] = float("nan")
    engine = PerExampleEngine(model, loss_reduction="sum")
    (model(x) ** 2).sum().backward()
    keep = torch.tensor([True, False, True, True])
    (unit,) = [u for u in engine.units if isinstance(u, FallbackUnit)]
    unit.calls[0].keep_rows(keep)
    assert unit.calls[0].taps.grads(torch.float64) is None


class Rotary(nn.Module):
    """Operations common in attention blocks that keep each example in its row: rotary
    embeddings from a cached table (a plain tensor attribute) through complex views, a
    causal mask by tril, binary max, take_along_dim, and axis= keywords; then a tapped
    gain."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.randn(4))
        angles = torch.arange(3)[:, None] * torch.arange(1, 3)[None, :] * 0.3
        self.cache = torch.polar(torch.ones(3, 2), angles)  # not a buffer

    def forward(self, x):  # x (B, 3, 4)
        pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], 2, 2))
        h = torch.view_as_real(pairs * self.cache).flatten(-2)
        scores = torch.tril(h @ h.transpose(1, 2))
        h = torch.max(h, scores.sum(axis=-1, keepdim=True))
        order = h.argsort(dim=-1)
        return torch.take_along_dim(h, order, -1) * self.gain


def test_common_attention_operations_keep_the_taps_and_match_the_oracle():
    torch.manual_seed(7)
    model = Rotary().double()
    model.cache = model.cache.to(torch.complex128)
    x = torch.randn(5, 3, 4, dtype=torch.float64)
    expected = oracle(copy.deepcopy(model), x)
    engine = PerExampleEngine(model, loss_reduction="sum")
    (model(x) ** 2).sum().backward()
    (unit,) = [u for u in engine.units if isinstance(u, FallbackUnit)]
    assert unit.calls[0].lost is None
    assert unit.calls[0].taps.grads(torch.float64) is not None
    got = engine.per_example_grads()
    assert torch.allclose(got["gain"], expected["gain"], rtol=1e-10)
