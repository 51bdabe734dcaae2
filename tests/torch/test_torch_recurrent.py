"""nn.RNN, nn.GRU, nn.LSTM and their cells: the recurrent rule's outputs, per-example gradients, norms and
clipped sums against the unmodified layer (PyTorch's fused kernels) run one example at a time
in float64."""

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from dpcore_torch import PerExampleEngine, make_private  # noqa: E402

from test_torch_per_example import close, oracle  # noqa: E402

D_IN, STEPS, CLASSES = 3, 5, 3

LAYERS = {
    "rnn-tanh": lambda: nn.RNN(D_IN, 4, batch_first=True),
    "rnn-relu-2-bidirectional-no-bias": lambda: nn.RNN(
        D_IN, 4, num_layers=2, nonlinearity="relu", bidirectional=True, bias=False,
        batch_first=True),
    "gru-2-bidirectional": lambda: nn.GRU(D_IN, 4, num_layers=2, bidirectional=True,
                                          batch_first=True),
    "lstm": lambda: nn.LSTM(D_IN, 4, batch_first=True),
    "lstm-proj-2-bidirectional": lambda: nn.LSTM(D_IN, 5, num_layers=2, proj_size=2,
                                                 bidirectional=True, batch_first=True),
}


class Classifier(nn.Module):
    """A recurrent layer whose initial state comes from the data through a Linear (so the
    state's gradient flows on), read through its outputs and its final state."""

    def __init__(self, layer):
        super().__init__()
        self.rnn = layer
        dirs = 2 if layer.bidirectional else 1
        out = (layer.proj_size or layer.hidden_size) if isinstance(layer, nn.LSTM) \
            else layer.hidden_size
        self.init = nn.Linear(D_IN, layer.num_layers * dirs * out)
        self.head = nn.Linear(dirs * out + out, CLASSES)

    def forward(self, x):
        rnn = self.rnn
        layers = rnn.num_layers * (2 if rnn.bidirectional else 1)
        h0 = torch.tanh(self.init(x[:, 0])).reshape(x.shape[0], layers, self.init.out_features // layers)
        h0 = h0.transpose(0, 1)
        h0 = h0.contiguous()
        if isinstance(rnn, nn.LSTM):
            h0 = h0, torch.zeros(layers, x.shape[0], rnn.hidden_size, dtype=x.dtype)
        out, state = rnn(x, h0)
        h_n = state[0] if isinstance(state, tuple) else state
        return self.head(torch.cat([out.mean(1), h_n[-1]], 1))


class FirstOutput(nn.Module):
    """Reads only the first output of a one-way GRU."""

    def __init__(self):
        super().__init__()
        self.rnn, self.head = nn.GRU(D_IN, 4, batch_first=True), nn.Linear(4, CLASSES)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, 0])


class CellLoop(nn.Module):
    """A cell unrolled by hand over the sequence (one call per step), from a given state."""

    def __init__(self, cell):
        super().__init__()
        self.cell, self.head = cell, nn.Linear(cell.hidden_size, CLASSES)
        self.init = nn.Linear(D_IN, cell.hidden_size)

    def forward(self, x):
        h = torch.tanh(self.init(x[:, 0]))
        state = (h, torch.zeros_like(h)) if isinstance(self.cell, nn.LSTMCell) else h
        for t in range(x.shape[1]):
            state = self.cell(x[:, t], state)
        return self.head(state[0] if isinstance(state, tuple) else state)


CELLS = {
    "rnn-cell-relu": lambda: nn.RNNCell(D_IN, 4, nonlinearity="relu"),
    "gru-cell": lambda: nn.GRUCell(D_IN, 4),
    "lstm-cell-no-bias": lambda: nn.LSTMCell(D_IN, 4, bias=False),
}


def batch(size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(size, STEPS, D_IN, generator=gen, dtype=torch.float64),
            torch.randint(0, CLASSES, (size,), generator=gen))


def assert_matches(engine, expected, groups=2):
    """Norms, per-example gradients and clipped sums of ``engine`` (after its backward pass)
    against the oracle's per-example gradients ``expected`` (tensors or lists of rows)."""
    names = list(engine.params)
    want = {n: expected[n] if isinstance(expected[n], torch.Tensor) else torch.stack(expected[n])
            for n in names}
    assert close(engine.sq_norms(names),
                 torch.stack([want[n].flatten(1).pow(2).sum(1) for n in names], 1))
    got = engine.per_example_grads()
    for n in names:
        assert close(got[n], want[n]), n
    factors = torch.rand(len(want[names[0]]), groups, dtype=torch.float64)
    assignment = {n: i % groups for i, n in enumerate(names)}
    sums = engine.clipped_sums(factors, assignment)
    for n in names:
        assert close(sums[n], torch.einsum("b,b...->...", factors[:, assignment[n]], want[n])), n


