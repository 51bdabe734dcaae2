"""A lower bound for a private MLP step in eager PyTorch: the covertype MLP (b) of
:mod:`torch_models` trained by a hand-written DP step with no library around it, timed against
the non-private step in the same process (blocks of consecutive steps interleaved, as in
``torch_step.py``; medians).

The hand-written step does only what any ghost-norm DP step must, in as few eager operations as
we found: a forward pass whose Linear layers keep their inputs a and, by a small autograd
function, their output gradients g (no weight gradients formed), per-example squared norms
||g_i||^2 (||a_i||^2 + 1) of every Linear layer, clip factors with the division by q n folded in,
one noise draw scaled once, the clipped sums (w g)^T a and w^T g added into the noise in place,
and the optimizer step. What it leaves out (ledger, groups, validation, non-finite checks,
layer rules for any model) is the library's cost, so dpcore's ratio minus this one is dpcore's
overhead: on this sub-millisecond step mostly the Python calls a general library makes.
``--compiled`` also times the step with its tail (norms, factors, clipped sums, noise scaling)
compiled by ``torch.compile`` (the forward and backward stay eager).

    python benchmarks/torch_floor.py [--rounds 20] [--block 100] [--compiled]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rounds import one_round  # noqa: E402
from torch_models import workload  # noqa: E402


class _Tapped(torch.autograd.Function):
    """``x W^T + b`` whose backward keeps the backprop g (appended to ``kept``) and returns
    only the input's gradient: autograd forms no summed weight gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, kept):
        ctx.save_for_backward(weight)
        ctx.kept = kept
        return torch.addmm(bias, x, weight.t())

    @staticmethod
    def backward(ctx, g):
        ctx.kept.append(g)
        return (g.mm(ctx.saved_tensors[0]) if ctx.needs_input_grad[0] else None), None, None, None


def clipped_noisy_grads(inputs, backprops, noise, clip: float, std: float, expected_size: float):
    """The DP tail from the kept inputs a and backprops g of the Linear layers (mean loss, so
    g carries 1/B), in as few eager operations as we found: squared norms
    s_i = sum over layers of ||g_i||^2 (||a_i||^2 + 1) (per-example norm B sqrt(s_i)), weights
    w_i = min(1, S / (B sqrt(s_i))) B / (q n) = min(B, S / sqrt(s_i)) / (q n), which fold the
    clip factor and the division by q n into one vector, then the clipped sums (w g)^T a and
    w^T g added in place into the noise ``noise`` (a standard normal draw, scaled once by
    std / (q n)); one (weight, bias) pair per layer."""
    batch = inputs[0].shape[0]
    sq = None
    for a, g in zip(inputs, backprops):
        g_sq = torch.linalg.vecdot(g, g)
        s = torch.addcmul(g_sq, g_sq, torch.linalg.vecdot(a, a))
        sq = s if sq is None else sq.add_(s)
    w = sq.mul_((expected_size / clip) ** 2).rsqrt_().clamp_(max=batch / expected_size)
    shapes = [(g.shape[1], a.shape[1]) for a, g in zip(inputs, backprops)]
    sizes = [n for rows, cols in shapes for n in (rows * cols, rows)]
    pieces = noise.mul_(std / expected_size).split(sizes)
    grads = []
    for k, (a, g) in enumerate(zip(inputs, backprops)):
        weight = pieces[2 * k].view(shapes[k]).addmm_((g * w[:, None]).t(), a)
        grads.append((weight, pieces[2 * k + 1].addmv_(g.t(), w)))
    return grads


def hand_written_dp_step(model, x, y, optimizer, generator, tail=clipped_noisy_grads, clip=1.0,
                         noise_multiplier=1.0):
    """One DP step with q n = B (the batch is the expected sample)."""
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs, kept = [], []
    h = x
    for i, layer in enumerate(layers):
        inputs.append(h)
        h = _Tapped.apply(h, layer.weight, layer.bias, kept)
        h = torch.tanh(h) if i < len(layers) - 1 else h
    F.cross_entropy(h, y).backward()
    size = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        noise = torch.randn(size, generator=generator)
        grads = tail([a.detach() for a in inputs], kept[::-1], noise, clip,
                     noise_multiplier * clip, float(len(x)))
    for layer, (weight, bias) in zip(layers, grads):
        layer.weight.grad, layer.bias.grad = weight, bias
    optimizer.step()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--block", type=int, default=100,
                        help="consecutive steps of each kind per round (the first untimed)")
    parser.add_argument("--compiled", action="store_true",
                        help="also time the step with its tail compiled by torch.compile "
                             "(inductor; needs a C++ compiler)")
    args = parser.parse_args(argv)
    model, x, y = workload("mlp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(0)

    def non_private():
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    steps = {"non-private": non_private,
             "hand-written DP": lambda: hand_written_dp_step(model, x, y, optimizer, generator)}
    if args.compiled:
        tail = torch.compile(clipped_noisy_grads, dynamic=False)
        steps["tail compiled"] = lambda: hand_written_dp_step(model, x, y, optimizer, generator,
                                                              tail=tail)
    for step in steps.values():
        for _ in range(50):
            step()
    times = {name: [] for name in steps}
    for _ in range(args.rounds):
        one_round(steps, args.block - 1, times)
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, covertype MLP B={len(x)}")
    for name, ms in med.items():
        print(f"  {name:<16} {ms:7.3f} ms  {ms / med['non-private']:.2f}x")


if __name__ == "__main__":
    main()
