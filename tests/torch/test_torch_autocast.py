"""Mixed precision: a forward under ``torch.autocast`` (bfloat16 on the CPU) keeps lower-precision
inputs and backprops; per-example gradients, norms and sums are formed in the parameters'
precision (float32), against the same model run one example at a time under autocast."""

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from dpcore_torch import PerExampleEngine, make_private  # noqa: E402
from clip_movement import group_moves  # noqa: E402

BF16_TOL = 2e-2  # bfloat16 keeps 8 significant bits (relative rounding 2^-9); many roundings


class EveryRule(nn.Module):
    """Embedding, Conv1d, GroupNorm, LayerNorm, LSTM, MultiheadAttention (its rule, and with
    a zero attention appended the torch.func fallback) and Linear, and a GRU beside them on
    the embedding."""

    def __init__(self):
        super().__init__()
        self.emb, self.conv = nn.Embedding(20, 8), nn.Conv1d(8, 8, 3, padding=1)
        self.gn, self.ln = nn.GroupNorm(2, 8), nn.LayerNorm(8)
        self.lstm, self.gru = nn.LSTM(8, 8, batch_first=True), nn.GRU(8, 8, batch_first=True)
        self.att = nn.MultiheadAttention(8, 2, batch_first=True)
        self.att_zero = nn.MultiheadAttention(8, 2, batch_first=True, add_zero_attn=True)
        self.fc = nn.Linear(8, 3)

    def forward(self, k):
        e = self.emb(k)
        h = self.gn(self.conv(e.transpose(1, 2))).transpose(1, 2)
        h = self.lstm(self.ln(h))[0]
        h = h + self.att(h, h, h, need_weights=False)[0]
        h = h + self.att_zero(h, h, h, need_weights=False)[0]
        return self.fc(h.mean(1) + self.gru(e)[0].mean(1))


def tokens(size, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 20, (size, 5), generator=gen),
            torch.randint(0, 3, (size,), generator=gen))


def loss_under_autocast(model, k, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(k)
        assert out.dtype == torch.bfloat16
        return F.cross_entropy(out, y, reduction="sum")


def test_per_example_gradients_and_norms_are_float32_and_match_autocast_one_at_a_time():
    torch.manual_seed(0)
    model = EveryRule()
    plain = copy.deepcopy(model)
    k, y = tokens(6, seed=1)
    engine = PerExampleEngine(model, loss_reduction="sum")
    loss_under_autocast(model, k, y).backward()
    names = list(engine.params)
    norms = engine.sq_norms(names)
    got = engine.per_example_grads()
    assert norms.dtype == torch.float32
    # the norms are those of the float32 gradients the sums are formed from (ghost norms
    # with their rounding bound: at least those), so a clipped contribution never exceeds
    # its bound by a rounding of the low precision
    own = torch.stack([got[n].flatten(1).pow(2).sum(1) for n in names], 1)
    torch.testing.assert_close(norms, own, rtol=1e-3, atol=1e-12)
    assert (norms >= own * (1 - 1e-6)).all()
    for i in range(6):
        plain.zero_grad()
        loss_under_autocast(plain, k[i:i + 1], y[i:i + 1]).backward()
        for n, p in plain.named_parameters():
            assert got[n].dtype == torch.float32
            scale = p.grad.abs().max().item()
            assert (got[n][i] - p.grad).abs().max().item() <= BF16_TOL * max(scale, 1e-6), n


def _summed_magnitudes(model, k, y):
    """sum_i |grad_i| per parameter, each example's gradient by its own backward pass under
    autocast: the scale of the rounding error of a bfloat16 sum over the examples."""
    model = copy.deepcopy(model)
    total = [torch.zeros_like(p) for p in model.parameters()]
    for i in range(len(k)):
        model.zero_grad()
        loss_under_autocast(model, k[i:i + 1], y[i:i + 1]).backward()
        for t, p in zip(total, model.parameters()):
            t.add_(p.grad.abs())
    return total


def test_a_private_step_under_autocast_is_the_non_private_one_without_noise_and_clipping():
    torch.manual_seed(2)
    model = EveryRule()
    twin = copy.deepcopy(model)
    k, y = tokens(8, seed=3)
    # The non-private step rounds its sums over examples and positions in bfloat16, so its
    # error scales with the magnitude of the summed terms, not with their (cancelling) sum:
    # a bias gradient of 0.003 made of terms of 0.01 differs by 7% on one CPU's bfloat16
    # kernels and not on another's. The tolerance is relative to sum_i |grad_i|.
    magnitudes = _summed_magnitudes(model, k, y)
    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, twin))
    model, opt, _ = make_private(model, opt, DataLoader(TensorDataset(k, y), batch_size=8),
                                 noise_multiplier=0.0, max_grad_norm=1e6, seed=0,
                                 loss_reduction="sum")
    before = [p.detach().clone() for p in twin.parameters()]
    for m, o in ((model, opt), (twin, twin_opt)):
        o.zero_grad()
        loss_under_autocast(m, k, y).backward()
        o.step()
    for p, t, b, size in zip(model.parameters(), twin.parameters(), before, magnitudes):
        step, want = p.detach() - b, (t.detach() - b) / 8  # the release divides by q n = 8
        scale = 0.5 * size.max().item() / 8  # lr 0.5, q n = 8
        assert (step - want).abs().max().item() <= BF16_TOL * max(scale, 1e-6)