def engine_after_backward(model, x, y, reduction, prefer="memory"):
    engine = PerExampleEngine(model, loss_reduction=reduction, prefer=prefer)
    model.zero_grad()
    F.cross_entropy(model(x), y, reduction=reduction).backward()
    return engine


@pytest.mark.parametrize("layer", sorted(LAYERS))
@pytest.mark.parametrize("size", [0, 1, 6])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_per_example_grads_norms_and_sums_match_the_fused_layer(layer, size, reduction):
    torch.manual_seed(1)
    model = Classifier(LAYERS[layer]()).double()
    x, y = batch(size, seed=size)
    plain = copy.deepcopy(model)
    engine = engine_after_backward(model, x, y, reduction)
    names = list(engine.params)
    assert any(".weight_hh_l0" in n for n in names)
    if not size:
        assert engine.sq_norms(names).shape == (0, len(names))
        assert all(g.shape == (0, *engine.params[n].shape)
                   for n, g in engine.per_example_grads().items())
        return
    assert_matches(engine, oracle(plain, x, y))


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_outputs_and_final_states_equal_the_fused_layer(layer):
    torch.manual_seed(2)
    rnn = LAYERS[layer]().double()
    plain = copy.deepcopy(rnn)
    engine = PerExampleEngine(rnn)
    x, _ = batch(4)
    got, want = rnn(x), plain(x)
    flat = lambda out: [out[0], *(out[1] if isinstance(out[1], tuple) else (out[1],))]  # noqa
    for a, b in zip(flat(got), flat(want)):
        assert a.shape == b.shape and close(a, b)
    engine.detach()


@pytest.mark.parametrize("bidirectional", [False, True])
def test_dropout_between_and_after_layers_draws_pytorchs_masks(bidirectional):
    """The output has the fused layer's layout ((T, B, d) in memory), so dropout between the
    layers and after the layer draws, under one seed, the masks of PyTorch's own run."""
    torch.manual_seed(3)
    rnn = nn.LSTM(D_IN, 4, num_layers=2, dropout=0.4, batch_first=True,
                  bidirectional=bidirectional).double()
    plain = copy.deepcopy(rnn)
    x, _ = batch(6)
    PerExampleEngine(rnn)
    outputs = []
    for model in (rnn, plain):
        torch.manual_seed(4)
        outputs.append(F.dropout(model(x)[0], 0.5))
    assert outputs[0].stride() == outputs[1].stride()
    # the same masks; the values to rounding (the rule's matrix products may round otherwise
    # than the fused kernel: on some CPUs, by an ulp)
    assert torch.equal(outputs[0] == 0, outputs[1] == 0)
    assert torch.allclose(*outputs, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("prefer", ["memory", "time"])
def test_steps_the_loss_never_reaches_contribute_zero(prefer):
    """Only the first output of a one-way GRU is used: the later steps' recurrent maps get no
    backprop at all (ghost norm or materialised gradient alike)."""
    torch.manual_seed(3)
    model = FirstOutput().double()
    x, y = batch(5)
    expected = oracle(copy.deepcopy(model), x, y)
    engine = engine_after_backward(model, x, y, "sum", prefer)
    assert_matches(engine, expected)


@pytest.mark.parametrize("cell", sorted(CELLS))
@pytest.mark.parametrize("size", [0, 1, 6])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cells_called_at_every_step_match_the_fused_cell(cell, size, reduction):
    """A cell called T times is a layer used T times: its per-example gradient is summed over
    the calls once, and no call keeps a per-example gradient of its own."""
    torch.manual_seed(5)
    model = CellLoop(CELLS[cell]()).double()
    x, y = batch(size, seed=size + 1)
    plain = copy.deepcopy(model)
    engine = engine_after_backward(model, x, y, reduction)
    norms = engine.sq_norms(list(engine.params))
    cell_unit = next(u for u in engine.units if u.module is model.cell)
    assert len(cell_unit.calls) == STEPS
    assert not any(part.cache for call in cell_unit.calls for part in call.maps.values())
    if not size:
        assert norms.shape == (0, len(engine.params))
        return
    assert_matches(engine, oracle(plain, x, y), groups=1)


class Packed(nn.Module):
    """Sequences of different lengths, packed (not sorted by length), read through the padded
    outputs' mean over each sequence's own steps and the final state."""

    def __init__(self, layer):
        super().__init__()
        self.rnn = layer
        width = layer.hidden_size * (2 if layer.bidirectional else 1)
        self.head = nn.Linear(width + layer.hidden_size, CLASSES)

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True,
                                                   enforce_sorted=False)
        out, state = self.rnn(packed)
        assert isinstance(out, nn.utils.rnn.PackedSequence)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
        h_n = state[0] if isinstance(state, tuple) else state
        mean = out.sum(1) / lengths[:, None].to(out.dtype)
        return self.head(torch.cat([mean, h_n[-1]], 1))


