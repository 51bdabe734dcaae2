"""Per-example gradients, norms and clipped sums of the torch engine against a float64 oracle
that back-propagates one example at a time through plain autograd."""

import contextlib
import copy
import math
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dpcore_torch import LeakedGradientError, NotPerExampleError, PerExampleEngine  # noqa: E402
from dpcore_torch.layers import ghost_sq_norms  # noqa: E402

import cancelling  # noqa: E402

RTOL = 1e-6


class Seq(nn.Module):
    """A sequence model touching every rule: Embedding (padding row), Conv1d, GroupNorm,
    LayerNorm, Linear on (B, T, d)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(13, 6, padding_idx=0)
        self.conv = nn.Conv1d(6, 8, 3, padding=1)
        self.gn = nn.GroupNorm(2, 8)
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 3)

    def forward(self, k):
        h = self.gn(self.conv(self.emb(k).transpose(1, 2))).transpose(1, 2)
        return self.fc(torch.tanh(self.ln(h))).mean(1)


class Image(nn.Module):
    """Conv2d with stride, dilation, groups, asymmetric 'same' and reflect padding; an in-place
    ReLU on the first layer's output."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(2, 4, 3, stride=2, padding=1)
        self.c2 = nn.Conv2d(4, 4, 2, padding="same", groups=2, bias=False)
        self.c3 = nn.Conv2d(4, 6, 3, dilation=2, padding=2, padding_mode="reflect")
        self.c4 = nn.Conv2d(6, 16, 3)  # L (D + O) = 9 * 70 < D O = 54 * 16: the ghost branch
        self.fc = nn.Linear(16 * 3 * 3, 3)

    def forward(self, x):
        x = F.relu(self.c1(x), inplace=True)
        for conv in (self.c2, self.c3, self.c4):
            x = torch.tanh(conv(x))
        return self.fc(x.flatten(1))


class OneChannel(nn.Module):
    """Convolutions with one input channel (per-example gradients by a forward convolution
    with the roles swapped): Conv2d with stride, dilation and padding, Conv1d with stride and
    padding, and one whose output is the same size as its kernel."""

    def __init__(self):
        super().__init__()
        self.c2d = nn.Conv2d(1, 3, 3, stride=2, dilation=2, padding=1)
        self.c1d = nn.Conv1d(1, 2, 4, stride=3, padding=2)
        self.tight = nn.Conv2d(1, 2, 5)  # 9 - 5 + 1 = 5: output as large as the kernel
        self.fc = nn.Linear(3 * 4 * 4 + 2 * 28 + 2 * 5 * 5, 3)

    def forward(self, x):
        a = torch.tanh(self.c2d(x)).flatten(1)
        b = torch.tanh(self.c1d(x.flatten(2))).flatten(1)
        c = torch.tanh(self.tight(x)).flatten(1)
        return self.fc(torch.cat([a, b, c], 1))


class Shifted(nn.Module):
    """Stride-1 convolutions (per-example gradients by shifted rows): one input channel with a
    non-square kernel and zero padding, groups with per-axis dilation and padding, a
    depthwise convolution on a transposed (non-contiguous) input, and a dilated Conv1d
    without bias."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(1, 4, (2, 3), padding=(1, 2))                # 9x9 -> 10x11
        self.c2 = nn.Conv2d(4, 6, (3, 2), dilation=(2, 1), padding=(2, 0), groups=2)  # 10x10
        self.depthwise = nn.Conv2d(6, 6, 3, padding=1, groups=6)          # 10x10
        self.c1d = nn.Conv1d(6, 3, 3, dilation=2, padding=1, bias=False)  # 10 -> 8
        self.fc = nn.Linear(3 * 8, 3)

    def forward(self, x):
        h = torch.tanh(self.c2(torch.tanh(self.c1(x))))
        h = torch.tanh(self.depthwise(h.transpose(2, 3)))
        return self.fc(torch.tanh(self.c1d(h.mean(2))).flatten(1))


class Tokens(nn.Module):
    """Linear on sequences on both sides of the ghost/materialise threshold T (d_in + d_out)
    < d_in d_out, an in-place op on a sequence Linear's output, and an embedding tied to the
    output layer (one Parameter, two modules), and learned positions (an embedding whose
    indices never repeat within an example)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 16)
        self.short = nn.Linear(16, 16)   # T = 4: ghost norm
        self.pos = nn.Embedding(4, 16)
        self.head = nn.Linear(16, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, k):
        positions = torch.arange(k.shape[1]).expand_as(k)
        h = self.short(self.emb(k) + self.pos(positions)).tanh_()  # (B, 4, 16), in place
        long = h.repeat(1, 3, 1)                           # (B, 12, 16): T = 12, materialised
        return self.head(torch.cat([h, long], 1)).mean(1)


class Grid(nn.Module):
    """An embedding looked up by a grid of indices per example (B, 3, 4), with indices
    repeated within an example and a padding row: its norm sums an example's backprop rows
    per distinct index before squaring."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(9, 4, padding_idx=2)
        self.fc = nn.Linear(4, 3)

    def forward(self, k):
        return self.fc(torch.tanh(self.emb(k))).mean((1, 2))


class Mixed(nn.Module):
    """A layer without a rule (MultiheadAttention with extra key and value biases), direct
    parameters of a custom module (a
    vector and a scalar), a layer called twice, a frozen and an unused parameter, an in-place
    op on a layer's output (one whose input needs a gradient)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True, add_bias_kv=True)
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.temperature = nn.Parameter(torch.tensor(0.8))
        self.frozen = nn.Linear(8, 8)
        self.frozen.weight.requires_grad_(False)
        self.unused = nn.Linear(3, 3)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = h + self.attn(h, h, h, need_weights=False)[0]
        h = self.frozen(h * self.gate)
        return (self.out(torch.tanh(h)).mean(1) + self.out(h[:, 0]).mul_(1.5)) / self.temperature


class FrozenNorms(nn.Module):
    """BatchNorm layers in eval mode (their running statistics), over positions and over
    vectors, affine and not: the BatchNorm rule's per-example gradients."""

    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(4)  # on (B, 4, 5): 4 channels at 5 positions
        self.fc = nn.Linear(5, 6)
        self.norm2 = nn.BatchNorm1d(6)
        self.plain = nn.BatchNorm1d(6, affine=False)
        self.out = nn.Linear(6, 3)
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for norm in (self.norm, self.norm2, self.plain):
                norm.running_mean.normal_(0, 0.5, generator=gen)
                norm.running_var.uniform_(0.5, 2.0, generator=gen)
                if norm.affine:
                    norm.weight.uniform_(0.5, 1.5, generator=gen)
                    norm.bias.normal_(0, 0.3, generator=gen)
        self.eval()

    def forward(self, x):
        h = self.fc(self.norm(x)).mean(1)  # (B, 6)
        return self.out(self.plain(torch.tanh(self.norm2(h))))


