"""The independence check (dpcore_torch.independence): a model whose backward pass mixes the
examples of a batch is refused on its first training forward pass; per-example models pass,
and the check changes nothing the engine forms or the user's random streams."""

import copy
import dataclasses
import math
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from dpcore_torch import NotPerExampleError, PerExampleEngine, make_private  # noqa: E402
from test_torch_per_example import assert_matches_oracle  # noqa: E402


class RollRows(torch.autograd.Function):
    """The identity, whose backward moves each gradient row to the next example."""

    @staticmethod
    def forward(ctx, h):
        return h.clone()

    @staticmethod
    def backward(ctx, g):
        return g.roll(1, 0)


class Own(nn.Module):
    """A module with a parameter of its own (the engine's fallback), reversing the gradient
    rows of its input if ``hook``."""

    def __init__(self, hook=True):
        super().__init__()
        self.gain, self.hook = nn.Parameter(torch.ones(8)), hook

    def forward(self, h):
        if self.hook and h.requires_grad:
            h.register_hook(lambda g: g.flip(0))
        return h * self.gain


class Model(nn.Module):
    """Two Linear layers; ``form`` puts something between them (or after the second)."""

    def __init__(self, form="none"):
        super().__init__()
        self.form = form
        self.first, self.second, self.extra = nn.Linear(5, 8), nn.Linear(8, 3), nn.Linear(8, 8)
        self.own = Own() if form == "hook in a fallback module" else nn.Identity()
        self.table = nn.Linear(5, 8) if form == "layer on shared rows" else None
        if form == "batch mean into a zeroed layer":  # a zero-initialised head (LoRA's B)
            nn.init.zeros_(self.second.weight)

    def forward(self, x):
        if self.form == "inputs normalised by the batch":
            x = (x - x.mean(0)) / (x.var(0, correction=0) + 1)
        h = self.first(x)
        if self.form == "detached batch mean":
            h = h - h.mean(0).detach()
        elif self.form == "gradient scaled by a batch statistic" and h.requires_grad:
            scale = h.detach().var(0, correction=0) + 1
            h.register_hook(lambda g: g / scale)
        elif self.form == "a course set by the batch":
            if torch.unique(x, dim=0).shape[0] == x.shape[0]:
                h = self.extra(h)
        elif self.form == "halves paired":  # example i with i + B/2
            h = h + h.roll(h.shape[0] // 2, 0)
        elif self.form == "detached halves averaged":
            a, c = h.detach().chunk(2)
            h = h + torch.cat([(a + c) / 2] * 2)
        elif self.form == "odd rows read the even":
            context = torch.zeros_like(h)
            context[1::2] = h[0::2]
            h = h + context
        elif self.form == "reference row":
            h = h - h[:1]
        elif self.form == "detached reference row":
            h = h - h[:1].detach()
        elif self.form in ("batch mean", "batch mean into a zeroed layer"):
            h = h - h.mean(0)
        elif self.form == "straight-through batch mean":  # the values unchanged
            m = h.mean(0, keepdim=True)
            h = h + (m - m.detach())
        elif self.form == "hook moving gradient rows" and h.requires_grad:
            h.register_hook(lambda g: g.roll(1, 0))
        elif self.form == "autograd function":
            h = RollRows.apply(h)
        elif self.form == "reordered batch":
            h = h[h[:, 0].argsort()]
        elif self.form == "layer on shared rows":  # B rows that are not the examples
            h = h + self.table(torch.linspace(0, 1, 5 * x.shape[0]).reshape(-1, 5)).mean(0)
        h = self.own(torch.tanh(h))
        out = self.second(h)
        return out - out.mean(0) if self.form == "batch mean of the output" else out


#: each form, and the layer closest to the output whose output's gradient it mixes
MIXING = {"batch mean": "first", "straight-through batch mean": "first",
          "hook moving gradient rows": "first", "autograd function": "first",
          "reordered batch": "first", "layer on shared rows": "table",
          "hook in a fallback module": "first", "batch mean of the output": "second"}
#: found by running the pass again, with the other examples replaced, at the step
RERUN = {"detached batch mean": "second", "inputs normalised by the batch": "first",
         "gradient scaled by a batch statistic": "first", "a course set by the batch": None,
         # the zero weight hides it from the outputs and gradients: the layer's input shows it
         "batch mean into a zeroed layer": "second"}


def first_step(model, engine, *inputs):
    """Forward, backward, the norms and the engine's clear (where the rerun is made)."""
    model(*inputs).square().sum().backward()
    engine.sq_norms(list(engine.params))
    engine.clear()


@pytest.mark.parametrize("form", sorted(MIXING | RERUN))
def test_a_model_that_mixes_the_examples_is_refused_before_its_first_step(form):
    """A mixing the gradient shows is refused at the forward pass (nothing back-propagated),
    any other by the rerun, once the step's sums are formed (before they are released)."""
    torch.manual_seed(0)
    model = Model(form)
    engine = PerExampleEngine(model)
    name = (MIXING | RERUN)[form]
    where = "another course" if name is None else f"Linear '{name}'"
    with pytest.raises(NotPerExampleError,
                       match=rf"mixes the examples(?=.*{where})(?=.* of 6)"):
        if form in MIXING:
            model(torch.randn(6, 5))
        else:
            first_step(model, engine, torch.randn(6, 5))
    if form in MIXING:
        assert all(not call.reached for unit in engine.units for call in unit.calls)


#: mixings between rows in fixed positions, refused at every batch size (an audit's)
PAIRINGS = ["halves paired", "detached halves averaged", "odd rows read the even",
            "reference row", "detached reference row"]


@pytest.mark.parametrize("b", [6, 8, 16, 32])
@pytest.mark.parametrize("form", PAIRINGS)
def test_mixing_between_rows_in_fixed_positions_is_refused_at_every_batch_size(form, b):
    for seed in range(3):
        torch.manual_seed(seed)
        model = Model(form)
        engine = PerExampleEngine(model)
        with pytest.raises(NotPerExampleError, match="mixes the examples"):
            first_step(model, engine, torch.randn(b, 5))


@pytest.mark.parametrize("form", sorted(set(MIXING | RERUN) - {"reordered batch"}))
def test_a_batch_of_one_example_is_not_checked_and_the_next_batch_is(form):
    """One example cannot be mixed with others; the check waits for a batch of two. (How a
    batch is reordered depends on its data.)"""
    torch.manual_seed(0)
    model = Model(form)
    engine = PerExampleEngine(model)
    first_step(model, engine, torch.randn(1, 5))
    with pytest.raises(NotPerExampleError, match=r" of 2"):
        first_step(model, engine, torch.randn(2, 5))


@pytest.mark.parametrize("form", ["batch mean", "detached batch mean"])
def test_make_private_checks_before_recording_and_can_be_told_not_to(form):
    data = TensorDataset(torch.randn(64, 5), torch.randint(0, 3, (64,)))
    for check in (True, False):
        torch.manual_seed(0)
        model = Model(form)
        weights = [p.detach().clone() for p in model.parameters()]
        model, optimizer, loader = make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=16),
            noise_multiplier=1.0, max_grad_norm=1.0, seed=0, check_independence=check)
        x, y = next(iter(loader))
        if check:
            with pytest.raises(NotPerExampleError):
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
            assert all(math.isinf(step.noise_multiplier)  # nothing released (a sampling
                       for step in optimizer.ledger.steps())  # at most, which costs nothing)
            assert all(map(torch.equal, weights, model.parameters()))
        else:
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            assert len(optimizer.ledger.steps()) == 1


