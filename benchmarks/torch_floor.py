"""A lower bound for a private MLP step in eager PyTorch: the covertype MLP (b) of
:mod:`torch_models` trained by a hand-written DP step with no library around it, timed against
the non-private step in the same process (steps interleaved, medians).

The hand-written step does only what any ghost-norm DP step must, in as few eager operations as
it can: a forward pass with the activations kept, one backward pass for the output gradients g
(no weight gradients), per-example squared norms ||g_i||^2 (||a_i||^2 + 1) of every Linear layer,
flat clip factors, the clipped sums (c g)^T a and c^T g, one noise draw, the division by B and the
optimizer step. What it leaves out (ledger, groups, validation, non-finite checks, layer rules
for any model) is the library's cost, so dpcore's ratio minus this one is dpcore's overhead: on
this sub-2-ms step mostly the Python calls a general library makes. ``--compiled`` also times the
step with its tail (norms, factors, clipped sums, noise) compiled by ``torch.compile`` into fused
kernels (the forward and backward stay eager). "reused buffer" draws every step's noise into
one buffer allocated once, so the gradients live in the same (cache-warm) memory each step,
as a hand-written loop can arrange and a library that returns new arrays cannot.

    python benchmarks/torch_floor.py [--rounds 2000] [--compiled]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_models import workload  # noqa: E402


def clipped_noisy_grads(inputs, backprops, noise, clip: float, std: float):
    """The DP tail from the kept inputs a and backprops g of the Linear layers (mean loss, so
    g carries 1/B), in as few operations as eager PyTorch allows: squared norms
    ||g_i||^2 (||a_i||^2 + 1) of each layer's (weight, bias), flat clip factors times B
    (B min(1, S / (B ||.||)) = min(B, S / ||.||)), the clipped sums (c g)^T a and c^T g, then
    noise, sums and the division by B on one flat vector; one (weight, bias) pair per layer."""
    batch = inputs[0].shape[0]
    sq = []
    for a, g in zip(inputs, backprops):
        g_sq = torch.linalg.vecdot(g, g)
        sq.append(torch.addcmul(g_sq, g_sq, torch.linalg.vecdot(a, a)))
    factors = torch.rsqrt(torch.stack(sq).sum(0).div_(clip * clip)).clamp_(max=batch)
    sums = []
    for a, g in zip(inputs, backprops):
        g = g * factors[:, None]
        sums += [g.t().mm(a), g.sum(0)]
    flat = noise.mul_(std).add_(torch.cat([t.view(-1) for t in sums])).div_(batch)
    grads = [piece.view_as(t) for piece, t in zip(flat.split([t.numel() for t in sums]), sums)]
    return list(zip(grads[::2], grads[1::2]))


def hand_written_dp_step(model, x, y, optimizer, generator, tail=clipped_noisy_grads, clip=1.0,
                         noise_multiplier=1.0, noise_buffer=None):
    """One DP step; ``noise_buffer`` (a flat tensor of the model's size), if given, receives
    every step's noise draw and so becomes the gradients' memory, step after step."""
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs, outputs = [], []
    h = x
    for i, layer in enumerate(layers):
        inputs.append(h)
        z = F.linear(h, layer.weight.detach(), layer.bias.detach()).requires_grad_()
        z.retain_grad()
        outputs.append(z)
        h = torch.tanh(z) if i < len(layers) - 1 else z
    F.cross_entropy(h, y).backward()
    size = sum(p.numel() for p in model.parameters())
    noise = torch.randn(size, generator=generator, out=noise_buffer)
    grads = tail([a.detach() for a in inputs], [z.grad for z in outputs], noise, clip,
                 noise_multiplier * clip)
    for layer, (weight, bias) in zip(layers, grads):
        layer.weight.grad, layer.bias.grad = weight, bias
    optimizer.step()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2000)
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

    buffer = torch.empty(sum(p.numel() for p in model.parameters()))
    steps = {"non-private": non_private,
             "hand-written DP": lambda: hand_written_dp_step(model, x, y, optimizer, generator),
             "reused buffer": lambda: hand_written_dp_step(model, x, y, optimizer, generator,
                                                           noise_buffer=buffer)}
    if args.compiled:
        tail = torch.compile(clipped_noisy_grads, dynamic=False)
        steps["tail compiled"] = lambda: hand_written_dp_step(model, x, y, optimizer, generator,
                                                              tail=tail)
    for step in steps.values():
        for _ in range(50):
            step()
    times = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, covertype MLP B={len(x)}")
    for name, ms in med.items():
        print(f"  {name:<16} {ms:7.3f} ms  {ms / med['non-private']:.2f}x")


if __name__ == "__main__":
    main()
