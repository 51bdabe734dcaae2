"""nn.MultiheadAttention through its Linear maps: the layer's outputs as PyTorch computes them,
per-example gradients against a float64 one-example-at-a-time oracle for every form of call
(self- and cross-attention, separate key and value sizes, masks, attention weights), and
dropout in training mode."""

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dpcore_torch import PerExampleEngine  # noqa: E402

E, H, T, S = 8, 2, 5, 4


class Attend(nn.Module):
    """An attention layer called in one of several ways, then a linear head."""

    def __init__(self, form, **options):
        super().__init__()
        self.form = form
        self.attn = nn.MultiheadAttention(E, H, batch_first=True, **options)
        self.memory = nn.Linear(E, options.get("kdim") or E)
        self.head = nn.Linear(E, 3)

    def forward(self, x, padding=None, mask=None):
        m = self.memory(x[:, :S])
        if self.form == "self":
            out, w = self.attn(x, x, x, key_padding_mask=padding, attn_mask=mask)
        elif self.form == "causal":
            out, _ = self.attn(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)
        elif self.form == "cross":  # key is value
            out, w = self.attn(x, m, m, key_padding_mask=padding, need_weights=False)
        elif self.form == "distinct":  # query, key and value three tensors, by keyword
            out, w = self.attn(query=x, key=m, value=torch.tanh(m), key_padding_mask=padding,
                               average_attn_weights=False)
        if self.form in ("self", "distinct"):  # the weights feed the loss too
            out = out + w.flatten(1)[:, :1, None]
        return self.head(out.mean(1))


FORMS = {
    "self": ({}, "padding"),
    "self-3d-float-mask": ({}, "mask3d"),
    "self-no-bias": ({"bias": False}, None),
    "causal": ({}, "causal"),
    "cross": ({}, "padding"),
    "distinct": ({}, "padding"),
    "kdim-vdim": ({"kdim": 6, "vdim": 6}, None),
}


def batch(name, size, gen):
    x = torch.randn(size, T, E, generator=gen, dtype=torch.float64)
    kind = FORMS[name][1]
    kwargs = {}
    if kind == "padding":
        keys = T if name.startswith("self") else S
        padding = torch.zeros(size, keys, dtype=torch.bool)
        padding[:, -1] = torch.arange(size) % 2 == 0  # some examples pad their last key
        kwargs["padding"] = padding
    elif kind == "mask3d":
        kwargs["mask"] = torch.randn(size * H, T, T, generator=gen, dtype=torch.float64)
    elif kind == "causal":
        kwargs["mask"] = nn.Transformer.generate_square_subsequent_mask(T, dtype=torch.float64)
    return x, torch.randint(0, 3, (size,), generator=gen), kwargs


def example(kwargs, i):
    """Example i's keyword arguments: its row of the padding, its H slices of a 3-D mask."""
    out = dict(kwargs)
    if "padding" in out:
        out["padding"] = out["padding"][i:i + 1]
    if "mask" in out and out["mask"].dim() == 3:
        out["mask"] = out["mask"][i * H:(i + 1) * H]
    return out


def build(name):
    torch.manual_seed(3)
    options, _ = FORMS[name]
    form = name.split("-")[0] if name != "kdim-vdim" else "distinct"
    return Attend(form, **options).double().eval()


def oracle(model, x, y, kwargs):
    out = {n: [] for n, p in model.named_parameters()}
    for i in range(x.shape[0]):
        model.zero_grad()
        F.cross_entropy(model(x[i:i + 1], **example(kwargs, i)), y[i:i + 1],
                        reduction="sum").backward()
        for n, p in model.named_parameters():
            out[n].append(torch.zeros_like(p) if p.grad is None else p.grad.clone())
    return {n: torch.stack(g) if g else p.new_zeros((0, *p.shape))
            for (n, g), p in zip(out.items(), model.parameters())}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("size", [0, 1, 5])