def test_per_example_gradients_formed_inside_an_autocast_region_stay_float32():
    """The step may run inside the autocast region too; a rule that calls an autocast-listed
    op (the one-channel convolution's forward conv) must not drop to bfloat16 there."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.Flatten(), nn.Linear(3 * 7 * 7, 2))
    plain = copy.deepcopy(model)
    x = torch.randn(4, 1, 9, 9)
    y = torch.randint(0, 2, (4,))
    engine = PerExampleEngine(model, loss_reduction="sum")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        F.cross_entropy(model(x), y, reduction="sum").backward()
        got = engine.per_example_grads()
    for i in range(4):
        plain.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.cross_entropy(plain(x[i:i + 1]), y[i:i + 1], reduction="sum").backward()
        for n, p in plain.named_parameters():
            assert got[n].dtype == torch.float32, n
            scale = p.grad.abs().max().item()
            assert (got[n][i] - p.grad).abs().max().item() <= BF16_TOL * max(scale, 1e-6), n


def test_a_grad_scaler_is_refused_and_the_optimizer_steps_without_it():
    """torch.amp.GradScaler scales every per-example gradient and skips the steps whose
    gradients overflow (a decision on the data): refused before anything is recorded (it
    failed in GradScaler with 'No inf checks were recorded'); the next step without it runs."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    data = TensorDataset(torch.randn(40, 3), torch.randint(0, 2, (40,)))
    model, opt, loader = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      DataLoader(data, batch_size=8), noise_multiplier=1.0,
                                      max_grad_norm=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = next(iter(loader))
    for unscaled_first in (False, True):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if unscaled_first:
            scaler.unscale_(opt)
        with pytest.raises(ValueError, match="GradScaler scales the loss.*without a scaler"):
            scaler.step(opt)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    assert opt.ledger.events == ()
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert len(opt.ledger.steps()) == 1


def test_a_step_taken_inside_the_autocast_region_keeps_one_record_within_its_clip():
    """The whole step inside the autocast region (forward, backward and the private
    gradient): norms, clip factors and sums stay float32, so adding one more of B identical
    records (B = 40..56, per-layer clipping, z = 0) moves each group's sum by at most its
    clip. Under autocast, the core's group norms and the sums' products took bfloat16."""
    import dpcore
    from dpcore_torch import private_grads

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3))
    engine = PerExampleEngine(model, loss_reduction="sum", check_independence=False)
    mech = dpcore.per_layer(dict(engine.leaf_sizes), total_clip=1.0, noise_multiplier=0.0)
    agg = dpcore.PrivateAggregator(mech, n=2000, q=0.05, backend="torch", seed=0)
    x = (3 * torch.randn(1, 8, generator=torch.Generator().manual_seed(1))).expand(64, 8)
    y = torch.ones(64, dtype=torch.long)
    worst, last = {g.name: 0.0 for g in mech.groups}, None
    for b in range(40, 57):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x[:b]), y[:b], reduction="sum")
            out = private_grads(engine, agg, loss, begin_step=True)
        out = {k: v.double() * agg.expected_size for k, v in out.items()}
        if last is not None:
            for name, moved in group_moves(mech, out, last).items():
                worst[name] = max(worst[name], moved)
        last = out
    assert max(worst.values()) <= 1 + 1e-4, worst
    assert worst["3.weight"] > 0.99  # the records are clipped: the test has teeth