@pytest.mark.parametrize("form", ["parametrization", "hook"])
def test_spectral_normalisation_trains_with_the_check(form):
    """spectral_norm's power iteration updates buffers from the weights alone: the check on
    two steps passes (the step's replay does not update them a second time, which made the
    buffers a rerun leaves differ from the pass's), and training is the same without it."""
    data = TensorDataset(torch.randn(64, 5), torch.randint(0, 3, (64,)))
    spectral = (nn.utils.parametrizations.spectral_norm if form == "parametrization"
                else nn.utils.spectral_norm)
    weights = []
    for check in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(spectral(nn.Linear(5, 8)), nn.Tanh(), nn.Linear(8, 3))
        model, optimizer, loader = make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=16),
            noise_multiplier=1.0, max_grad_norm=1.0, seed=0, check_independence=check)
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        weights.append([t.clone() for t in model.state_dict().values()])
    assert all(map(torch.equal, *weights))


class TimeMajor(nn.Module):
    """Per example, but returns (T, B, C): the check takes axis 0 for the examples."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(5, 3)

    def forward(self, x):  # x (B, T, 5)
        return self.layer(x).transpose(0, 1)


def test_outputs_without_the_examples_on_axis_0_need_the_check_turned_off():
    torch.manual_seed(1)
    x = torch.randn(4, 4, 5, dtype=torch.float64)
    model = TimeMajor().double()
    checked = copy.deepcopy(model)
    PerExampleEngine(checked)
    with pytest.raises(NotPerExampleError, match="check_independence=False"):
        checked(x)  # the cotangent of row 0 of axis 0 reaches every example
    engine = PerExampleEngine(model, loss_reduction="sum", check_independence=False)
    (model(x) ** 2).sum().backward()
    out = F.linear(x, model.layer.weight, model.layer.bias)
    expected = torch.einsum("bto,bti->boi", 2 * out, x)
    assert torch.allclose(engine.per_example_grads()["layer.weight"], expected)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 16)
        self.encoder = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.2, batch_first=True)
        self.lstm = nn.LSTM(16, 8, batch_first=True)
        self.token = nn.Parameter(torch.randn(1, 1, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, k):
        h = self.lstm(self.encoder(self.embed(k)))[0]
        h = torch.cat([self.token.expand(h.shape[0], -1, -1), h], 1)
        return self.head(F.dropout(h, 0.1, self.training)).mean(1)


class Convolutional(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.norm = nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4)
        self.head = nn.Linear(4 * 7 * 7, 3)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.conv(x))).flatten(1))


class Stateful(nn.Module):
    """Per example, with buffers its forward pass updates (spectral normalisation's power
    iteration, a count of calls it uses, a statistic of the inputs it does not use) and an
    input it changes in place."""

    def __init__(self):
        super().__init__()
        self.first = nn.utils.parametrizations.spectral_norm(nn.Linear(5, 8))
        self.second = nn.Linear(8, 3)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("seen", torch.zeros(5))

    def forward(self, x):
        x.mul_(2)
        with torch.no_grad():
            self.calls += 1
            self.seen += x.abs().sum(0)
        return self.second(torch.tanh(self.first(x))) / self.calls


@pytest.mark.parametrize("name", ["attention", "convolutional", "checkpointed", "stateful"])
def test_per_example_models_pass_and_the_check_changes_nothing(name):
    """Same seed with and without the check: the same outputs, per-example gradients, norms
    and buffers, and the same state of the global generator afterwards. (A statistic of the
    inputs kept in a buffer that no pass reads passes.)"""
    results = []
    for check in (True, False):
        torch.manual_seed(3)
        if name == "attention":
            model, x = Attention(), torch.randint(0, 11, (5, 6))
        elif name == "convolutional":
            model, x = Convolutional(), torch.randn(5, 1, 9, 9)
        elif name == "checkpointed":
            layers = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
            model = nn.Sequential(layers[0], nn.Tanh(), layers[2])
            model.forward = lambda x: checkpoint(layers, x, use_reentrant=True)
            x = torch.randn(5, 5, requires_grad=True)
        else:
            model, x = Stateful(), torch.randn(5, 5)
        engine = PerExampleEngine(model, check_independence=check)
        out = model(x)
        out.square().mean().backward()
        grads = engine.per_example_grads()
        norms = engine.sq_norms(list(engine.params))
        engine.clear()  # the reruns
        buffers = [t.clone() for t in model.buffers()]
        results.append((out.detach(), grads, norms, torch.get_rng_state(), buffers))
    (out, grads, norms, state, buffers), (out0, grads0, norms0, state0, buffers0) = results
    assert torch.equal(out, out0) and torch.equal(norms, norms0) and torch.equal(state, state0)
    assert all(torch.equal(grads[k], grads0[k]) for k in grads0)
    assert len(buffers) == len(buffers0) and all(map(torch.equal, buffers, buffers0))


def test_a_mixing_model_behind_reentrant_checkpointing_is_not_checked():
    """torch.autograd.grad cannot pass a reentrant checkpoint: the check is skipped."""
    torch.manual_seed(0)
    inner = Model("batch mean")
    model = nn.Sequential(inner)
    model.forward = lambda x: checkpoint(inner, x, use_reentrant=True)
    PerExampleEngine(model)
    model(torch.randn(6, 5, requires_grad=True)).sum().backward()


class LossOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(5, 1)

    def forward(self, x):
        return self.layer(x).square().mean()


def test_a_model_returning_only_its_loss_warns_once_that_it_cannot_be_checked():
    model = LossOnly()
    PerExampleEngine(model)
    with pytest.warns(UserWarning, match="could not check that LossOnly"):
        model(torch.randn(4, 5)).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(4, 5))


def test_a_per_example_model_with_its_own_parameters_matches_the_oracle_after_the_check():
    torch.manual_seed(4)
    model = Model("none").double()
    model.own = Own(hook=False).double()
    x = torch.randn(5, 5, dtype=torch.float64)
    assert_matches_oracle(model, x, torch.randint(0, 3, (5,)), "mean")


@pytest.mark.parametrize("form", ["none", "detached batch mean"])
def test_a_compiled_model_is_checked_outside_its_compiled_call(form):
    torch.manual_seed(0)
    model = Model(form)
    model.compile(backend="eager")
    engine = PerExampleEngine(model)
    x = torch.randn(6, 5)
    if form == "none":
        model(x).sum().backward()
        assert engine.sq_norms(list(engine.params)).shape == (6, len(engine.params))
    else:
        with pytest.raises(NotPerExampleError, match="Linear 'second'"):
            first_step(model, engine, x)


class Small(nn.Module):
    """A small batch-level shift ``eps * h.mean(0)``, detached."""

    def __init__(self, eps):
        super().__init__()
        self.eps, self.first, self.second = eps, nn.Linear(5, 16), nn.Linear(16, 3)

    def forward(self, x):
        h = torch.tanh(self.first(x))
        return self.second(h + self.eps * h.mean(0).detach())


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("eps", [0.05, 0.02])
def test_a_small_detached_shift_is_refused_also_under_bfloat16_autocast(eps, bf16):
    torch.manual_seed(0)
    model = Small(eps)
    engine = PerExampleEngine(model)
    with pytest.raises(NotPerExampleError, match="Linear 'second'"):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(torch.randn(64, 5))
        out.float().square().sum().backward()
        engine.clear()


class Inputs(nn.Module):
    """With a detached batch mean; its batch is a dataclass, a list of rows, a list of texts,
    or time-major (T, B, 5)."""

    def __init__(self, form):
        super().__init__()
        self.form = form
        self.first, self.second = nn.Linear(5, 8), nn.Linear(8, 3)

    def forward(self, batch):
        x = {"dataclass": lambda: batch.x, "list": lambda: torch.stack(batch),
             "texts": lambda: torch.tensor([[len(t), t.count("a"), t.count("e"), t.count(" "),
                                             1.0] for t in batch]),
             "time-major": lambda: batch.mean(0)}[self.form]()
        h = torch.tanh(self.first(x))
        return self.second(h - h.mean(0).detach())


@dataclasses.dataclass
class Batch:
    x: torch.Tensor


TEXTS = ["the cat", "a dog barked", "hello", "privacy matters", "x", "dpcore"]


@pytest.mark.parametrize("form", ["dataclass", "list", "texts", "time-major"])
def test_inputs_in_dataclasses_and_lists_are_replaced_others_named_in_a_warning(form):
    """The rerun replaces rows of tensors, lists of B rows (texts) and fields of dataclasses;
    with no such input (time-major) only the backward part can run, and a warning says so
    (the detached mean passes it)."""
    torch.manual_seed(0)
    x = torch.randn(6, 5)
    batch = {"dataclass": Batch(x), "list": list(x), "texts": TEXTS,
             "time-major": torch.randn(4, 6, 5)}[form]
    model = Inputs(form)
    engine = PerExampleEngine(model)
    if form == "time-major":
        with pytest.warns(UserWarning, match="could check only the gradients of Inputs"):
            first_step(model, engine, batch)
    else:
        with pytest.raises(NotPerExampleError, match="Linear 'second'"):
            first_step(model, engine, batch)


@dataclasses.dataclass
class Output:
    logits: torch.Tensor


class Returning(nn.Module):
    """Returns its logits in a dataclass (a model-output class)."""

    def __init__(self):
        super().__init__()
        self.inner = Model("batch mean")

    def forward(self, x):
        return Output(self.inner(x))


def test_outputs_in_a_dataclass_are_checked():
    torch.manual_seed(0)
    model = Returning()
    PerExampleEngine(model)
    with pytest.raises(NotPerExampleError, match="Linear 'inner.first'"):
        model(torch.randn(6, 5))


class OwnState(nn.Module):
    """Per example, with noise from a generator of its own, a buffer it reassigns and a
    cache it builds lazily (a rotary embedding's)."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(5, 8), nn.Linear(8, 3)
        self.generator = torch.Generator().manual_seed(1)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("table", None, persistent=False)

    def forward(self, x):
        self.calls = self.calls + 1
        if self.table is None:
            self.table = torch.cos(torch.arange(x.shape[1], dtype=x.dtype))
        h = torch.tanh(self.first(x * self.table))
        return self.second(h + 0.1 * torch.randn(h.shape, generator=self.generator))


def test_own_generators_and_reassigned_buffers_are_restored():
    """Accepted, and with the same outputs, per-example gradients, buffers and generator
    state as without the check."""
    results = []
    for check in (True, False):
        torch.manual_seed(0)
        model = OwnState()
        engine = PerExampleEngine(model, check_independence=check)
        out = model(torch.randn(6, 5))
        out.square().sum().backward()
        grads = engine.per_example_grads()
        engine.clear()
        results.append((out.detach(), grads, [t.clone() for t in model.buffers()],
                        model.generator.get_state()))
    (out, grads, buffers, state), (out0, grads0, buffers0, state0) = results
    assert torch.equal(out, out0) and torch.equal(state, state0)
    assert all(torch.equal(grads[k], grads0[k]) for k in grads0)
    assert len(buffers) == len(buffers0) and all(map(torch.equal, buffers, buffers0))


def test_nothing_of_the_batch_is_kept_when_the_check_cannot_run():
    model = LossOnly()
    engine = PerExampleEngine(model)
    with pytest.warns(UserWarning):
        model(torch.randn(4, 5)).backward()
    assert engine._probe._before is None  # the batch's inputs (records) are not held


def test_a_batch_whose_rows_are_all_alike_leaves_the_rerun_to_the_next_pass():
    """Replacing rows of a batch of equal rows changes nothing: the next pass is checked."""
    torch.manual_seed(0)
    model = Model("detached batch mean")
    engine = PerExampleEngine(model)
    first_step(model, engine, torch.ones(6, 5))
    with pytest.raises(NotPerExampleError, match="Linear 'second'"):
        first_step(model, engine, torch.randn(6, 5))


class Scaled(nn.Module):
    """Per example, called with two positional arguments."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(5, 3)

    def forward(self, x, scale):
        return self.layer(x) * scale[:, None]


def test_positional_arguments_as_many_as_the_examples_are_not_taken_for_rows():
    """With B = 2 and two arguments, the argument list is not a list of two examples."""
    torch.manual_seed(0)
    model = Scaled()
    engine = PerExampleEngine(model)
    first_step(model, engine, torch.randn(2, 5), torch.tensor([1.0, 2.0]))


class RunningCentre(nn.Module):
    """Centres with a running mean of earlier batches, read before it is updated: step t's
    gradients would carry batch t-1's records."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(5, 8), nn.Linear(8, 3)
        self.register_buffer("mean", torch.zeros(8))

    def forward(self, x):
        h = self.first(x)
        out = h - self.mean
        with torch.no_grad():
            self.mean.mul_(0.5).add_(0.5 * h.mean(0))
        return self.second(torch.tanh(out))


def test_a_batch_statistic_kept_for_later_steps_is_refused():
    torch.manual_seed(0)
    model = RunningCentre()
    engine = PerExampleEngine(model)
    with pytest.raises(NotPerExampleError, match=r"buffers \['\.mean'\].*later steps"):
        first_step(model, engine, torch.randn(6, 5))


class SharedMaximum(nn.Module):
    """Inputs divided by the batch's maximum."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(5, 3)

    def forward(self, x):
        return self.layer(x / x.max())


def test_a_batch_statistic_that_every_row_shares_is_refused():
    """On data where every record reaches the maximum, copies of a kept row change nothing;
    the doubled rows of the second split do."""
    torch.manual_seed(0)
    x = torch.rand(8, 5)
    x[:, 0] = 1.0
    model = SharedMaximum()
    with pytest.raises(NotPerExampleError, match="2.0 times"):
        first_step(model, PerExampleEngine(model), x)


def test_mixing_that_the_first_step_switches_on_is_refused_at_the_second():
    """Outputs centred over the batch behind a zero head: no effect on the first batch; the
    second pass is checked with the weights the first step moved."""
    torch.manual_seed(0)
    head = nn.Linear(8, 3)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    layers = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), head)
    model = nn.Sequential(layers, Lambda(lambda t: t - t.mean(0).detach()))
    engine = PerExampleEngine(model)
    first_step(model, engine, torch.randn(6, 5))
    assert engine._probe.checked == 1
    with torch.no_grad():
        head.weight.normal_()
    with pytest.raises(NotPerExampleError, match="mixes the examples"):
        first_step(model, engine, torch.randn(6, 5))


class Lambda(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, h):
        return self.fn(h)


def test_a_model_under_float16_autocast_passes():
    """float16's narrow range: gradients scaled by 2^-8 fall into its subnormals."""
    for seed in range(4):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))
        engine = PerExampleEngine(model)
        with torch.autocast("cpu", dtype=torch.float16):
            first_step(model, engine, torch.randn(32, 5))
        assert engine._probe.checked == 1