def batches(name, size, gen):
    if name in ("seq", "tokens"):
        vocab = 13 if name == "seq" else 11
        x = torch.randint(0, vocab, (size, 5 if name == "seq" else 4), generator=gen)
        if name == "seq" and size:
            x[0, -1] = 0  # a padding token
    elif name == "grid":
        x = torch.randint(0, 9, (size, 3, 4), generator=gen)
        if size:
            x[0, 0, :3], x[0, 1, 0], x[-1, 2] = 5, 2, 7  # repeats, padding, a repeated row
    elif name in ("image", "one-channel", "shifted"):
        x = torch.randn(size, 2 if name == "image" else 1, 9, 9, generator=gen,
                        dtype=torch.float64)
    else:
        x = torch.randn(size, 4, 5, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, 3, (size,), generator=gen)


MODELS = {"seq": Seq, "image": Image, "one-channel": OneChannel, "shifted": Shifted,
          "tokens": Tokens, "grid": Grid, "mixed": Mixed, "frozen-norms": FrozenNorms}


def oracle(model, x, y):
    """Per-example gradients, one example at a time, by plain autograd (float64)."""
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out = {n: [] for n in trainable}
    for i in range(x.shape[0]):
        model.zero_grad()
        F.cross_entropy(model(x[i:i + 1]), y[i:i + 1], reduction="sum").backward()
        for n, p in trainable.items():
            out[n].append(torch.zeros_like(p) if p.grad is None else p.grad.clone())
    return {n: (torch.stack(g) if g else p.new_zeros((0, *p.shape)))
            for (n, g), p in zip(out.items(), trainable.values())}


def run_engine(model, x, y, reduction, mode="auto"):
    engine = PerExampleEngine(model, loss_reduction=reduction, mode=mode)
    model.zero_grad()
    F.cross_entropy(model(x), y, reduction=reduction).backward()
    return engine


def assert_matches_oracle(model, x, y, reduction):
    """The engine's per-example gradients of ``model`` equal the oracle's; returns them."""
    expected = oracle(copy.deepcopy(model), x, y)
    got = run_engine(model, x, y, reduction).per_example_grads()
    for n in expected:
        assert close(got[n], expected[n]), n
    return expected


def close(a, b):
    scale = max(b.abs().max().item(), 1e-300) if b.numel() else 1.0
    return (a - b).abs().max().item() <= RTOL * scale if b.numel() else a.shape == b.shape


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("size", [0, 1, 5])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_per_example_grads_match_micro_batch_oracle(name, size, reduction):
    gen = torch.Generator().manual_seed(size + 7)
    torch.manual_seed(3)
    model = MODELS[name]().double()
    x, y = batches(name, size, gen)
    expected = oracle(copy.deepcopy(model), x, y) if size else None
    engine = run_engine(model, x, y, reduction)
    got = engine.per_example_grads()
    names = list(engine.params)
    assert set(got) == set(names)
    for n in names:
        assert got[n].shape == (size, *engine.params[n].shape), n
        if size:
            assert close(got[n], expected[n]), n
    norms = engine.sq_norms(names)
    assert norms.shape == (size, len(names))
    if size:
        want = torch.stack([expected[n].reshape(size, -1).pow(2).sum(1) for n in names], 1)
        assert close(norms, want)


@pytest.mark.parametrize("form", ["shifted", "convolution", "auto"])
@pytest.mark.parametrize("name", ["shifted", "image", "one-channel", "seq"])
def test_every_conv_form_matches_the_oracle(name, form, monkeypatch):
    """Both forms of per-example convolution weight gradients (and the timed choice between
    them, which must remember one form per layer configuration) against the oracle."""
    from dpcore_torch import layers

    monkeypatch.setattr(layers, "CONV_FORM", form)
    for rule in {layers.RULES[nn.Conv1d], layers.RULES[nn.Conv2d]}:
        monkeypatch.setattr(rule, "_faster", {})
    gen = torch.Generator().manual_seed(17)
    torch.manual_seed(6)
    model = MODELS[name]().double()
    x, y = batches(name, 5, gen)
    expected = oracle(copy.deepcopy(model), x, y)
    got = run_engine(model, x, y, "mean").per_example_grads()
    for n in got:
        assert close(got[n], expected[n]), n
    chosen = [rule._faster for rule in {layers.RULES[nn.Conv1d], layers.RULES[nn.Conv2d]}]
    stride_one = [m for m in model.modules()
                  if isinstance(m, (nn.Conv1d, nn.Conv2d)) and set(m.stride) == {1}]
    assert sum(map(len, chosen)) == (len(stride_one) if form == "auto" else 0)
    assert all(f in ("shifted", "convolution") for c in chosen for f in c.values())


def test_unknown_conv_form_is_refused(monkeypatch):
    from dpcore_torch import layers

    monkeypatch.setattr(layers, "CONV_FORM", "unfold")
    model = MODELS["shifted"]().double()
    x, y = batches("shifted", 2, torch.Generator().manual_seed(0))
    engine = run_engine(model, x, y, "mean")
    with pytest.raises(ValueError, match="CONV_FORM must be one of .* got 'unfold'"):
        engine.per_example_grads()


@pytest.mark.parametrize("name", ["shifted", "image", "seq"])
def test_shifted_rows_in_chunks_of_one_record(name, monkeypatch):
    """Stride-1 convolutions with one record per chunk (the chunk loop and its offsets), and
    their clipped sums read from the permuted (kernel row first) storage, against the oracle."""
    from dpcore_torch import layers

    monkeypatch.setattr(layers, "CONV_FORM", "shifted")
    monkeypatch.setattr(layers, "ROW_CHUNK_BYTES", 1)
    gen = torch.Generator().manual_seed(13)
    torch.manual_seed(4)
    model = MODELS[name]().double()
    x, y = batches(name, 4, gen)
    expected = oracle(copy.deepcopy(model), x, y)
    engine = run_engine(model, x, y, "sum")
    names = list(engine.params)
    want = torch.stack([expected[n].reshape(len(x), -1).pow(2).sum(1) for n in names], 1)
    assert close(engine.sq_norms(names), want)
    factors = torch.rand(4, 1, generator=gen, dtype=torch.float64)
    got = engine.clipped_sums(factors, {n: 0 for n in names})
    for n in names:
        assert close(got[n], torch.tensordot(factors[:, 0], expected[n], dims=1)), n


@pytest.mark.parametrize("name", sorted(MODELS))
def test_ghost_and_book_keeping_equal_vmap(name):
    """Norms and clipped sums of the rules (ghost norms, book-keeping) against mode='vmap'
    (torch.func on the whole model) on the same batch."""
    gen = torch.Generator().manual_seed(11)
    torch.manual_seed(5)
    model = MODELS[name]().double()
    x, y = batches(name, 6, gen)
    twin = copy.deepcopy(model)
    fast = run_engine(model, x, y, "mean")
    slow = run_engine(twin, x, y, "mean", mode="vmap")
    names = list(fast.params)
    assert close(fast.sq_norms(names), slow.sq_norms(names))
    factors = torch.rand(6, 2, generator=gen, dtype=torch.float64)
    groups = {n: i % 2 for i, n in enumerate(names)}
    got, want = fast.clipped_sums(factors, groups), slow.clipped_sums(factors, groups)
    for n in names:
        assert close(got[n], want[n]), n