@pytest.mark.parametrize("layer", ["gru-2-bidirectional", "lstm", "rnn-tanh"])
def test_packed_sequences_match_the_fused_layer_one_sequence_at_a_time(layer):
    torch.manual_seed(6)
    model = Packed(LAYERS[layer]()).double()
    x, y = batch(5, seed=7)
    lengths = torch.tensor([3, 5, 1, 4, 5])
    plain = copy.deepcopy(model)
    want_out = plain.rnn(nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True,
                                                           enforce_sorted=False))
    expected = {n: [] for n, _ in plain.named_parameters()}
    for i in range(5):
        plain.zero_grad()
        F.cross_entropy(plain(x[i:i + 1, :lengths[i]], lengths[i:i + 1]), y[i:i + 1],
                        reduction="sum").backward()
        for n, p in plain.named_parameters():
            expected[n].append(p.grad.clone())
    engine = PerExampleEngine(model, loss_reduction="sum")
    got_out = model.rnn(nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True,
                                                          enforce_sorted=False))
    assert close(got_out[0].data, want_out[0].data)
    assert torch.equal(got_out[0].batch_sizes, want_out[0].batch_sizes)
    assert torch.equal(got_out[0].unsorted_indices, want_out[0].unsorted_indices)
    for a, b in zip(*(o[1] if isinstance(o[1], tuple) else (o[1],) for o in (got_out, want_out))):
        assert close(a, b)
    engine.clear()
    model.zero_grad()
    F.cross_entropy(model(x, lengths), y, reduction="sum").backward()
    assert_matches(engine, expected)


def test_unbatched_inputs_are_refused_with_a_fix():
    rnn = nn.LSTM(D_IN, 4, batch_first=True)
    engine = PerExampleEngine(rnn)
    with pytest.raises(ValueError, match=r"\(3, 3\).*batch_first=True"):
        rnn(torch.randn(3, D_IN))
    engine.detach()
    cell = nn.GRUCell(D_IN, 4)
    engine = PerExampleEngine(cell)
    with pytest.raises(ValueError, match=r"\(3,\).*\(batch, feature\)"):
        cell(torch.randn(D_IN))
    engine.detach()


def test_zero_noise_and_a_large_clip_give_the_non_private_lstm_step():
    torch.manual_seed(4)
    model = Classifier(nn.LSTM(D_IN, 6, num_layers=2, batch_first=True))
    twin = copy.deepcopy(model)
    x, y = batch(8, seed=9)
    x = x.float()
    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, twin))
    loader = DataLoader(TensorDataset(x, y), batch_size=8)  # q = 1
    model, opt, _ = make_private(model, opt, loader, noise_multiplier=0.0, max_grad_norm=1e6,
                                 seed=0)
    for _ in range(3):
        for m, o in ((model, opt), (twin, twin_opt)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
    for p, t in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, t, rtol=1e-5, atol=1e-6)


def test_whole_model_vmap_of_a_fused_lstm_points_to_mode_auto():
    model = FirstOutput().double()
    model.rnn = nn.LSTM(D_IN, 4, batch_first=True).double()
    engine = PerExampleEngine(model, mode="vmap")
    x, y = batch(3)
    F.cross_entropy(model(x), y, reduction="sum").backward()
    with pytest.raises(RuntimeError, match="mode='auto'"):
        engine.sq_norms(list(engine.params))


def test_a_nan_record_is_dropped_from_an_lstm_step():
    torch.manual_seed(7)
    model = Classifier(nn.LSTM(D_IN, 4, num_layers=2, bidirectional=True, batch_first=True))
    x, y = batch(8, seed=3)
    x = x.float()
    x[2, 1, 0] = float("nan")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt, _ = make_private(model, opt, DataLoader(TensorDataset(x, y), batch_size=8),
                                 noise_multiplier=0.0, max_grad_norm=1.0, seed=0,
                                 on_nonfinite="drop")
    before = [p.detach().clone() for p in model.parameters()]
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all((p != b).any() for p, b in zip(model.parameters(), before))