class FloatCategory(nn.Module):
    """Tabular rows whose first column is a category index kept as a float: the rerun's
    doubled or negated rows are not valid inputs, so those splits fall back to copies."""

    def __init__(self):
        super().__init__()
        self.table, self.layer = nn.Embedding(4, 3), nn.Linear(7, 3)

    def forward(self, x):
        return self.layer(torch.cat([self.table(x[:, 0].long()), x[:, 1:]], 1))


def test_inputs_that_cannot_be_scaled_are_replaced_by_copies():
    torch.manual_seed(0)
    x = torch.cat([torch.randint(0, 4, (8, 1)).float(), torch.randn(8, 4)], 1)
    model = FloatCategory()
    engine = PerExampleEngine(model)
    first_step(model, engine, x)
    assert engine._probe.checked == 1


class GradientScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, scale):
        ctx.save_for_backward(scale)
        return h.view_as(h)

    @staticmethod
    def backward(ctx, g):
        (scale,) = ctx.saved_tensors
        return g / scale, None


class ReadInBackward(nn.Module):
    """A statistic of earlier batches (with a count beside it) that only the backward pass
    reads: the next step's gradients would carry this batch's records."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(5, 8), nn.Linear(8, 3)
        self.register_buffer("state", torch.tensor([1e6] + [1.0] * 8))

    def forward(self, x):
        h = GradientScale.apply(torch.tanh(self.first(x)), self.state[1:].clone())
        with torch.no_grad():
            self.state[0] += 1
            self.state[1:].mul_(0.5).add_(0.5 * h.abs().mean(0))
        return self.second(h)


def test_a_statistic_kept_for_the_next_backward_pass_is_refused():
    torch.manual_seed(0)
    model = ReadInBackward()
    with pytest.raises(NotPerExampleError, match=r"gradient.*buffers \['\.state'\]"):
        first_step(model, PerExampleEngine(model), torch.randn(6, 5))


def test_the_second_check_waits_for_the_weights_to_move():
    """Micro-batches of one step share its weights: the second check is made on a pass after
    the step's update."""
    torch.manual_seed(0)
    model = Model()
    engine = PerExampleEngine(model)
    first_step(model, engine, torch.randn(6, 5))
    first_step(model, engine, torch.randn(6, 5))
    assert engine._probe.checked == 1
    with torch.no_grad():
        model.first.weight.add_(0.1)
    first_step(model, engine, torch.randn(6, 5))
    assert engine._probe.checked == 2