def test_batchnorm_in_training_mode_is_refused_with_a_fix():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4))
    with pytest.raises(NotPerExampleError, match=r"GroupNorm\(4, 4\)"):
        PerExampleEngine(model)
    model.eval()
    engine = PerExampleEngine(model)  # frozen statistics are per example
    model.train()
    with pytest.raises(NotPerExampleError, match="'1'"):
        model(torch.randn(2, 1, 5, 5))
    with torch.no_grad(), pytest.raises(NotPerExampleError, match="'1'"):
        model(torch.randn(2, 1, 5, 5))  # it would move the running statistics too
    assert not model[1].running_mean.any()
    engine.detach()


@pytest.mark.parametrize("affine", [False, True])
def test_instance_norm_tracking_running_statistics_in_training_is_refused(affine):
    """Each example is normalised with its own statistics, but the running ones move with
    the batch's, without noise, and eval mode reads them (accepted, they filled with the
    batch's; with affine=True torch.func failed, blaming random operations)."""
    model = nn.Sequential(nn.Conv2d(1, 4, 3),
                          nn.InstanceNorm2d(4, affine=affine, track_running_stats=True))
    with pytest.raises(NotPerExampleError, match=r"'1' tracks running statistics.*"
                                                 r"track_running_stats=False"):
        PerExampleEngine(model)
    model.eval()
    engine = PerExampleEngine(model)  # eval mode reads them, and moves nothing
    model.train()
    with pytest.raises(NotPerExampleError, match="'1' tracks running statistics"):
        model(torch.randn(2, 1, 5, 5))
    assert not model[1].running_mean.any()
    engine.detach()


def test_an_embedding_with_max_norm_is_refused():
    """Its lookups rescale the batch's rows in place, without noise (the weights showed
    which ids the batch held, learning rate 0)."""
    with pytest.raises(ValueError, match="'0' has max_norm=1.0.*max_norm=None"):
        PerExampleEngine(nn.Sequential(nn.Embedding(50, 4, max_norm=1.0), nn.Flatten(),
                                       nn.Linear(4, 2)))
    # an EmbeddingBag (a fallback module) too, by name: torch.func's internals had refused it
    # mid-step ("embedding_renorm_ ... more elements than self")
    for bag in [nn.EmbeddingBag(50, 4, max_norm=1.0),
                nn.EmbeddingBag(50, 4, scale_grad_by_freq=True)]:
        with pytest.raises(ValueError, match="EmbeddingBag '0' has (max_norm|scale_grad)"):
            PerExampleEngine(nn.Sequential(bag, nn.Linear(4, 2)))


@pytest.mark.parametrize("affine", [False, True])
def test_batchnorm_without_running_statistics_is_refused_in_eval_mode_too(affine):
    """With track_running_stats=False PyTorch normalises by the batch's statistics in eval mode
    as well: removing one record would move every other record's gradient."""
    model = nn.Sequential(nn.Linear(3, 4),
                          nn.BatchNorm1d(4, affine=affine, track_running_stats=False)).eval()
    with pytest.raises(NotPerExampleError, match="track_running_stats=True"):
        PerExampleEngine(model)


def test_batch_second_attention_is_refused():
    with pytest.raises(NotPerExampleError, match="batch_first=True"):
        PerExampleEngine(nn.MultiheadAttention(4, 2))


class Bagged(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag, self.head = nn.EmbeddingBag(20, 4), nn.Linear(4, 3)

    def forward(self, tokens, offsets):
        return self.head(self.bag(tokens, offsets))


def test_an_embedding_bag_on_tokens_with_offsets_is_refused_with_the_fix():
    model = Bagged()
    engine = PerExampleEngine(model)
    model(torch.randint(0, 20, (12,)), torch.tensor([0, 5, 9])).sum().backward()
    with pytest.raises(ValueError, match=r"EmbeddingBag takes a padded \(B, T\) tensor"):
        engine.per_example_grads()


def test_functional_use_of_an_instrumented_weight_is_an_error():
    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(7, 4)

        def forward(self, k):
            return F.linear(self.emb(k).mean(1), self.emb.weight)

    model = Functional()
    engine = run_engine(model, torch.randint(0, 7, (3, 2)), torch.randint(0, 7, (3,)), "sum")
    with pytest.raises(LeakedGradientError, match="emb.weight"):
        engine.sq_norms(list(engine.params))


def test_detach_restores_the_module():
    model = nn.Sequential(nn.Linear(3, 2))
    engine = PerExampleEngine(model)
    engine.detach()
    model(torch.randn(4, 3)).sum().backward()
    assert model[0].weight.grad is not None and "forward" not in vars(model[0])


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("prefer", ["memory", "time"])
def test_dropped_records_with_nan_or_inf_leave_the_sums_finite(name, prefer):
    """on_nonfinite='drop': records whose values hold NaN or Inf get factor 0 and contribute
    nothing, whatever the layer (book-keeping sums must not form 0 * NaN), against the
    oracle's clipped sum of the other records."""
    import dpcore
    from dpcore_torch import private_grads

    gen = torch.Generator().manual_seed(13)
    torch.manual_seed(6)
    model = MODELS[name]().double()
    x, y = batches(name, 6, gen)
    expected = oracle(copy.deepcopy(model), x, y)
    engine = PerExampleEngine(model, loss_reduction="sum", prefer=prefer)
    second = list(model.children())[1]

    def poison(module, args):  # NaN into record 1's and Inf into record 4's input
        x = args[0].clone()
        if x.shape[0] == 6:  # not the fallback's replay of one example
            x[(1,) + (0,) * (x.dim() - 1)], x[(4,) + (-1,) * (x.dim() - 1)] = math.nan, math.inf
        return (x, *args[1:])

    handle = second.register_forward_pre_hook(poison)
    agg = dpcore.PrivateAggregator(dpcore.flat(list(engine.params), 0.5, 0.0), n=12, q=0.5,
                                   backend="torch", seed=0, on_nonfinite="drop")
    agg.begin_step()
    got = private_grads(engine, agg, F.cross_entropy(model(x), y, reduction="sum"))
    handle.remove()
    norms = torch.stack([g.reshape(6, -1).pow(2).sum(1) for g in expected.values()], 1)
    norms = norms.sum(1).sqrt()
    factors = torch.clamp(0.5 / norms, max=1.0) * (torch.arange(6) % 3 != 1)
    for n, rows in expected.items():
        want = torch.tensordot(factors, rows, dims=1) / 6
        assert torch.isfinite(got[n]).all(), n
        assert close(got[n], want), n


@pytest.mark.parametrize("name", [*sorted(MODELS), "ghost-conv"])
@pytest.mark.parametrize("prefer", ["memory", "time"])
def test_private_grads_are_the_clipped_average_and_hold_no_graph(name, prefer):
    """The functional step with gradients enabled (outside the optimizer's no_grad): the
    clipped average of the oracle's gradients, as plain tensors. A convolution whose sums
    are formed from its kept input and backprops (many channels, few positions) gave
    tensors with a graph, or failed adding into a later layer's noise in place."""
    import dpcore
    from dpcore_torch import private_grads

    gen = torch.Generator().manual_seed(21)
    torch.manual_seed(8)
    if name == "ghost-conv":
        model = nn.Sequential(nn.Conv1d(6, 6, 3, padding=1), nn.Tanh(), nn.Flatten(),
                              nn.Linear(24, 3)).double()
        x, y = torch.randn(5, 6, 4, generator=gen, dtype=torch.float64), torch.arange(5) % 3
    else:
        model = MODELS[name]().double()
        x, y = batches(name, 5, gen)
    expected = oracle(copy.deepcopy(model), x, y)
    engine = PerExampleEngine(model, loss_reduction="sum", prefer=prefer)
    agg = dpcore.PrivateAggregator(dpcore.flat(list(engine.params), 0.5, 0.0), n=10, q=0.5,
                                   backend="torch")
    agg.begin_step()
    got = private_grads(engine, agg, F.cross_entropy(model(x), y, reduction="sum"))
    norms = torch.stack([g.reshape(5, -1).pow(2).sum(1) for g in expected.values()], 1)
    factors = torch.clamp(0.5 / norms.sum(1).sqrt(), max=1.0)
    for n, rows in expected.items():
        assert got[n].grad_fn is None and not got[n].requires_grad, n
        assert close(got[n], torch.tensordot(factors, rows, dims=1) / 5), n
    engine.detach()


@pytest.mark.parametrize("first", ["linear", "embedding", "conv"])
def test_layer_outputs_are_not_kept_alive_by_the_finished_graph(first):
    """A first layer's output (its input needs no gradient) is freed once nothing uses it,
    although the loss, and so the finished graph, lives on through the optimizer step: the
    engine keeps only the inputs and backprops it needs, no activation besides."""
    import weakref

    head = {"linear": nn.Linear(4, 5), "embedding": nn.Embedding(9, 5),
            "conv": nn.Conv1d(3, 5, 1)}[first]
    model = nn.Sequential(head, nn.Tanh(), nn.Flatten(), nn.LazyLinear(2))
    inputs = {"linear": torch.randn(6, 4), "embedding": torch.randint(0, 9, (6, 1)),
              "conv": torch.randn(6, 3, 1)}[first]
    model(inputs)  # materialise the lazy layer
    engine = PerExampleEngine(model)
    outputs = []
    head.register_forward_hook(lambda module, args, out: outputs.append(weakref.ref(out)))
    loss = model(inputs).sum()
    loss.backward()
    assert outputs[0]() is None
    assert engine.sq_norms(list(engine.params)).shape == (6, len(engine.params))


class Checkpointed(nn.Module):
    """A middle block under activation checkpointing (its forward runs again in the backward)."""

    def __init__(self, reentrant):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(5, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.reentrant = reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.a(x))
        h = checkpoint(lambda t: torch.tanh(self.b(t)), h, use_reentrant=self.reentrant)
        return self.c(h)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_matches_the_oracle(reentrant):
    """The recomputed forward runs during the backward pass; it is not a second batch."""
    gen = torch.Generator().manual_seed(4)
    torch.manual_seed(4)
    model = Checkpointed(reentrant).double()
    x = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (6,), generator=gen)
    assert_matches_oracle(model, x, y, "sum")


