"""The joint-clipping example of McMahan & Andrew (2018), measured.

Each record holds v1 (||v1|| <= 1) or v2 (||v2|| <= 100), never both. Four mechanisms with the
same privacy cost (the same noise multiplier z by Eq. (1), the same q) estimate the averages of
v1 and v2; the table reports the root-mean-square error of each estimate against the exact
(unclipped, noise-free) average of the same sample, over repeated releases: what the mechanism
costs in accuracy, clipping bias plus noise, without the sampling error all four share.

    python examples/joint_clipping.py
"""

from __future__ import annotations

import argparse

import numpy as np

from dpcore import Group, Mechanism, PrivateAggregator, allocation

DIM = 10


def records(n: int, rng: np.random.Generator):
    """Half the records carry v1 (norm up to 1), half v2 (norm up to 100), along fixed mean
    directions so that the averages are far from zero."""
    direction = rng.normal(size=(2, DIM))
    direction /= np.linalg.norm(direction, axis=1, keepdims=True)

    def vectors(bound):
        v = 0.5 * direction[int(bound > 1)] + 0.5 * rng.normal(size=(n, DIM)) / np.sqrt(DIM)
        v /= np.maximum(1.0, np.linalg.norm(v, axis=1, keepdims=True))
        return bound * v * rng.uniform(0.2, 1.0, size=(n, 1))

    first = rng.random(n) < 0.5
    v1, v2 = vectors(1.0), vectors(100.0)
    v1[~first], v2[first] = 0.0, 0.0
    return {"v1": v1, "v2": v2}


def mechanisms(z: float) -> dict[str, Mechanism]:
    """Four ways to spend the same z on (v1, v2)."""
    return {
        "joint, alpha=(1, 100), S=1": Mechanism((Group("joint", ("v1", "v2"), 1.0, z,
                                                        scales=(1.0, 100.0)),)),
        "separate, S=(1, 100), proportional noise": Mechanism(tuple(
            Group(leaf, (leaf,), clip, sigma) for leaf, clip, sigma in zip(
                ("v1", "v2"), (1.0, 100.0),
                allocation.allocate_noise([1.0, 100.0], [DIM, DIM], z, "proportional")))),
        "flat, S=100": allocation.flat(["v1", "v2"], clip=100.0, noise_multiplier=z),
        "flat, S=1": allocation.flat(["v1", "v2"], clip=1.0, noise_multiplier=z),
    }


def rmse_table(z: float = 1.0, n: int = 20_000, q: float = 0.05, releases: int = 200,
               seed: int = 0):
    rng = np.random.default_rng(seed)
    data = records(n, rng)
    rows = []
    for name, mechanism in mechanisms(z).items():
        assert abs(mechanism.noise_multiplier - z) < 1e-9 * z  # equal privacy cost
        agg = PrivateAggregator(mechanism, n=n, q=q, seed=seed)
        errors = {"v1": [], "v2": []}
        for _ in range(releases):
            idx = agg.sample()
            sample = {leaf: v[idx] for leaf, v in data.items()}
            out = agg.release(sample)
            for leaf in errors:
                exact = sample[leaf].sum(axis=0) / agg.expected_size
                errors[leaf].append(np.sum((out[leaf] - exact) ** 2))
        rows.append((name, *(float(np.sqrt(np.mean(errors[leaf]))) for leaf in ("v1", "v2"))))
    norms = {leaf: float(np.linalg.norm(v.sum(axis=0) / n)) for leaf, v in data.items()}
    return rows, norms


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    args = parser.parse_args(argv)
    rows, norms = rmse_table(args.noise_multiplier)
    print(f"z = {args.noise_multiplier}; ||mean v1|| = {norms['v1']:.3f}, "
          f"||mean v2|| = {norms['v2']:.2f}; RMSE of the estimates:")
    print(f"{'mechanism':45s} {'v1':>10s} {'v2':>10s}")
    for name, e1, e2 in rows:
        print(f"{name:45s} {e1:10.4f} {e2:10.3f}")
    return rows


if __name__ == "__main__":
    main()
