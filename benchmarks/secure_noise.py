"""The noise of ``secure=True`` (:mod:`dpcore.secure`) against the framework's generator, for
the noise sizes of the three benchmark workloads: one draw of N(0, 1) values, timed in
interleaved blocks (:mod:`rounds`; medians), side by side in one process:

* ``torch.randn`` (float32), what a non-secure PyTorch step draws;
* ``secure``: :class:`dpcore.secure.SecureGenerator` as installed (with the `secure` extra,
  words from an AES-256-CTR keystream keyed from ``os.urandom``, Phi^-1 on two threads);
* ``secure, os.urandom``: the same without `cryptography` (every word from ``os.urandom``).

    python benchmarks/secure_noise.py [--rounds 15] [--block 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import defaultdict

import torch

from dpcore import secure
from dpcore.secure import SecureGenerator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rounds import one_round  # noqa: E402

SIZES = {"MLP": 16_307, "MNIST CNN": 21_840, "transformer": 1_684_994}


def without_keystream(size: int):
    cipher, secure.Cipher = secure.Cipher, None
    try:
        return SecureGenerator().standard_normal(size)
    finally:
        secure.Cipher = cipher


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--block", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, keystream "
          f"{'on' if secure.Cipher is not None else 'off (no cryptography)'}")
    print(f"{'noise of':<13}{'values':>10}{'torch.randn ms':>16}{'secure ms':>11}"
          f"{'x randn':>9}{'os.urandom ms':>15}{'x randn':>9}")
    for name, size in SIZES.items():
        steps = {"randn": lambda: torch.randn(size),
                 "secure": lambda: SecureGenerator().standard_normal(size),
                 "urandom": lambda: without_keystream(size)}
        times = defaultdict(list)
        for _ in range(args.rounds):
            one_round(steps, args.block, times)
        ms = {kind: 1e3 * statistics.median(t) for kind, t in times.items()}
        print(f"{name:<13}{size:>10,}{ms['randn']:>16.3f}{ms['secure']:>11.3f}"
              f"{ms['secure'] / ms['randn']:>9.1f}{ms['urandom']:>15.3f}"
              f"{ms['urandom'] / ms['randn']:>9.1f}")


if __name__ == "__main__":
    main()