class Padded(nn.Module):
    """Token sequences with padding (token 0), the padding mask given by keyword: to a
    TransformerEncoderLayer (its attention has a rule), or to a MultiheadAttention with extra
    key and value biases (a fallback unit, which splits the mask per example)."""

    def __init__(self, fallback):
        super().__init__()
        self.fallback = fallback
        self.emb = nn.Embedding(11, 8, padding_idx=0)
        if fallback:
            self.block = nn.MultiheadAttention(8, 2, batch_first=True, add_bias_kv=True)
        else:
            self.block = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.fc = nn.Linear(8, 3)

    def forward(self, k):
        pad, h = k == 0, self.emb(k)
        if self.fallback:
            h = self.block(h, h, h, key_padding_mask=pad, need_weights=False)[0]
        else:
            h = self.block(h, src_key_padding_mask=pad)
        return self.fc(h.masked_fill(pad[..., None], 0).sum(1))


@pytest.mark.parametrize("fallback", [False, True])
def test_padding_masks_passed_by_keyword_are_split_per_example(fallback):
    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(5)
    model = Padded(fallback).double()
    x = torch.randint(1, 11, (5, 6), generator=gen)
    x[0, 4:], x[3, 2:] = 0, 0  # padded tails of two lengths
    y = torch.randint(0, 3, (5,), generator=gen)
    assert_matches_oracle(model, x, y, "mean")


def test_a_per_example_tensor_passed_by_keyword_to_a_fallback_is_refused():
    """Shared by every one-example replay, it would make example i's gradient depend on every
    record: the replay's output of B rows is refused."""
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 2))

        def forward(self, x, scale):
            return torch.tanh(x @ self.w) * scale

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.f, self.out = Scaled(), nn.Linear(2, 3)

        def forward(self, x):
            return self.out(self.f(x, scale=x[:, :1]))

    engine = run_engine(Net(), torch.randn(4, 3), torch.randint(0, 3, (4,)), "sum")
    with pytest.raises(ValueError, match="positional arguments"):
        engine.per_example_grads()


def test_a_reparametrised_linear_takes_the_fallback():
    """The hook-based weight_norm leaves an nn.Linear whose parameters are weight_g and
    weight_v: the Linear rule (of weight and bias) must not claim them."""
    import warnings

    def model():
        torch.manual_seed(7)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecated, still shipped
            return nn.Sequential(nn.utils.weight_norm(nn.Linear(4, 3).double()), nn.Tanh(),
                                 nn.Linear(3, 3).double())

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (5,), generator=gen)
    expected = oracle(model(), x, y)  # (a module with weight_norm cannot be deep-copied)
    got = run_engine(model(), x, y, "mean").per_example_grads()
    assert set(got) == {"0.bias", "0.weight_g", "0.weight_v", "2.weight", "2.bias"}
    for n in expected:
        assert close(got[n], expected[n]), n


class Norms(nn.Module):
    """GroupNorm on a transposed (non-contiguous) input and on (N, C) vectors."""

    def __init__(self):
        super().__init__()
        self.fc, self.seq_gn, self.vec_gn = nn.Linear(4, 6), nn.GroupNorm(2, 6), nn.GroupNorm(3, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x):  # x (B, T, 4)
        h = self.seq_gn(self.fc(x).transpose(1, 2)).mean(2)
        return self.out(torch.tanh(self.vec_gn(h)))


def test_group_norm_on_transposed_and_vector_inputs():
    gen = torch.Generator().manual_seed(8)
    torch.manual_seed(8)
    model = Norms().double()
    x = torch.randn(5, 7, 4, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (5,), generator=gen)
    assert_matches_oracle(model, x, y, "sum")


