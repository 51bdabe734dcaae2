"""A lower bound for a private MLP step in eager PyTorch: the covertype MLP (b) of
:mod:`torch_models` trained by a hand-written DP step with no library around it, timed against
the non-private step in the same process (steps interleaved, medians).

The hand-written step does only what any ghost-norm DP step must: a forward pass with the
activations kept, one backward pass for the output gradients g (no weight gradients), per-example
norms ||a_i||^2 ||g_i||^2 of every Linear weight and ||g_i||^2 of its bias, flat clip factors,
the clipped sums (c g)^T a and c^T g, one noise draw, the division by B and the optimizer step.
What it leaves out (ledger, groups, validation, non-finite checks) is the library's cost, so
dpcore's ratio minus this one is dpcore's overhead, and a goal below this ratio needs fused or
compiled kernels rather than fewer Python lines.

    python benchmarks/torch_floor.py [--rounds 2000]
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


def hand_written_dp_step(model, x, y, optimizer, generator, clip=1.0, noise_multiplier=1.0):
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
    batch = x.shape[0]
    columns = []
    for a, z in zip(inputs, outputs):
        g_sq = torch.linalg.vector_norm(z.grad, dim=1).square_()
        columns += [torch.linalg.vector_norm(a, dim=1).square_().mul_(g_sq), g_sq]
    norms = torch.stack(columns, 1).sum(1).mul_(batch * batch).sqrt_()
    factors = (clip / torch.clamp(norms, min=clip)).mul_(batch)  # mean loss: g carries 1/B
    sizes = sum(p.numel() for p in model.parameters())
    noise = torch.randn(sizes, generator=generator)
    start = 0
    for a, z, layer in zip(inputs, outputs, layers):
        g = z.grad * factors[:, None]
        for p, total in ((layer.weight, g.t().mm(a)), (layer.bias, g.sum(0))):
            piece = noise[start:start + p.numel()].view_as(total)
            p.grad = total.add_(piece, alpha=noise_multiplier * clip).div_(batch)
            start += p.numel()
    optimizer.step()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args(argv)
    model, x, y = workload("mlp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(0)

    def non_private():
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    def private():
        hand_written_dp_step(model, x, y, optimizer, generator)

    steps = {"non-private": non_private, "hand-written DP": private}
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
