"""The two forms of per-example convolution weight gradients in dpcore's PyTorch backend, timed
side by side on stride-1 layer shapes: shifted rows (``ConvRule._shifted_rows_grad``) and one
grouped weight gradient with the examples as groups (``ConvRule._convolution_grad``; with one
input channel, the role-swapped forward convolution). Random inputs and backprops; each form
runs twice untimed, then ``--repeats`` times (median reported, in milliseconds), both forms
alternating so that drift hits them alike. ``CONV_FORM = "auto"`` picks between them by timing
each layer configuration once; this script shows where each wins.

    python benchmarks/torch_conv_forms.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from dpcore_torch.layers import ConvRule, Use

# batch, channels in, channels out, kernel, image side, padding, spatial dimensions
SHAPES = [
    (256, 1, 10, 5, 28, 0, 2),   # MNIST CNN conv1
    (256, 10, 20, 5, 12, 0, 2),  # MNIST CNN conv2
    (64, 64, 64, 3, 32, 1, 2),
    (64, 16, 16, 3, 32, 1, 2),
    (64, 8, 16, 3, 32, 1, 2),
    (128, 16, 32, 3, 16, 1, 2),
    (32, 64, 64, 3, 16, 1, 2),
    (64, 32, 32, 3, 12, 1, 2),
    (128, 16, 16, 3, 8, 1, 2),
    (32, 128, 128, 3, 8, 1, 2),
    (64, 32, 64, 3, 8, 1, 2),
    (32, 256, 256, 3, 4, 1, 2),
    (256, 3, 32, 3, 32, 1, 2),
    (32, 4, 8, 3, 64, 1, 2),
    (64, 12, 24, 5, 24, 2, 2),
    (32, 128, 128, 5, 256, 2, 1),
]


def time_forms(shape, repeats: int) -> dict[str, float]:
    batch, c_in, c_out, kernel, side, padding, dims = shape
    conv = (nn.Conv2d if dims == 2 else nn.Conv1d)(c_in, c_out, kernel, padding=padding)
    x = torch.randn((batch, c_in) + (side,) * dims)
    with torch.no_grad():
        g = torch.randn(conv(x).shape)
    use = Use(x, aux=(padding,) * dims)
    use.g = g
    rule = ConvRule()
    forms = {"shifted": lambda: rule._shifted_rows_grad(conv, use),
             "convolution": lambda: rule._convolution_grad(conv, use)}
    times = {name: [] for name in forms}
    for form in forms.values():
        form(), form()
    for _ in range(repeats):
        for name, form in forms.items():
            start = time.perf_counter()
            form()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'B':>4} {'C_in':>5} {'C_out':>5} {'kernel':>7} {'input':>9} "
          f"{'convolution ms':>15} {'shifted ms':>11}  faster")
    for shape in SHAPES:
        batch, c_in, c_out, kernel, side, _, dims = shape
        ms = time_forms(shape, args.repeats)
        image = "x".join([str(side)] * dims)
        print(f"{batch:>4} {c_in:>5} {c_out:>5} {'x'.join([str(kernel)] * dims):>7} {image:>9} "
              f"{ms['convolution']:>15.2f} {ms['shifted']:>11.2f}  {min(ms, key=ms.get)}")


if __name__ == "__main__":
    main()