class InPlaceResidual(nn.Module):
    """A residual added in place to the output of a fallback MultiheadAttention (extra key and
    value biases), which is a view (a transpose for batch_first): a hook on the view would be
    rebased away."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(9, 4)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True, add_bias_kv=True)
        self.out = nn.Linear(4, 3)

    def forward(self, k):
        x = self.emb(k)
        h = self.attn(x, x, x, need_weights=False)[0]
        h += x
        return self.out(h.mean(1))


def test_an_in_place_residual_on_a_fallback_view_output_keeps_its_gradient():
    gen = torch.Generator().manual_seed(9)
    torch.manual_seed(9)
    model = InPlaceResidual().double()
    x = torch.randint(0, 9, (5, 6), generator=gen)
    y = torch.randint(0, 3, (5,), generator=gen)
    expected = assert_matches_oracle(model, x, y, "sum")
    assert expected["attn.in_proj_weight"].abs().max() > 0


def test_a_model_instrumented_twice_is_refused_until_detached():
    """Two engines would both record every call (the first one for ever)."""
    model = nn.Sequential(nn.Linear(3, 2))
    engine = PerExampleEngine(model)
    with pytest.raises(ValueError, match="already"):
        PerExampleEngine(model)
    engine.detach()
    PerExampleEngine(model)


def test_a_layer_called_with_its_input_by_keyword():
    gen = torch.Generator().manual_seed(10)

    class Keyword(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(input=x)

    torch.manual_seed(10)
    model = Keyword().double()
    x = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (5,), generator=gen)
    assert_matches_oracle(model, x, y, "sum")


def test_a_layer_input_changed_in_place_after_the_layer_is_refused():
    """The kept input would no longer be the one the layer saw: autograd's version check
    refuses it, as plain PyTorch does."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x):
            h = self.a(x) + 1.0
            out = self.b(h)
            h.mul_(3.0)  # b's input, after b ran
            return out + h[:, :2]

    model = Net()
    PerExampleEngine(model)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(torch.randn(5, 4)).pow(2).sum().backward()


class Gated(nn.Module):
    """A custom module (a fallback unit of its own parameter)."""

    def __init__(self, d):
        super().__init__()
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        return torch.tanh(x * self.gate)


class Custom(nn.Module):
    """A custom head whose weight is tied to a Linear (one Parameter, a rule unit and a
    fallback unit), and a gate shared by two custom modules."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 5)
        self.g1, self.g2 = Gated(5), Gated(5)
        self.g2.gate = self.g1.gate
        self.head = Head(self.inp.weight)

    def forward(self, x):
        return self.head(self.g2(self.g1(self.inp(x))))[:, :3]


class Head(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, h):
        return h @ self.weight.t()


def test_a_weight_tied_between_a_rule_layer_and_a_custom_module_matches_the_oracle():
    """The custom module's own use reaches the Parameter only through its per-example
    replay, so the Linear does not see it as a use it could not see."""
    gen = torch.Generator().manual_seed(8)
    torch.manual_seed(8)
    model = Custom().double()
    x = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (6,), generator=gen)
    assert set(assert_matches_oracle(model, x, y, "mean")) == {"inp.weight", "inp.bias",
                                                               "g1.gate"}


@pytest.mark.parametrize("use, mode", [("module", "auto"), ("penalty", "auto"),
                                       ("penalty", "vmap")])  # vmap: one unit, the model
def test_a_fallback_parameter_used_outside_its_module_is_an_error(use, mode):
    """A custom module's parameter used elsewhere too (in another module's forward, or in a
    penalty added to the loss): that use's gradient is not per example, and was dropped."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.g, self.out = Gated(4), nn.Linear(4, 3)

        def forward(self, x):
            h = self.g(x)
            return self.out(h * self.g.gate if use == "module" else h)

    model = Net()
    engine = PerExampleEngine(model, mode=mode)
    loss = F.cross_entropy(model(torch.randn(5, 4)), torch.randint(0, 3, (5,)))
    if use == "penalty":
        loss = loss + model.g.gate.pow(2).sum()
    loss.backward()
    with pytest.raises(LeakedGradientError, match="g.gate") as error:
        engine.sq_norms(list(engine.params))
    assert ("mode='vmap'" in str(error.value)) == (mode == "auto")



@pytest.mark.parametrize("layer", ["linear", "conv", "embedding"])
def test_float32_ghost_norms_never_fall_below_the_exact_norms(layer):
    """With the rounding bound of dpcore.rounding, the ghost squared norm is at least the
    exact squared norm of the float32 data's per-example gradient (float64 oracle), where
    the plain ghost sum fell below it (by 0.8% here, by 10% in a probe with 200 positions: a
    clipped contribution of 1.05 C); on ordinary data the bound moves the norms by under 1%.
    (A materialised gradient needs no bound: it is the very vector that is clipped and
    summed. An embedding's norm sums each record's rows per id in one order, its clipped
    sum in another: it takes the bound.)"""
    rng = np.random.default_rng(3)
    # shapes that take the ghost norm: T (d_in + d_out) <= d_in d_out
    b, t, d_in, d_out = {"linear": (32, 64, 128, 256), "conv": (32, 16, 48, 40),
                         "embedding": (32, 64, 9, 128)}[layer]
    module = {"linear": nn.Linear(d_in, d_out), "conv": nn.Conv1d(d_in, d_out, 1),
              "embedding": nn.Embedding(d_in, d_out)}[layer]
    engine = PerExampleEngine(module, loss_reduction="sum")
    for spread in cancelling.SPREADS:
        a, g, exact = cancelling.case(rng, "rows" if layer == "embedding" else "dense",
                                      b, t, d_in, d_out, spread, vocabulary=d_in)
        x, g, exact = torch.from_numpy(a), torch.from_numpy(g), torch.from_numpy(exact)
        if layer == "conv":  # Conv1d of kernel 1 on (B, C, L): positions on the last axis
            x, g = x.transpose(1, 2), g.transpose(1, 2)
        engine.clear()
        (module(x) * g).sum().backward()
        got = engine.sq_norms(["weight"])[:, 0].double()
        assert (got >= exact).all(), (spread, (got / exact).min().item())
        if spread == 1.0:
            assert (got <= exact * 1.01).all()

