"""The three benchmark workloads of issue 4, built only from layers that both dpcore and Opacus
support per example (Conv2d, Linear, Embedding, LayerNorm), so every mode runs the same model.

(a) MNIST CNN of Yu, Zhang & Chen: conv 1->10 5x5, max-pool 2, conv 10->20 5x5, max-pool 2,
    fc 320->50, fc 50->10 (ReLU), batch 256 of 28x28 random images;
(b) covertype MLP 54-100-100-7 with tanh, batch 512;
(c) a transformer encoder: token embedding 10,000 x 128 and learned positions, 2 pre-norm
    blocks (4 heads, feed-forward 512, attention by scaled_dot_product_attention over Linear
    projections), mean pooling, 2 classes; sequence 64, batch 32;
(d) an LSTM text classifier (not in issue 4): token embedding 2,000 x 64, one LSTM layer of
    128 units (``batch_first``), the last state to 2 classes; sequence 32, batch 64. Opacus
    runs it with its ``DPLSTM`` (the same parameters; ``ModuleValidator.fix`` swaps it in);
(e) a CIFAR-10-sized CNN of 3x3 convolutions (not in issue 4): conv 3->32, conv 32->32,
    max-pool 2, conv 32->64, max-pool 2, fc 4096->10 (ReLU, padding 1), batch 64 of 32x32
    random RGB images;
(f) the transformer (c) as PyTorch users write it (not in issue 4): the same embeddings and
    sizes, 2 ``nn.TransformerEncoderLayer`` (post-norm, ReLU, dropout 0.1) in an
    ``nn.TransformerEncoder``. Opacus runs it with its ``DPMultiheadAttention``
    (``ModuleValidator.fix`` swaps it in);
(g) a ViT-style image classifier (not in issue 4): 32x32 RGB images cut into 64 patches of
    4x4, a Linear patch embedding 48 -> 128, a class token and a position embedding held as
    bare ``nn.Parameter`` s of the model (as timm and most ViT code hold them), the encoder
    of (f), the class token's output to 10 classes; batch 32. dpcore forms the two
    parameters' gradients from their broadcasting uses (``dpcore_torch.taps``);
(h) a GPT-2-style model (not in issue 4): (c) with causal attention and every projection a
    Hugging Face ``Conv1D`` (``x @ weight + bias``, weight (in, out)) instead of ``nn.Linear``.
    dpcore registers the class (``dpcore_torch.register_linear(Conv1D, transposed=True)``);
    mode ``dpcore-replay`` leaves it to the per-layer ``torch.func`` replay.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MnistCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, 5)
        self.conv2 = nn.Conv2d(10, 20, 5)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def covertype_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(54, 100), nn.Tanh(), nn.Linear(100, 100), nn.Tanh(),
                         nn.Linear(100, 7))


class Conv1D(nn.Module):
    """Hugging Face's GPT-2 projection (``transformers.pytorch_utils.Conv1D``, written out so
    the benchmarks need no transformers): x @ weight + bias on the flattened positions, with
    ``weight`` of shape (in, out)."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


class ReplayedConv1D(Conv1D):
    """The same layer under a class that is not registered with dpcore (mode dpcore-replay)."""


def _conv1d(d_in: int, d_out: int) -> Conv1D:
    return Conv1D(d_out, d_in)


def _replayed_conv1d(d_in: int, d_out: int) -> Conv1D:
    return ReplayedConv1D(d_out, d_in)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, ff: int, linear=nn.Linear, causal: bool = False):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = linear(d, 3 * d), linear(d, d)
        self.ff1, self.ff2 = linear(d, ff), linear(ff, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=self.causal)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.ff2(F.gelu(self.ff1(self.norm2(x))))


class Encoder(nn.Module):
    def __init__(self, vocab=10_000, d=128, layers=2, heads=4, ff=512, seq=64, classes=2,
                 linear=nn.Linear, causal=False):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*[Block(d, heads, ff, linear, causal)
                                      for _ in range(layers)])
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, k):
        pos = torch.arange(k.shape[1], device=k.device).repeat(k.shape[0], 1)
        h = self.blocks(self.tokens(k) + self.positions(pos))
        return self.head(self.norm(h).mean(1))