@pytest.mark.parametrize("name", sorted(FORMS))
def test_per_example_grads_match_the_oracle(name, size, reduction):
    gen = torch.Generator().manual_seed(4)
    x, y, kwargs = batch(name, size, gen)
    model = build(name)
    plain = copy.deepcopy(model)
    expected = oracle(plain, x, y, kwargs)
    engine = PerExampleEngine(model, loss_reduction=reduction)
    assert "MultiheadAttention" in repr(engine) and "(vmap)" not in repr(engine)
    out = model(x, **kwargs)
    if size:  # the layer's output as PyTorch computes it
        torch.testing.assert_close(out, plain(x, **kwargs), rtol=1e-12, atol=1e-12)
    F.cross_entropy(out, y, reduction=reduction).backward()
    got = engine.per_example_grads()
    norms = engine.sq_norms(list(expected))
    for j, n in enumerate(expected):
        torch.testing.assert_close(got[n], expected[n], rtol=1e-9, atol=1e-12, msg=n)
        torch.testing.assert_close(norms[:, j], expected[n].flatten(1).pow(2).sum(1),
                                   rtol=1e-9, atol=1e-12, msg=n)
    factors = torch.rand(size, 1, generator=gen, dtype=torch.float64)
    sums = engine.clipped_sums(factors, dict.fromkeys(expected, 0))
    for n in expected:
        torch.testing.assert_close(sums[n], torch.einsum("i,i...->...", factors[:, 0],
                                                          expected[n]), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("need_weights", [False, True])
def test_dropout_in_training_mode(need_weights):
    """The forward pass draws the same dropout masks as PyTorch's own layer (same seed, same
    output), and the per-example gradients add up to the batch's gradient."""
    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(5)
    model = nn.Sequential(nn.TransformerEncoderLayer(E, H, 16, batch_first=True),
                          nn.Flatten(), nn.Linear(T * E, 3)).double()
    plain = copy.deepcopy(model)
    if need_weights:  # the layer asks for the attention weights (dropout applies to them)
        for layer in (model[0], plain[0]):
            layer._sa_block = lambda x, mask, padding, is_causal=False, layer=layer: (
                layer.dropout1(layer.self_attn(x, x, x, attn_mask=mask,
                                               key_padding_mask=padding,
                                               need_weights=True)[0]))
    x = torch.randn(6, T, E, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (6,), generator=gen)
    engine = PerExampleEngine(model, loss_reduction="sum")
    torch.manual_seed(6)
    out = model(x)
    torch.manual_seed(6)
    plain_out = plain(x)
    torch.testing.assert_close(out, plain_out, rtol=1e-12, atol=1e-12)
    F.cross_entropy(out, y, reduction="sum").backward()
    F.cross_entropy(plain_out, y, reduction="sum").backward()
    for n, g in engine.per_example_grads().items():
        torch.testing.assert_close(g.sum(0), plain.get_parameter(n).grad, rtol=1e-9,
                                   atol=1e-12, msg=n)


def test_extra_key_and_value_biases_take_the_fallback():
    model = nn.Sequential(nn.MultiheadAttention(E, H, batch_first=True, add_bias_kv=True))
    assert "MultiheadAttention(vmap)" in repr(PerExampleEngine(model))


def test_a_projection_tied_within_the_layer_adds_its_uses():
    """Shared query and key projections (k_proj_weight = q_proj_weight): the two maps use the
    same rows, so their gradients add before the norm is taken."""
    gen = torch.Generator().manual_seed(7)
    torch.manual_seed(7)
    attn = nn.MultiheadAttention(E, H, batch_first=True, kdim=E, vdim=6).double()
    attn.k_proj_weight = attn.q_proj_weight
    plain = copy.deepcopy(attn)
    x = torch.randn(4, T, E, generator=gen, dtype=torch.float64)
    v = torch.randn(4, T, 6, generator=gen, dtype=torch.float64)
    expected = {n: [] for n, _ in plain.named_parameters()}
    for i in range(4):
        plain.zero_grad()
        plain(x[i:i + 1], x[i:i + 1], v[i:i + 1])[0].pow(2).sum().backward()
        for n, p in plain.named_parameters():
            expected[n].append(p.grad.clone())
    engine = PerExampleEngine(attn, loss_reduction="sum")
    attn(x, x, v)[0].pow(2).sum().backward()
    got, norms = engine.per_example_grads(), engine.sq_norms(list(expected))
    c = torch.rand(4, 1, generator=gen, dtype=torch.float64)
    sums = engine.clipped_sums(c, dict.fromkeys(expected, 0))
    for j, (n, rows) in enumerate(expected.items()):
        rows = torch.stack(rows)
        torch.testing.assert_close(got[n], rows, rtol=1e-9, atol=1e-12, msg=n)
        torch.testing.assert_close(norms[:, j], rows.flatten(1).pow(2).sum(1), rtol=1e-9,
                                   atol=1e-12, msg=n)
        torch.testing.assert_close(sums[n], torch.einsum("i,i...->...", c[:, 0], rows),
                                   rtol=1e-9, atol=1e-12, msg=n)