def test_bfloat16_ghost_norms_are_formed_in_float32():
    """bfloat16 inputs' and backprops' Gram matrices are formed in float32: their rounding
    bound, which grows with the machine epsilon, would otherwise inflate every norm many
    times over."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(8, 64, 128, generator=gen).to(torch.bfloat16)
    g = torch.randn(8, 64, 256, generator=gen).to(torch.bfloat16)
    got = ghost_sq_norms(x, g).double()
    exact = torch.einsum("bti,bto->bio", x.double(), g.double()).pow(2).sum((1, 2))
    assert (got >= exact).all() and (got <= exact * 1.01).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_parameters_are_refused(dtype):
    """A 16-bit parameter's clipped sum would be rounded in its dtype before the noise: for
    512 records of a bfloat16 Linear, leaving one out moved the sum by 1.5 clips. The model
    is left uninstrumented."""
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2).to(dtype))
    with pytest.raises(ValueError, match=rf"parameter '1.weight' is {dtype}.*torch.autocast"):
        PerExampleEngine(model)
    assert not any(getattr(m, "_dpcore_engine", None) for m in model.modules())
    PerExampleEngine(model.float())


def test_autocast_keeps_one_record_within_its_clip():
    """The way to compute in bfloat16: float32 parameters under autocast. Leaving any one of
    512 aligned records out moves the clipped sums by at most the clip (with bfloat16
    parameters they moved by 1.5 clips)."""
    gen = torch.Generator().manual_seed(10)
    b = 512
    model = nn.Linear(64, 32, bias=False)
    x = torch.randn(b, 64, generator=gen) + 3.0
    y = torch.randn(b, 32, generator=gen)
    engine = PerExampleEngine(model, loss_reduction="sum", check_independence=False)

    def sums(keep):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = (model(x).float() - y).square().sum()
        loss.backward()
        factors = (1.0 / engine.sq_norms(["weight"]).sqrt()).clamp(max=1.0) * keep[:, None]
        out = engine.clipped_sums(factors, {"weight": 0})["weight"].double()
        engine.clear()
        return out

    full = sums(torch.ones(b))
    for i in range(0, b, 37):
        keep = torch.ones(b)
        keep[i] = 0
        assert torch.linalg.norm(full - sums(keep)) <= 1 + 1e-4, i


class SharedPositions(nn.Module):
    """Learned positions looked up on torch.arange(T) and added by broadcasting (the common
    way, e.g. GPT-2's): their gradient is summed over the batch."""

    def __init__(self, expand):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(20, 4), nn.Embedding(8, 4)
        self.out, self.expand = nn.Linear(4, 3), expand

    def forward(self, k):
        positions = torch.arange(k.shape[1])
        if self.expand:
            positions = positions.expand_as(k)
        return self.out(self.tokens(k) + self.positions(positions)).mean(1)


@pytest.mark.parametrize("batch", [8, 5])
def test_positions_shared_by_every_example_are_refused(batch):
    """Whatever the batch size: with B = T = 8 the engine would otherwise take the 8
    positions for 8 records and clip them as such (silently; B != T raised on the sizes).
    Positions expanded to (B, T) match the oracle."""
    gen = torch.Generator().manual_seed(6)
    k = torch.randint(0, 20, (batch, 8), generator=gen)
    y = torch.randint(0, 3, (batch,), generator=gen)
    model = SharedPositions(expand=False)
    PerExampleEngine(model)
    with pytest.raises(NotPerExampleError, match=r"torch.arange\(8\).*expand\(B, T\)"):
        model(k)
    torch.manual_seed(6)
    assert_matches_oracle(SharedPositions(expand=True).double(), k, y, "mean")


def test_one_index_per_example_is_not_taken_for_positions():
    """A 1-D index tensor is one lookup per example (a user id, say), also when it reads
    0, 1, ... for fewer than SHARED_POSITIONS examples."""
    for ids in (torch.tensor([4, 0, 7, 1, 1, 8, 2, 3, 5]), torch.arange(5)):
        torch.manual_seed(2)
        model = nn.Sequential(nn.Embedding(9, 3), nn.Linear(3, 3)).double()
        assert_matches_oracle(model, ids, ids % 3, "sum")


class Recursive(nn.Module):
    """A custom module that calls itself: the inner call is part of the outer one's replay."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, 5))
        self.out = nn.Linear(5, 3)

    def forward(self, x, depth=2):
        h = torch.tanh(x * self.gate)
        return self(h, depth - 1) if depth > 1 else self.out(h)


class OwnWeightInChild(nn.Module):
    """A custom module's own Parameter, also the weight of its child Linear (a rule layer) and
    of a custom child: each unit forms its own use only."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 5) * 0.5)
        self.lin = nn.Linear(5, 5, bias=False)
        self.lin.weight = self.w
        self.child = Head(self.w)
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        return self.out(torch.tanh(x @ self.w.t()) + self.lin(x) + self.child(x))


class Clamped(nn.Module):
    """A constraint applied in place inside the forward (under no_grad), and a forward hook of
    the user's that uses the parameter too (the replay runs it again)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, 5))

    def forward(self, x):
        with torch.no_grad():
            self.gate.clamp_(max=1.2)
        return torch.tanh(x * self.gate)


@pytest.mark.parametrize("mode", ["auto", "vmap"])
@pytest.mark.parametrize("name", ["recursive", "own-weight-in-child", "clamped-with-hook"])
def test_fallback_modules_nested_tied_or_hooked_match_the_oracle(name, mode):
    gen = torch.Generator().manual_seed(10)
    torch.manual_seed(10)
    if name == "recursive":
        model = Recursive()
    elif name == "own-weight-in-child":
        model = OwnWeightInChild()
    else:
        model = nn.Sequential(Clamped(), nn.Linear(5, 3))
        model[0].register_forward_hook(lambda module, args, out: out * module.gate)
    model = model.double()
    x = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (6,), generator=gen)
    expected = oracle(copy.deepcopy(model), x, y)
    engine = PerExampleEngine(model, loss_reduction="sum", mode=mode)
    F.cross_entropy(model(x), y, reduction="sum").backward()
    got = engine.per_example_grads()
    for n in expected:
        assert close(got[n], expected[n]), n
    if name == "clamped-with-hook":
        assert model[0].gate.max().item() == 1.2  # the constraint reached the parameter


class Counted(nn.Module):
    """A layer that counts its calls in a buffer and divides by the count."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, n) / n)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        with torch.no_grad():
            self.calls += 1
        return torch.tanh(x @ self.weight) / self.calls


def stateful_model(form):
    torch.manual_seed(15)
    if form == "counted":
        return nn.Sequential(Counted(5), nn.Linear(5, 3)).double()
    spectral = (nn.utils.parametrizations.spectral_norm if form == "spectral-norm"
                else nn.utils.spectral_norm)  # the hook-based form
    return nn.Sequential(spectral(nn.Linear(5, 6).double()), nn.Tanh(),
                         nn.Linear(6, 3).double())


@pytest.mark.parametrize("mode", ["auto", "vmap"])
@pytest.mark.parametrize("form", ["spectral-norm", "spectral-norm-hook", "counted"])
def test_buffers_a_fallback_forward_updates_are_replayed_from_the_call(form, mode):
    """Modules whose forward pass updates buffers from the weights alone (spectral_norm's
    power iteration, a count of calls): per-example gradients equal the oracle's, each
    example run alone from the buffers the batch started from, and the replay leaves the
    buffers as the forward pass did (it does not update them a second time)."""
    gen = torch.Generator().manual_seed(15)
    x = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (6,), generator=gen)
    model = stateful_model(form)
    start = copy.deepcopy(model.state_dict())
    expected = {n: [] for n, _ in model.named_parameters()}
    for i in range(len(x)):
        model.load_state_dict(start)
        model.zero_grad()
        F.cross_entropy(model(x[i:i + 1]), y[i:i + 1], reduction="sum").backward()
        for n, p in model.named_parameters():
            expected[n].append(p.grad.clone())
    model.load_state_dict(start)
    F.cross_entropy(model(x), y, reduction="sum")  # what one forward pass leaves
    want = {k: t.clone() for k, t in model.state_dict().items()}
    model = stateful_model(form)
    engine = PerExampleEngine(model, loss_reduction="sum", mode=mode)
    F.cross_entropy(model(x), y, reduction="sum").backward()
    got = engine.per_example_grads()
    for n, grads in expected.items():
        assert close(got[n], torch.stack(grads)), n
    for k, t in model.state_dict().items():
        assert torch.equal(t, want[k]), k


