"""Random draws inside fallback modules (dropout of every kind, attention dropout, stochastic
depth, noise) replayed per example with the draws of the forward pass.

The oracle runs the plain model (no engine) under the same seed, so that it draws the same
masks, and back-propagates one example's loss at a time: example i's gradient of the forward
pass that was taken (float64)."""

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dpcore_torch import PerExampleEngine  # noqa: E402
from dpcore_torch.draws import ReplayMismatchError  # noqa: E402
from dpcore_torch.fallback import FallbackUnit  # noqa: E402

SEED = 5


class Dropouts(nn.Module):
    """A custom module (its own parameter: a fallback unit) drawing with every kind of
    random operation dpcore keeps."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 8))
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.drop(torch.tanh(x @ self.w))                        # element dropout
        h = F.dropout1d(h.unflatten(1, (4, 2)), 0.25).flatten(1)     # channel dropout
        h = F.dropout2d(h.view(-1, 2, 2, 2), 0.2).flatten(1)         # channel dropout, 2-D
        h = F.alpha_dropout(h, 0.1, training=True)                   # SELU's dropout
        h = F.feature_alpha_dropout(h.view(-1, 4, 2), 0.2, training=True).flatten(1)
        h = torch.dropout_(h * 1.0, 0.1, True)                       # in place, torch level
        keep = x.new_empty((x.shape[0], 1)).bernoulli_(0.8)          # stochastic depth
        noise = torch.empty((x.shape[0], 1), dtype=x.dtype)          # torchvision's form
        noise = noise.bernoulli_(0.9) / 0.9
        h = h * keep * noise + 0.01 * torch.randn_like(h) + 0.01 * torch.rand(x.shape[0], 1,
                                                                             dtype=x.dtype)
        w = F.dropout(self.w, 0.2)                                   # shared by the batch
        return self.head(h + torch.tanh(x @ w))


class ViT(nn.Module):
    """A ViT-style model: class token and position embedding are bare parameters of the
    model, so the whole model is one fallback unit, replayed with its encoder's dropout."""

    def __init__(self, d=16, patches=5):
        super().__init__()
        self.patch = nn.Linear(8, d)
        self.cls = nn.Parameter(torch.randn(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, patches + 1, d))
        self.drop = nn.Dropout(0.1)
        layer = nn.TransformerEncoderLayer(d, 2, 32, batch_first=True)  # dropout 0.1
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = self.patch(x)
        h = torch.cat([self.cls.expand(h.shape[0], -1, -1), h], 1) + self.pos
        return self.head(self.encoder(self.drop(h))[:, 0])


class Attention(nn.Module):
    """A module of its own parameter around attention layers with dropout: one calling
    ``MultiheadAttention`` for its weights (PyTorch's plain forward in the replay), one with
    ``add_bias_kv`` (a fallback unit inside the fallback unit), and a hand-written
    ``scaled_dot_product_attention`` with dropout."""

    def __init__(self, d=8):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.attn = nn.MultiheadAttention(d, 2, dropout=0.2, batch_first=True)
        self.biased = nn.MultiheadAttention(d, 2, dropout=0.3, batch_first=True,
                                            add_bias_kv=True)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h, w = self.attn(x * self.scale, x, x)
        g, _ = self.biased(h, h, h, need_weights=False)
        q = g.unflatten(-1, (2, 4)).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, q, q, dropout_p=0.25, is_causal=True)
        return self.head(o.transpose(1, 2).flatten(2).mean(1)) + w.sum((1, 2)).unsqueeze(1)


class Recurrent(nn.Module):
    """A module of its own parameter around an LSTM (whose hidden states, unused, have the
    examples on axis 1, not 0), with dropout on its output sequence: followed to the end, the
    call needs no replay (which the LSTM's fused kernel could not run, so not in mode
    "vmap")."""

    def __init__(self, d=8):
        super().__init__()
        self.token = nn.Parameter(torch.randn(1, 1, d))
        self.lstm = nn.LSTM(d, d, num_layers=2, batch_first=True)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        out, _ = self.lstm(torch.cat([self.token.expand(x.shape[0], -1, -1), x], 1))
        return self.head(F.dropout(out, 0.3).mean(1))


MODELS = {"dropouts": (Dropouts, (6,)), "vit": (ViT, (5, 8)), "attention": (Attention, (5, 8)),
          "recurrent": (Recurrent, (5, 8))}