class Awkward(nn.Module):
    """Per example, but its pass cannot be run again: it raises on a batch whose first
    example is repeated (as the rerun's copies make it)."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(5, 3)

    def forward(self, x):
        if x.shape[0] > 1 and bool((x[1:] == x[:1]).all(1).any()):
            raise ValueError("duplicate example")
        return self.layer(x)


def test_a_pass_that_cannot_be_run_again_is_reported_unchecked():
    torch.manual_seed(0)
    model = Awkward()
    with pytest.warns(UserWarning, match="raised ValueError"):
        first_step(model, PerExampleEngine(model), torch.randn(6, 5))


class ChangesWeights(nn.Module):
    """Changes a Linear's parameters in place in its pass (outside the layer's call): clamps
    the weight, or initialises the bias from the batch on the first pass (ActNorm's
    data-dependent initialisation, with its flag in a buffer)."""

    def __init__(self, form):
        super().__init__()
        self.form, self.layer = form, nn.Linear(5, 3)
        self.register_buffer("initialised", torch.tensor(False))

    def forward(self, x):
        with torch.no_grad():
            if self.form == "clamp":
                self.layer.weight.clamp_(-0.3, 0.3)
            elif not self.initialised:
                self.layer.bias.sub_((x @ self.layer.weight.t()).mean(0))
                self.initialised.fill_(True)
        return self.layer(x)


@pytest.mark.parametrize("form", ["clamp", "initialisation from the batch"])
def test_a_pass_that_changes_parameters_runs_again_from_where_it_began(form):
    """The reruns start from the parameters as the pass began and leave them as it did: a
    clamp passes, unwarned and trained as without the check; an initialisation from the
    batch (its records kept in the weights without noise) is refused."""
    results = []
    for check in (True, False):
        torch.manual_seed(0)
        model = ChangesWeights(form)
        engine = PerExampleEngine(model, check_independence=check)
        if check and form != "clamp":
            with pytest.raises(NotPerExampleError, match="changed in the rows"):
                first_step(model, engine, torch.randn(6, 5))
            return
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            first_step(model, engine, torch.randn(6, 5))
        assert not check or engine._probe.checked == 1
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(map(torch.equal, *results))


class InitialisedThroughData(nn.Module):
    """ActNorm as glow implementations write it: the bias set from the batch through
    ``.data`` (no version counter moves) on the first call, a Python flag after."""

    def __init__(self):
        super().__init__()
        self.layer, self.done = nn.Linear(5, 3), False

    def forward(self, x):
        if not self.done:
            self.layer.bias.data.copy_(-(x @ self.layer.weight.t()).mean(0).detach())
            self.done = True
        return self.layer(x)


def test_an_initialisation_from_the_batch_through_data_is_refused():
    torch.manual_seed(0)
    model = InitialisedThroughData()
    with pytest.raises(NotPerExampleError, match="changed in the rows"):
        first_step(model, PerExampleEngine(model), torch.randn(6, 5))


class ClampsItsOwn(nn.Module):
    """A fallback module (a parameter of its own) that clamps it in its forward pass."""

    def __init__(self):
        super().__init__()
        self.gain, self.layer = nn.Parameter(torch.full((5,), 2.0)), nn.Linear(5, 3)

    def forward(self, x):
        with torch.no_grad():
            self.gain.clamp_(-0.5, 0.5)
        return self.layer(x * self.gain)


def test_the_replay_changes_no_parameter_and_a_step_before_clear_is_reported():
    """The fallback's replay clamps copies, not the model's parameters (so the check sees
    no parameter changed after the pass through make_private); an optimizer step before
    the engine's clear() is reported, not taken for mixing."""
    data = TensorDataset(torch.randn(64, 5), torch.randint(0, 3, (64,)))
    torch.manual_seed(0)
    model = ClampsItsOwn()
    model, optimizer, loader = make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=16),
        noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    assert optimizer.engine._probe.checked == 2
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    engine, sgd = PerExampleEngine(model), torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(6, 5)).square().sum().backward()
    grads = engine.per_example_grads()
    for name, p in model.named_parameters():
        p.grad = grads[name].sum(0)
    sgd.step()
    with pytest.warns(UserWarning, match="optimizer step before the engine's clear"):
        engine.clear()