def test_a_buffer_first_changed_in_a_later_call_is_named_when_the_replay_differs():
    """A buffer that a module's first call left alone is not kept before its calls: if a
    later call changes it and the replay's output differs, the error names it."""
    torch.manual_seed(16)
    model = nn.Sequential(Counted(5), nn.Linear(5, 3)).double()
    engine = PerExampleEngine(model, loss_reduction="sum")
    x = torch.randn(4, 5, dtype=torch.float64)
    model[0].forward = types.MethodType(lambda self, x: torch.tanh(x @ self.weight), model[0])
    model(x).sum().backward()  # the first call does not count
    engine.per_example_grads()
    engine.clear()
    model[0].forward = types.MethodType(Counted.forward, model[0])
    model(x).sum().backward()
    with pytest.raises(ValueError, match=r"changed its buffers \['calls'\]"):
        engine.per_example_grads()


class Writes(nn.Module):
    """Adds a buffer it may share with another module; if ``write``, first sets it from its
    weight (without gradient)."""

    def __init__(self, shared, write):
        super().__init__()
        self.weight, self.write = nn.Parameter(torch.randn(3, 3, dtype=torch.float64)), write
        self.register_buffer("shift", shared)

    def forward(self, x):
        if self.write:
            with torch.no_grad():
                self.shift.copy_(self.weight.sum(0))
        return x @ self.weight + self.shift


def test_a_buffer_shared_by_two_modules_stays_shared_in_replays_and_reruns():
    """One tensor registered in two fallback modules, written by the first: the replays and
    the check's reruns keep it one tensor (copied once), so the second reads what the first
    wrote; each example's gradients equal the oracle's, from the model as it began."""
    torch.manual_seed(19)
    shared = torch.zeros(3, dtype=torch.float64)
    model = nn.Sequential(Writes(shared, True), Writes(shared, False))
    x = torch.randn(4, 3, dtype=torch.float64)
    expected = {n: [] for n, _ in model.named_parameters()}
    for i in range(len(x)):
        alone = copy.deepcopy(model)
        alone(x[i:i + 1]).square().sum().backward()
        for n, p in alone.named_parameters():
            expected[n].append(p.grad)
    engine = PerExampleEngine(model, loss_reduction="sum")
    model(x).square().sum().backward()
    got = engine.per_example_grads()
    engine.clear()  # the check's reruns
    assert engine._probe.checked == 1
    for n, grads in expected.items():
        assert close(got[n], torch.stack(grads)), n


class RunningCentre(nn.Module):
    """Centres its input by a running mean of the inputs it has seen, kept in a buffer that
    is replaced at every training call."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, n) / n)
        self.register_buffer("mean", torch.zeros(n))

    def forward(self, x):
        out = (x - self.mean) @ self.weight
        self.mean = 0.9 * self.mean + 0.1 * x.mean(0).detach()
        return out


@pytest.mark.parametrize("mode", ["auto", "vmap"])
def test_a_running_statistic_of_the_batch_in_a_buffer_is_refused(mode):
    """Read before it is updated, the statistic leaves the call's output per example; the
    buffer it leaves is not what one example's replay leaves: refused, without the
    independence check too (the batch's records would reach later steps without noise)."""
    torch.manual_seed(18)
    model = nn.Sequential(RunningCentre(5), nn.Linear(5, 3)).double()
    engine = PerExampleEngine(model, loss_reduction="sum", mode=mode, check_independence=False)
    model(torch.randn(6, 5, dtype=torch.float64)).sum().backward()
    with pytest.raises(NotPerExampleError, match=r"leaves its buffers \[.*mean'\]"):
        engine.per_example_grads()


class ActNorm(nn.Module):
    """Glow's ActNorm: the first training call sets the shift from the batch's mean."""

    def __init__(self, n):
        super().__init__()
        self.shift, self.mix = nn.Parameter(torch.zeros(n)), nn.Parameter(torch.eye(n))
        self.register_buffer("initialised", torch.tensor(False))

    def forward(self, x):
        if not self.initialised:
            with torch.no_grad():
                self.shift.copy_(-x.mean(0))
                self.initialised.fill_(True)
        return (x + self.shift) @ self.mix


def test_a_data_dependent_initialisation_in_a_fallback_is_refused():
    """Replayed from its buffers before the call, the initialisation runs again, from one
    example: refused, naming it (it was replayed from the initialised state, and the batch's
    mean trained unnoticed, with the independence check off)."""
    torch.manual_seed(17)
    model = nn.Sequential(ActNorm(5), nn.Linear(5, 3)).double()
    engine = PerExampleEngine(model, loss_reduction="sum", check_independence=False)
    model(torch.randn(6, 5, dtype=torch.float64)).sum().backward()
    with pytest.raises(RuntimeError, match="data-dependent initialisation"):
        engine.per_example_grads()


@pytest.mark.parametrize("mode", ["auto", "vmap"])
def test_hooks_registered_on_a_fallback_module_after_the_engine_match_the_oracle(mode):
    """A pre-hook that changes the input and a forward hook that changes the output, both
    registered after instrumenting: the call is kept as the caller made it (its replay runs
    the pre-hook once) and its backprop is that of the output every hook has made."""
    gen = torch.Generator().manual_seed(13)
    torch.manual_seed(13)
    model = nn.Sequential(nn.Linear(5, 5), Gated(5), nn.Linear(5, 3)).double()
    x = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (6,), generator=gen)
    engine = PerExampleEngine(model, loss_reduction="sum", mode=mode)
    for m in (model, model[1]):
        m.register_forward_pre_hook(lambda module, args: (args[0] * 2 + 1,))
        m.register_forward_hook(lambda module, args, out: out * out.detach().sum(1, True))
    F.cross_entropy(model(x), y, reduction="sum").backward()
    got = engine.per_example_grads()
    engine.detach()
    expected = oracle(model, x, y)
    for n in expected:
        assert close(got[n], expected[n]), n


def test_a_forward_patched_on_the_instance_is_kept():
    """A Linear whose forward was set on the instance (as hooks of other libraries do): the
    layer's rule would bypass the patch, so the layer takes the fallback, which runs it."""
    import types

    gen = torch.Generator().manual_seed(14)
    torch.manual_seed(14)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    model[0].forward = types.MethodType(lambda self, x: 2 * nn.Linear.forward(self, x) + 1,
                                        model[0])
    x = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (6,), generator=gen)
    before = model(x)
    expected = oracle(copy.deepcopy(model), x, y)
    engine = run_engine(model, x, y, "sum")
    assert "Linear(vmap)" in repr(engine)
    got = engine.per_example_grads()
    for n in expected:
        assert close(got[n], expected[n]), n
    engine.detach()
    torch.testing.assert_close(model(x), before)


