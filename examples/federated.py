"""User-level DP federated averaging on the NumPy backend, with adaptive clipping.

Every record is one *user*: the update a user's local training makes to the shared model.
Each round samples users by Poisson sampling, clips each user's update to the current
adaptive bound, adds noise and averages by the public expected number of users; the ledger
records every round, and the guarantee is for adding or removing one user's whole data.

    python examples/federated.py --rounds 200 --noise-multiplier 1.0
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import dpcore
from dpcore.accounting import epsilon
from dpcore.momentum import RECOMMENDED_COEFFICIENT


def make_users(n_users: int, per_user: int, dim: int, rng: np.random.Generator):
    """Linear-regression data; each user's optimum is the shared w* plus a personal shift."""
    w_star = rng.normal(size=dim)
    shift = 0.3 * rng.normal(size=(n_users, dim))
    x = rng.normal(size=(n_users, per_user, dim))
    y = np.einsum("upd,ud->up", x, w_star + shift) + 0.1 * rng.normal(size=(n_users, per_user))
    return x, y


def local_updates(w, x, y, steps: int, lr: float):
    """Each sampled user runs ``steps`` of full-batch gradient descent from ``w``; the record
    is the change it made: Delta_u = w_u - w."""
    w_u = np.repeat(w[None, :], x.shape[0], axis=0)
    for _ in range(steps):
        residual = np.einsum("upd,ud->up", x, w_u) - y
        w_u -= lr * np.einsum("upd,up->ud", x, residual) / x.shape[1]
    return w_u - w


def mse(w, x, y):
    return float(np.mean((np.einsum("upd,d->up", x, w) - y) ** 2))


def train(rounds: int, noise_multiplier: float | None, *, n_users=2000, q=0.05, seed=0,
          ledger=None, log_every=25):
    """Returns (final training MSE, ledger, clip trajectory); ``noise_multiplier=None`` trains
    without DP (no clipping, no noise)."""
    rng = np.random.default_rng(seed)
    x, y = make_users(n_users, per_user=20, dim=20, rng=rng)
    w, velocity = np.zeros(x.shape[2]), np.zeros(x.shape[2])
    agg = None
    if noise_multiplier is not None:
        mechanism = dpcore.flat(["update"], clip=0.1, noise_multiplier=noise_multiplier,
                                record="user")
        agg = dpcore.PrivateAggregator(mechanism, n=n_users, q=q, ledger=ledger, seed=seed,
                                       clipping=dpcore.QuantileClipping())
    sampler = dpcore.PoissonSampler(n_users, q, seed=seed + 1)
    clips = []
    if log_every:
        print(f"round    0  training MSE {mse(w, x, y):.4f}")
    for r in range(rounds):
        if agg is None:
            users = sampler.sample()
            delta = local_updates(w, x[users], y[users], 5, 0.05).sum(axis=0) / (q * n_users)
        else:
            users = agg.sample()
            clips.append(agg.mechanism.groups[0].clip)
            delta = agg.release({"update": local_updates(w, x[users], y[users], 5, 0.05)})["update"]
        velocity = RECOMMENDED_COEFFICIENT * velocity + delta  # server momentum, post-processing
        w = w + velocity
        if log_every and (r + 1) % log_every == 0:
            clip = f"  clip {clips[-1]:.3f}" if clips else ""
            print(f"round {r + 1:4d}  training MSE {mse(w, x, y):.4f}{clip}")
    return mse(w, x, y), (agg.ledger if agg else None), clips


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--users", type=int, default=2000)
    parser.add_argument("--ledger", default="federated-ledger.jsonl")
    parser.add_argument("--json", action="store_true", help="print a JSON summary only")
    args = parser.parse_args(argv)
    delta = 1 / args.users ** 1.1
    private, ledger, clips = train(args.rounds, args.noise_multiplier, n_users=args.users,
                                   ledger=args.ledger, log_every=0 if args.json else 25)
    baseline, _, _ = train(args.rounds, None, n_users=args.users, log_every=0)
    eps = epsilon(ledger, delta)
    summary = {"rounds": args.rounds, "users": args.users, "private_mse": private,
               "non_private_mse": baseline, "final_clip": clips[-1], "epsilon": eps,
               "delta": delta, "ledger": args.ledger}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"user-level DP: training MSE {private:.4f} (non-private {baseline:.4f}), "
              f"adaptive clip {clips[0]:.2f} -> {clips[-1]:.3f}, "
              f"epsilon {eps:.2f} at delta {delta:.1e}; ledger in {args.ledger}")
    return summary


if __name__ == "__main__":
    main()