class TorchEncoder(nn.Module):
    def __init__(self, vocab=10_000, d=128, layers=2, heads=4, ff=512, seq=64, classes=2):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        layer = nn.TransformerEncoderLayer(d, heads, ff, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, k):
        pos = torch.arange(k.shape[1], device=k.device).repeat(k.shape[0], 1)
        return self.head(self.encoder(self.tokens(k) + self.positions(pos)).mean(1))


class ViT(nn.Module):
    def __init__(self, patch=4, side=32, d=128, layers=2, heads=4, ff=512, classes=10):
        super().__init__()
        self.patch, n = patch, (side // patch) ** 2
        self.embed = nn.Linear(3 * patch * patch, d)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embed = nn.Parameter(torch.randn(1, n + 1, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, ff, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, images):
        p = self.patch
        x = images.unfold(2, p, p).unfold(3, p, p)  # (B, 3, H/p, W/p, p, p)
        x = self.embed(x.permute(0, 2, 3, 1, 4, 5).flatten(3).flatten(1, 2))
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1) + self.pos_embed
        return self.head(self.encoder(x)[:, 0])


class LSTMClassifier(nn.Module):
    def __init__(self, vocab=2_000, d=64, hidden=128, classes=2):
        super().__init__()
        self.tokens = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, k):
        h_n = self.lstm(self.tokens(k))[1][0]
        return self.head(h_n[-1])


def cifar_cnn(norm=None) -> nn.Module:
    """Three 3x3 convolutions (32, 32, 64 channels), each followed by ``norm(channels)``
    if given (BatchNorm2d: "cifar-bn"), and a linear head."""
    def conv(c_in, c_out):
        layers = [nn.Conv2d(c_in, c_out, 3, padding=1)]
        return layers + ([norm(c_out)] if norm is not None else []) + [nn.ReLU()]

    return nn.Sequential(*conv(3, 32), *conv(32, 32), nn.MaxPool2d(2), *conv(32, 64),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 8 * 8, 10))


def workload(name: str, seed: int = 0, *, replayed: bool = False):
    """(model, inputs, targets) of one of "cnn", "mlp", "transformer", "encoder", "lstm",
    "cifar", "cifar-bn", "vit", "gpt2" (``replayed``: its Conv1D under a class dpcore does
    not know)."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if name == "cnn":
        return MnistCNN(), torch.randn(256, 1, 28, 28, generator=gen), \
            torch.randint(0, 10, (256,), generator=gen)
    if name == "mlp":
        return covertype_mlp(), torch.randn(512, 54, generator=gen), \
            torch.randint(0, 7, (512,), generator=gen)
    if name == "transformer":
        return Encoder(), torch.randint(0, 10_000, (32, 64), generator=gen), \
            torch.randint(0, 2, (32,), generator=gen)
    if name == "encoder":
        return TorchEncoder(), torch.randint(0, 10_000, (32, 64), generator=gen), \
            torch.randint(0, 2, (32,), generator=gen)
    if name == "lstm":
        return LSTMClassifier(), torch.randint(0, 2_000, (64, 32), generator=gen), \
            torch.randint(0, 2, (64,), generator=gen)
    if name in ("cifar", "cifar-bn"):
        return cifar_cnn(nn.BatchNorm2d if name == "cifar-bn" else None), \
            torch.randn(64, 3, 32, 32, generator=gen), torch.randint(0, 10, (64,), generator=gen)
    if name == "vit":
        return ViT(), torch.randn(32, 3, 32, 32, generator=gen), \
            torch.randint(0, 10, (32,), generator=gen)
    if name == "gpt2":
        return Encoder(linear=_replayed_conv1d if replayed else _conv1d, causal=True), \
            torch.randint(0, 10_000, (32, 64), generator=gen), \
            torch.randint(0, 2, (32,), generator=gen)
    raise ValueError(f"workload must be cnn, mlp, transformer, encoder, lstm, cifar, cifar-bn, "
                     f"vit or gpt2, got {name!r}")