class Packed(nn.Module):
    """An LSTM over sequences packed by length: the PackedSequence's sorting indices are a
    permutation of the batch, not rows of examples."""

    def __init__(self, form="none"):
        super().__init__()
        self.form = form
        self.table, self.head = nn.Embedding(20, 8), nn.Linear(8, 3)
        self.rnn = nn.LSTM(8, 8, batch_first=True)

    def forward(self, ids, lengths):
        h = self.table(ids)
        if self.form == "detached batch mean":
            h = h - h.mean(0).detach()
        packed = nn.utils.rnn.pack_padded_sequence(h, lengths, batch_first=True,
                                                   enforce_sorted=False)
        return self.head(self.rnn(packed)[1][0][-1])


@pytest.mark.parametrize("form", ["none", "detached batch mean"])
def test_packed_sequences_sorted_by_length_are_checked(form):
    torch.manual_seed(0)
    model = Packed(form)
    engine = PerExampleEngine(model)
    inputs = torch.randint(0, 20, (8, 6)), torch.randint(1, 7, (8,))
    if form == "none":
        first_step(model, engine, *inputs)
        assert engine._probe.checked == 1
    else:
        with pytest.raises(NotPerExampleError, match="mixes the examples"):
            first_step(model, engine, *inputs)


class SortedPacked(Packed):
    """Sequences sorted by length, packed with enforce_sorted=True: replaced rows take the
    nearest kept row before them, so the lengths stay sorted."""

    def forward(self, ids, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(self.table(ids), lengths, batch_first=True)
        return self.head(self.rnn(packed)[1][0][-1])


class SharedMask(nn.Module):
    """A (T, T) causal mask passed beside the batch: with B = T it is not a batch of rows."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

    def forward(self, x, mask):
        return self.layer(x, src_mask=mask).mean(1)


def test_sorted_packed_sequences_and_a_shared_square_mask_pass():
    torch.manual_seed(0)
    model = SortedPacked()
    engine = PerExampleEngine(model)
    first_step(model, engine, torch.randint(0, 20, (8, 6)),
               torch.arange(8, 0, -1).clamp(max=6))
    assert engine._probe.checked == 1
    model = SharedMask()
    engine = PerExampleEngine(model)
    mask = nn.Transformer.generate_square_subsequent_mask(6)
    first_step(model, engine, torch.randn(6, 6, 8), mask)
    assert engine._probe.checked == 1


class Augmented(nn.Module):
    """Each example is k augmentations of one image (k, 1, 6, 6), folded into the batch
    for the convolution and averaged in the loss (augmentation multiplicity)."""

    def __init__(self, k=3):
        super().__init__()
        self.k, self.conv, self.fc = k, nn.Conv2d(1, 4, 3), nn.Linear(64, 3)

    def forward(self, x):
        h = torch.tanh(self.conv(x.flatten(0, 1)))
        return self.fc(h.flatten(1)).view(len(x), self.k, 3)


def augmented_loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.repeat_interleave(out.shape[1]))


def augmented_training(mode, clip=1e-3):
    """One step of noise 0 on 10 examples of 3 augmentations: (model, optimizer, batch and
    the parameters before)."""
    torch.manual_seed(1)
    model = Augmented().double()
    gen = torch.Generator().manual_seed(2)
    ds = TensorDataset(torch.randn(40, 3, 1, 6, 6, generator=gen, dtype=torch.float64),
                       torch.randint(0, 3, (40,), generator=gen))
    before = [p.detach().clone() for p in model.parameters()]
    model, opt, loader = make_private(model, torch.optim.SGD(model.parameters(), lr=1.0),
                                      DataLoader(ds, batch_size=10), noise_multiplier=0.0,
                                      max_grad_norm=clip, seed=0, mode=mode)
    x, y = next(iter(loader))
    opt.zero_grad()
    augmented_loss(model(x), y).backward()
    return model, opt, (x, y), before


def test_a_model_folding_several_rows_per_example_into_the_batch_is_refused():
    """Its layers see 3 rows per example: clipped apart, an example would be bounded by 3
    clips. Refused at the step, before any sum is released."""
    model, opt, _, before = augmented_training("auto")
    with pytest.raises(NotPerExampleError, match=r"Augmented's input has \d+ examples on axis "
                       r"0, but its layer Conv2d saw \d+ rows: .*mode='vmap'"):
        opt.step()
    assert [type(e).__name__ for e in opt.ledger.events] == ["SamplingEvent"]
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_mode_vmap_clips_the_rows_of_an_example_as_one():
    """Against a float64 loop over the examples, each one's gradient clipped to 1e-3."""
    model, opt, (x, y), before = augmented_training("vmap")
    opt.step()
    twin = Augmented().double()
    with torch.no_grad():
        for p, b in zip(twin.parameters(), before):
            p.copy_(b)
    total = [torch.zeros_like(p) for p in twin.parameters()]
    for i in range(len(x)):
        grads = torch.autograd.grad(augmented_loss(twin(x[i:i + 1]), y[i:i + 1]),
                                    list(twin.parameters()))
        norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
        for t, g in zip(total, grads):
            t += g * min(1.0, 1e-3 / norm.item())
    expected = [b - t / opt.aggregator.expected_size for b, t in zip(before, total)]
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-9, atol=1e-12)