def oracle(model, x):
    """Per-example gradients of loss_i = ||model(x)_i||^2 under the same seed as the engine's
    forward pass, one backward pass per example."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(x.shape[0]):
        torch.manual_seed(SEED)
        rows.append(torch.autograd.grad((model(x)[i] ** 2).sum(), params, allow_unused=True))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return {n: torch.stack([torch.zeros_like(p) if r[k] is None else r[k] for r in rows])
            for k, (n, p) in enumerate(zip(names, params))}


@pytest.mark.parametrize("name, mode", [(name, mode) for name in sorted(MODELS)
                                        for mode in ("auto", "vmap")
                                        if (name, mode) != ("recurrent", "vmap")])
@pytest.mark.parametrize("batch", [1, 6])
def test_draws_of_the_forward_pass_are_replayed_per_example(name, mode, batch):
    torch.manual_seed(0)
    build, shape = MODELS[name]
    model = build().double().train()
    x = torch.randn(batch, *shape, dtype=torch.float64)
    torch.manual_seed(SEED)
    plain = model(x)
    engine = PerExampleEngine(model, loss_reduction="sum", mode=mode)
    torch.manual_seed(SEED)
    out = model(x)
    (out ** 2).sum().backward()
    got = engine.per_example_grads()
    engine.detach()
    # the same draws as PyTorch's own forward pass (the recurrent rule's matrix products may
    # round otherwise than the fused kernel: on some CPUs, by an ulp; a mask would differ by
    # whole values)
    assert torch.equal(out == 0, plain == 0)
    assert torch.allclose(out, plain, rtol=1e-12, atol=1e-15)
    expected = oracle(model, x)
    for n, e in expected.items():
        assert torch.allclose(got[n], e, rtol=1e-9, atol=1e-12), n


class Drawing(nn.Module):
    """A module of its own parameter drawing in ways the replay must refuse, or get right."""

    def __init__(self, form):
        super().__init__()
        self.form = form
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        h = x @ self.w
        if self.form == "flattened":  # the batch folded into a draw's axis
            return h * torch.rand(x.shape[0] * 4).view(-1, 4)
        if self.form == "more":  # the number of draws depends on the batch
            for _ in range(x.shape[0]):
                h = F.dropout(h, 0.5)
            return h
        if self.form == "ignored":  # an in-place draw whose result is not used
            noise = torch.empty((x.shape[0], 1))
            noise.bernoulli_(0.5)
            return h * noise
        if self.form == "sorted":  # a draw on the sorted batch: its row i is not example i's
            order = h[:, 0].argsort()
            return F.dropout(h[order], 0.5)[order.argsort()]
        if self.form == "time-major":  # (T, B, D) with T == B
            t = h.view(-1, 2, 2).transpose(0, 1)
            return F.dropout(t, 0.5).transpose(0, 1).flatten(1)
        if self.form == "noise then sort":  # drawn in order, used on the sorted batch
            noise = torch.rand(x.shape[0], 1)
            order = h[:, 0].argsort()
            return (h[order] * noise)[order.argsort()]
        if self.form == "changed in place":  # a kept draw the caller changes afterwards
            noise = torch.randn(x.shape[0], 4)
            noise.mul_(0.5).add_(1.0)
            return h * noise
        return h * torch.randint(0, 2, h.shape)  # a random operation dpcore does not keep


@pytest.mark.parametrize("form", ["flattened", "more"])
def test_draws_the_replay_cannot_match_are_refused(form):
    model = Drawing(form)
    engine = PerExampleEngine(model, loss_reduction="sum")
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(ReplayMismatchError, match="Drawing"):
        engine.per_example_grads()


def test_an_in_place_draw_whose_result_is_ignored_is_refused():
    """The replay cannot fill a tensor made apart from the batch per example, and hands
    the draw on as the call's result: a later use of the tensor itself is refused."""
    model = Drawing("ignored")
    engine = PerExampleEngine(model, loss_reduction="sum")
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(ReplayMismatchError, match="uses a tensor after drawing into it"):
        engine.per_example_grads()


@pytest.mark.parametrize("form", ["sorted", "time-major", "noise then sort"])
def test_draws_whose_rows_may_not_be_the_examples_are_refused(form):
    torch.manual_seed(4)
    model = Drawing(form)
    engine = PerExampleEngine(model, loss_reduction="sum")
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(ReplayMismatchError, match="cannot tell"):
        engine.per_example_grads()


def test_a_kept_draw_changed_in_place_by_the_forward_is_replayed_as_drawn():
    torch.manual_seed(5)
    model = Drawing("changed in place").double()
    x = torch.randn(5, 4, dtype=torch.float64)
    engine = PerExampleEngine(model, loss_reduction="sum")
    torch.manual_seed(SEED)
    (model(x) ** 2).sum().backward()
    got = engine.per_example_grads()
    engine.detach()
    assert torch.allclose(got["w"], oracle(model, x)["w"], rtol=1e-10)


def test_attention_dropout_follows_pytorchs_rules():
    """A query row masked everywhere gives zeros, as ATen's kernel does (not NaN), and an
    explicit mask with is_causal=True is refused, as by PyTorch."""
    torch.manual_seed(6)
    q = torch.randn(2, 2, 3, 4)
    mask = torch.ones(3, 3, dtype=torch.bool)
    mask[1] = False

    class Attend(nn.Module):
        def __init__(self, causal_and_mask=False):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))
            self.causal_and_mask = causal_and_mask

        def forward(self, x):
            return F.scaled_dot_product_attention(x * self.scale, x, x, mask, 0.3,
                                                  is_causal=self.causal_and_mask)

    torch.manual_seed(SEED)
    plain = Attend()(q)
    model = Attend()
    PerExampleEngine(model)
    torch.manual_seed(SEED)
    out = model(q)
    assert not out.isnan().any() and torch.allclose(out, plain)
    model = Attend(causal_and_mask=True)
    PerExampleEngine(model)
    with pytest.raises(RuntimeError, match="attn_mask should not be set when is_causal"):
        model(q)


def test_a_random_operation_dpcore_does_not_keep_is_refused_with_the_list():
    model = Drawing("other")
    engine = PerExampleEngine(model, loss_reduction="sum")
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="dropout, attention dropout, rand"):
        engine.per_example_grads()


def test_dropout_in_evaluation_mode_or_of_probability_zero_draws_nothing():
    model = Dropouts().double()
    model.drop.p = 0.0
    model.eval()  # F.dropout(..., training=True) calls still draw: they ignore the mode
    engine = PerExampleEngine(model, loss_reduction="sum")
    model(torch.randn(2, 6, dtype=torch.float64)).sum().backward()
    (unit,) = [u for u in engine.units if isinstance(u, FallbackUnit)]
    (call,) = unit.calls
    assert len(call.draws) == 10  # dropout1d/2d, alpha, feature alpha, dropout_, 4 values, w
