"""Reproductions of the papers' claims on scikit-learn's digits (PyTorch backend).

    python examples/reproductions.py momentum-clip   # (a) momentum 0.6 and decreasing clip
    python examples/reproductions.py adaptive        # (b) adaptive clipping vs a grid of clips
    python examples/joint_clipping.py                # (c) the joint-clipping example

(a) Yu, Zhang, Chen: train until the budget (epsilon, delta) is spent (Algorithm 1). The noise
multiplier is calibrated so that plain DP-SGD runs the target number of epochs; with the
decreasing clip C_t = C / min(2, 1 + t/T) (T = the target steps) and the noise std held fixed,
later steps cost less and more of them fit. Momentum 0.6 against plain SGD.
(b) Andrew et al.: adaptive clipping from C_0 = 0.1 (median, geometric update, the paper's
defaults) against every fixed clip of a grid, at the same noise multiplier and steps, hence the
same epsilon.

Each row is the mean (and standard deviation) over seeds; seeds fix initialisation, sampling
and noise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from digits import DELTA, load_digits, torch_model  # noqa: E402

import dpcore  # noqa: E402
from dpcore.accounting import calibrate_noise_multiplier, epsilon  # noqa: E402
from dpcore.momentum import RECOMMENDED_COEFFICIENT  # noqa: E402
from dpcore.sampling import steps_per_epoch  # noqa: E402
from dpcore.schedules import decreasing  # noqa: E402

BATCH, EPOCHS = 64, 15


def train(data, *, seed, noise_multiplier, clip, lr, momentum=0.0, clip_policy=None,
          budget=None, max_steps=None, steps=None):
    """Train the digits network privately; returns (test accuracy, steps taken, epsilon)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from dpcore_torch import make_private

    x_train, x_test, y_train, y_test = data
    torch.manual_seed(seed)
    train_set = TensorDataset(torch.as_tensor(x_train), torch.as_tensor(y_train))
    model = torch_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    model, optimizer, loader = make_private(
        model, optimizer, DataLoader(train_set, batch_size=BATCH), noise_multiplier=noise_multiplier,
        max_grad_norm=clip, clip_policy=clip_policy, budget=budget, seed=seed)
    taken = 0
    limit = steps if steps is not None else max_steps
    while taken < limit and optimizer.next_step_fits():
        for x, y in loader:
            if taken >= limit or not optimizer.next_step_fits():
                break
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            taken += 1
    model.eval()
    with torch.no_grad():
        accuracy = float((model(torch.as_tensor(x_test)).argmax(1).numpy() == y_test).mean())
    return accuracy, taken, epsilon(optimizer.ledger, DELTA)


def momentum_and_clip(seeds: int, budgets, lr: float, epochs: int = EPOCHS) -> list[tuple]:
    """(a): rows (epsilon, variant, accuracy mean, sd, steps mean, epsilon spent max)."""
    data = load_digits(0)
    q = BATCH / len(data[0])
    target_steps = epochs * steps_per_epoch(q)
    rows = []
    for eps in budgets:
        z = calibrate_noise_multiplier(eps, DELTA, q=q, steps=target_steps)
        variants = {
            "DP-SGD": dict(momentum=0.0),
            f"momentum {RECOMMENDED_COEFFICIENT}": dict(momentum=RECOMMENDED_COEFFICIENT),
            "decreasing clip": dict(clip_policy=dpcore.ClipSchedule(decreasing(target_steps))),
            "both": dict(momentum=RECOMMENDED_COEFFICIENT,
                         clip_policy=dpcore.ClipSchedule(decreasing(target_steps))),
        }
        for name, options in variants.items():
            runs = [train(data, seed=s, noise_multiplier=z, clip=1.0, lr=lr,
                          budget=dpcore.PrivacyBudget(eps, DELTA),
                          max_steps=4 * target_steps, **options) for s in range(seeds)]
            acc = np.array([r[0] for r in runs])
            rows.append((eps, name, acc.mean(), acc.std(), np.mean([r[1] for r in runs]),
                         max(r[2] for r in runs)))
            print(f"epsilon {eps:g}  {name:18s} accuracy {acc.mean():.4f} +- {acc.std():.4f}  "
                  f"steps {rows[-1][4]:.0f}  spent {rows[-1][5]:.3f}", flush=True)
    return rows


def adaptive_against_grid(seeds: int, eps: float, grid, lr: float,
                          epochs: int = EPOCHS) -> list[tuple]:
    """(b): rows (clip, accuracy mean, sd, epsilon spent max); the clip "adaptive" last."""
    data = load_digits(0)
    q = BATCH / len(data[0])
    steps = epochs * steps_per_epoch(q)
    z = calibrate_noise_multiplier(eps, DELTA, q=q, steps=steps)
    rows = []
    for clip in list(grid) + ["adaptive"]:
        options = (dict(clip=0.1, clip_policy=dpcore.QuantileClipping()) if clip == "adaptive"
                   else dict(clip=clip))
        runs = [train(data, seed=s, noise_multiplier=z, steps=steps, lr=lr, **options)
                for s in range(seeds)]
        acc = np.array([r[0] for r in runs])
        rows.append((clip, acc.mean(), acc.std(), max(r[2] for r in runs)))
        print(f"clip {clip!s:9s} accuracy {acc.mean():.4f} +- {acc.std():.4f}  "
              f"spent {rows[-1][3]:.3f}", flush=True)
    best = max(rows[:-1], key=lambda r: r[1])
    print(f"best fixed clip {best[0]}: {best[1]:.4f}; adaptive: {rows[-1][1]:.4f} "
          f"(gap {best[1] - rows[-1][1]:+.4f})")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment", choices=("momentum-clip", "adaptive"))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epsilon", type=float, nargs="+", default=None,
                        help="budgets (a) or the one epsilon (b); defaults 0.5 1 2 and 2")
    parser.add_argument("--lr", type=float, default=0.5, help="the same for every variant")
    parser.add_argument("--grid", type=float, nargs="+", default=[0.03, 0.1, 0.3, 1, 3, 10])
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    if args.experiment == "momentum-clip":
        return momentum_and_clip(args.seeds, args.epsilon or [0.5, 1.0, 2.0], args.lr)
    return adaptive_against_grid(args.seeds, (args.epsilon or [2.0])[0], args.grid, args.lr)


if __name__ == "__main__":
    main()