def test_an_interrupted_fallback_forward_leaves_the_parameters_in_place():
    """The parameters are put back in a finally: a KeyboardInterrupt (not an Exception, so
    no forward hook runs) must not leave the model holding non-leaf tensors."""
    class Interrupted(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Parameter(torch.ones(3))

        def forward(self, x):
            raise KeyboardInterrupt

    model = nn.Sequential(Interrupted())
    engine = PerExampleEngine(model)
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(2, 3))
    engine.detach()
    assert type(model[0].gate) is nn.Parameter and model[0].gate.is_leaf
    assert "_call_impl" not in vars(model[0])


@pytest.mark.parametrize("precision", ["high", "medium"])
def test_ghost_norms_keep_their_bound_under_reduced_matmul_precision(precision):
    """torch.set_float32_matmul_precision lets float32 products round their inputs to
    TensorFloat-32 or bfloat16 (oneDNN on CPUs with bfloat16 units): the Gram matrices are
    formed at full precision all the same. Values just below a bfloat16 rounding midpoint put
    the plain ghost norm 1.5% below the exact one here; a margin from bfloat16's epsilon
    instead made ordinary norms 20 times too large."""
    value = 1 + 0.99 * 2.0 ** -8  # rounds down to 1 in bfloat16
    gen = torch.Generator().manual_seed(4)
    ordinary = torch.randn(2, 16, 256, generator=gen), torch.randn(2, 16, 256, generator=gen)
    module = nn.Linear(256, 256)  # T (d_in + d_out) <= d_in d_out: the ghost norm
    engine = PerExampleEngine(module, loss_reduction="sum")
    before = torch.get_float32_matmul_precision()
    for x, g in [(torch.full((2, 16, 256), value), torch.full((2, 16, 256), value)), ordinary]:
        exact = torch.einsum("bti,bto->bio", x.double(), g.double()).pow(2).sum((1, 2))
        torch.set_float32_matmul_precision(precision)
        try:
            engine.clear()
            (module(x) * g).sum().backward()
            got = engine.sq_norms(["weight"])[:, 0].double()
        finally:
            torch.set_float32_matmul_precision(before)
        assert (got >= exact).all() and (got <= exact * 1.01).all()
        assert torch.get_float32_matmul_precision() == before


class PrecisionOfProducts(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the float32 matmul precision in effect at every matrix product and convolution
    run under it (what lets cuBLAS and oneDNN round their inputs)."""
    PRODUCTS = ("mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "convolution")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0].lstrip("_") in self.PRODUCTS:
            self.seen.append((func.__name__, torch.get_float32_matmul_precision()))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def medium_matmul_precision():
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        yield
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(before)


def assert_all_at_full_precision(products):
    assert products.seen and {precision for _, precision in products.seen} == {"highest"}, \
        products.seen


@pytest.mark.parametrize("prefer", ["memory", "time"])
def test_norms_and_clipped_sums_run_their_products_at_full_precision(prefer):
    """Under torch.set_float32_matmul_precision("high" | "medium") a product may round its
    float32 inputs to TensorFloat-32 or bfloat16, so a clipped sum x^T (c g) would not be the
    sum of the records whose norms were clipped (2^-10 or 2^-7 of the clip more)."""
    model = nn.Sequential(nn.Conv1d(3, 4, 3), nn.Tanh(), nn.Flatten(1), nn.Linear(24, 5))
    seq = nn.Linear(6, 7)  # sequence inputs: T = 5
    engine = PerExampleEngine(nn.ModuleList([model, seq]), loss_reduction="sum", prefer=prefer)
    gen = torch.Generator().manual_seed(0)
    with medium_matmul_precision():
        loss = model(torch.randn(4, 3, 8, generator=gen)).square().sum()
        (loss + seq(torch.randn(4, 5, 6, generator=gen)).square().sum()).backward()
        leaves = list(engine.params)
        with PrecisionOfProducts() as products:
            engine.per_example_grads()
            factors = engine.sq_norms(leaves).sum(1, keepdim=True).rsqrt()
            engine.clipped_sums(factors, {leaf: 0 for leaf in leaves})
    assert_all_at_full_precision(products)


def test_the_backends_core_step_runs_its_products_at_full_precision():
    """TorchBackend.private_gradient (per-example gradients by vmap, then the core's clip and
    sum, a matrix product of factors and gradients) under reduced matmul precision."""
    import dpcore
    backend = dpcore.get_backend("torch")
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(3, 2, generator=gen), torch.randn(4, 3, generator=gen)
    with medium_matmul_precision():
        agg = dpcore.PrivateAggregator(dpcore.flat(["w"], 0.5, 0.0), n=4, q=1.0,
                                       backend=backend, seed=0)
        agg.sample()
        with PrecisionOfProducts() as products:
            backend.private_gradient(lambda p, b: torch.tanh(b @ p["w"]).sum(1), {"w": w}, x,
                                     agg)
    assert_all_at_full_precision(products)


@pytest.mark.parametrize("t, vocab, d", [(64, 9, 32), (4096, 64, 256)])
def test_embedding_norms_stay_within_one_percent_on_ordinary_data(t, vocab, d):
    """The bound on an embedding's per-id row sums grows with each run's length, not the
    sequence's (a margin from the whole length inflated a 4096-long sequence of 64 ids by
    14%)."""
    rng = np.random.default_rng(t)
    ids = torch.from_numpy(rng.integers(0, vocab, size=(2, t)))
    g = torch.from_numpy(rng.normal(size=(2, t, d))).float()
    exact = torch.from_numpy(cancelling.exact_rows_sq_norms(ids.numpy(), g.numpy(), vocab))
    module = nn.Embedding(vocab, d)
    engine = PerExampleEngine(module, loss_reduction="sum")
    (module(ids) * g).sum().backward()
    got = engine.sq_norms(["weight"])[:, 0].double()
    assert (got >= exact * (1 - 1e-6)).all() and (got <= exact * 1.01).all()


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_compiled_fallback_module(when):
    """module.compile() before the engine (its compiled call is wrapped) and after it (the
    compiled wrapper becomes transparent on detach): per-example gradients match the oracle,
    and after detach the module trains as before."""
    gen = torch.Generator().manual_seed(12)
    torch.manual_seed(12)
    model = nn.Sequential(nn.Linear(5, 5), Gated(5), nn.Linear(5, 3))
    x = torch.randn(6, 5, generator=gen)
    y = torch.randint(0, 3, (6,), generator=gen)
    expected = oracle(copy.deepcopy(model).double(), x.double(), y)
    if when == "before":
        model[1].compile(backend="aot_eager")
    engine = PerExampleEngine(model, loss_reduction="sum")
    if when == "after":
        model[1].compile(backend="aot_eager")
    F.cross_entropy(model(x), y, reduction="sum").backward()
    got = engine.per_example_grads()
    for n in expected:
        assert (got[n].double() - expected[n]).abs().max() <= 1e-5 * expected[n].abs().max(), n
    engine.detach()
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    assert model[1].gate.grad is not None