class ListInput(Augmented):
    """Augmented, called as model([x, y]) (a DataLoader's batch as it comes)."""

    def forward(self, batch):
        return super().forward(batch[0])


class TimeMajorTokens(nn.Module):
    """Token ids (T, B), time-major: transposed inside, so every layer sees the B examples."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(11, 4), nn.Linear(4, 3)

    def forward(self, tokens):
        return self.head(self.embed(tokens.t()).mean(1))


def test_folding_is_refused_whatever_the_inputs_and_calls_after_it():
    """The batch in a list, and eight more calls of the model after the step's (logging),
    do not hide the folded rows; a time-major input with 2 rows per 4 examples is not
    taken for folding."""
    torch.manual_seed(1)
    x, y = torch.randn(4, 3, 1, 6, 6), torch.randint(0, 3, (4,))
    for model, call in ((Augmented(), lambda m: m(x)), (ListInput(), lambda m: m([x, y]))):
        engine = PerExampleEngine(model)
        augmented_loss(call(model), y).backward()
        for _ in range(8):
            call(model)
        with pytest.raises(NotPerExampleError, match="input has 4 examples on axis 0, but its "
                                                     "layer Conv2d saw 12 rows"):
            engine.sq_norms(list(engine.params))
    model = TimeMajorTokens()
    engine = PerExampleEngine(model, loss_reduction="sum")
    model(torch.randint(0, 11, (2, 4))).sum().backward()
    assert engine.sq_norms(list(engine.params)).shape == (4, 3)
