"""Copies of an instrumented model (``copy.deepcopy``, ``pickle``, ``torch.save``) are the plain
model with the weights of the moment: an EMA copy or a checkpoint must not run, or record into,
the original."""

import copy
import io
import pickle
import threading

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dpcore_torch import PerExampleEngine  # noqa: E402

from test_torch_per_example import Gated  # noqa: E402  (a module without a layer rule)


def build():
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(6)
    norm.running_mean.uniform_(-1, 1)
    return nn.Sequential(nn.Linear(4, 6), Gated(6), norm.eval(), nn.Linear(6, 3))


def through_deepcopy(model):
    return copy.deepcopy(model)


def through_pickle(model):
    return pickle.loads(pickle.dumps(model))


def through_torch_save(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def forward_and_grads(model, x, y):
    model.zero_grad()
    out = model(x)
    F.cross_entropy(out, y).backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["auto", "vmap"])
@pytest.mark.parametrize("how", [through_deepcopy, through_pickle, through_torch_save])
def test_a_copy_of_an_instrumented_model_is_the_plain_model(how, mode):
    model = build()
    engine = PerExampleEngine(model, mode=mode)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 4, generator=gen), torch.randint(0, 3, (5,), generator=gen)
    twin = how(model)
    with torch.no_grad():  # the copy's weights are its own
        for p in twin.parameters():
            p.mul_(1.5)
    plain = build()
    plain.load_state_dict(twin.state_dict())
    out, grads = forward_and_grads(twin, x, y)
    plain_out, plain_grads = forward_and_grads(plain, x, y)
    assert torch.equal(out, plain_out)
    assert grads.keys() == plain_grads.keys()
    for n in grads:  # every parameter, the fallback's too, gets its ordinary gradient
        assert torch.equal(grads[n], plain_grads[n]), n
    assert all(not unit.calls for unit in engine.units)  # nothing recorded in the original
    twin.train()  # a plain copy may use its BatchNorm's batch statistics
    twin(x)
    twin.eval()
    twin_engine = PerExampleEngine(twin, mode=mode)  # and can be made private on its own
    twin_engine.detach()
    # the original is still instrumented: its per-example gradients add up to its gradient
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    per_example = engine.per_example_grads()
    model_grads = forward_and_grads(copy.deepcopy(model), x, y)[1]
    for n, g in per_example.items():
        torch.testing.assert_close(g.sum(0) / len(x), model_grads[n], rtol=1e-5, atol=1e-6)


def test_a_detached_model_copies_as_before():
    model = build()
    PerExampleEngine(model).detach()
    for sub in model.modules():
        assert "__getstate__" not in sub.__dict__
    twin = copy.deepcopy(model)
    assert torch.equal(twin[0].weight, model[0].weight)


class Locked(nn.Module):
    """A model whose class defines the pickle protocol (drops a lock, makes a new one)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.lock = threading.Lock()

    def forward(self, x):
        return self.fc(x)

    def __getstate__(self):
        state = dict(super().__getstate__())
        state.pop("lock")
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self.lock = threading.Lock()


@pytest.mark.parametrize("how", [through_deepcopy, through_pickle, through_torch_save])
def test_a_class_with_its_own_getstate_is_copied_through_it(how):
    model = Locked()
    PerExampleEngine(model)
    twin = how(model)
    assert isinstance(twin.lock, type(threading.Lock())) and twin.lock is not model.lock
    assert "forward" not in twin.fc.__dict__
    assert torch.equal(twin.fc.weight, model.fc.weight)


class Recurrent(nn.Module):
    """An LSTM (whose class drops its weak references from the state) and a fallback module
    compiled with ``module.compile()`` (whose compiled call nn.Module drops)."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 6, batch_first=True)
        self.gated = Gated(6)
        self.gated.compile(backend="eager")
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.gated(self.lstm(x)[0][:, -1]))


@pytest.mark.parametrize("how", [through_deepcopy, through_pickle, through_torch_save])
def test_a_recurrent_and_a_compiled_module_copy_as_plain_modules(how):
    torch.manual_seed(0)
    model = Recurrent()
    engine = PerExampleEngine(model)
    x = torch.randn(5, 7, 4, generator=torch.Generator().manual_seed(2))
    model(x)
    twin = how(model)
    assert "_compiled_call_impl" not in twin.gated.__dict__
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    assert torch.equal(twin(x), torch.zeros(5, 3))  # the copy's weights, not the original's
    assert len(engine.units[1].calls) == 1  # the copy recorded nothing in the original


def test_a_parametrized_layer_copies_as_a_plain_layer():
    """A parametrized layer's class copies its __dict__ itself (its own __deepcopy__)."""
    from torch.nn.utils.parametrizations import weight_norm

    torch.manual_seed(0)
    model = nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.Linear(4, 2))
    PerExampleEngine(model)
    twin = copy.deepcopy(model)
    assert not any(k in twin[0].__dict__ for k in ("_call_impl", "__getstate__", "__deepcopy__"))
    twin(torch.randn(3, 4)).sum().backward()
    assert all(p.grad is not None for p in twin.parameters())


@pytest.mark.parametrize("how", [copy.deepcopy, copy.copy, pickle.dumps])
def test_an_engine_or_a_private_optimizer_refuses_to_be_copied(how):
    """A copy of the engine would hold a copy of the model that records nothing: its sums
    would be zero and its steps pure noise."""
    from dpcore_torch import make_private

    model = build()
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 3, (8,))),
        batch_size=4)
    model, optimizer, _ = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                       loader, noise_multiplier=1.0, max_grad_norm=1.0)
    for thing in (optimizer.engine, optimizer):
        with pytest.raises(TypeError, match="cannot be copied or pickled"):
            how(thing)
    how(model)  # the model itself copies as the plain model
