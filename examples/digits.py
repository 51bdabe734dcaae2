"""The main job: train a small network on scikit-learn's digits with differential privacy.

    python examples/digits.py                        # DP at epsilon = 2 (delta = 1e-5)
    python examples/digits.py --epsilon 1 --epochs 20
    python examples/digits.py --table                # accuracy against epsilon (docs/results-digits.md)

The noise multiplier is calibrated up front so that the planned number of steps is
(epsilon, delta)-DP; every step's Poisson sampling and Gaussian sum query go to the ledger
(``--ledger``), from which the running and final epsilon are computed. The same network is
trained the same way without DP for comparison. The digits data ship with scikit-learn (no
download): 1,797 8x8 images, 1,437 for training and 360 for testing.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np

from dpcore.sampling import steps_per_epoch

DELTA = 1e-5
# The training loss shown is released privately too, a query of every step that the target
# epsilon covers: each record's loss clipped to LOSS_CLIP, noise of multiplier LOSS_SHARE z on
# the sum, so it takes 1 / LOSS_SHARE^2 of the step's 1/z^2 (the gradient's z grows 0.8%)
LOSS_CLIP, LOSS_SHARE = 4.0, 8.0


def load_digits(seed: int):
    """(x_train, y_train, x_test, y_test): images scaled to [0, 1], shape (n, 1, 8, 8)."""
    from sklearn.datasets import load_digits as sk_digits
    from sklearn.model_selection import train_test_split

    data = sk_digits()
    x = (data.images / 16.0).astype(np.float32)[:, None]
    return train_test_split(x, data.target, test_size=0.2, random_state=seed,
                            stratify=data.target)


# --------------------------------------------------------------------------------------- torch

def torch_model():
    """Conv 1->8 3x3 (tanh), max-pool 2, linear 128->10: small enough that the noise of DP at
    epsilon ~ 1 on 1,437 examples leaves a usable signal."""
    from torch import nn

    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(8 * 4 * 4, 10))


def train_torch(data, args, *, private: bool, progress: bool = True):
    """Train; return (test accuracy, epsilon or inf, [(step, epsilon)] or [])."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    from tqdm import tqdm

    x_train, x_test, y_train, y_test = data
    torch.manual_seed(args.seed)
    train = TensorDataset(torch.as_tensor(x_train), torch.as_tensor(y_train))
    model = torch_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(args.seed))
    if private:
        import dpcore
        from dpcore.accounting import calibrate_noise_multiplier
        from dpcore_torch import make_private

        # z for the planned steps, calibrated once: the step's total, which sizes the loss's
        q = args.batch_size / len(train)  # noise; make_private gives the gradient the rest
        z = calibrate_noise_multiplier(args.epsilon, DELTA, q=q,
                                       steps=args.epochs * steps_per_epoch(q),
                                       accountant=args.accountant)
        loss_metric = dpcore.Mechanism((dpcore.Group("loss", ("loss",), LOSS_CLIP,
                                                     LOSS_SHARE * z * LOSS_CLIP),))
        model, optimizer, loader = make_private(
            model, optimizer, loader, noise_multiplier=z, max_grad_norm=args.clip,
            ledger=args.ledger, seed=args.seed if args.deterministic else None,
            metrics=[loss_metric])
    curve, eps, step = [], math.inf, 0
    label = f"DP eps={args.epsilon:g}" if private else "non-private"
    for epoch in range(args.epochs):
        bar = tqdm(loader, desc=f"{label} epoch {epoch + 1}/{args.epochs}", leave=False,
                   disable=not progress)
        losses = []  # the epoch's batch losses: released privately under DP
        for x, y in bar:
            optimizer.zero_grad()
            per_record = F.cross_entropy(model(x), y, reduction="none")
            per_record.mean().backward()
            optimizer.step()
            step += 1
            if private:  # the clipped average loss of the step's sample, with noise
                values = {"loss": per_record.detach()[:, None]}
                losses.append(optimizer.release(values, loss_metric)["loss"].item())
            else:
                losses.append(per_record.mean().item())
            bar.set_postfix(loss=f"{np.mean(losses):.3f}",
                            eps=f"{eps:.2f}" if private else "inf")
        if private:
            eps = optimizer.epsilon(DELTA, accountant=args.accountant)
            curve.append((step, eps))
            if progress:
                tqdm.write(f"{label} epoch {epoch + 1}: loss {np.mean(losses):.3f} (private), "
                           f"epsilon so far {eps:.3f}")
    model.eval()
    with torch.no_grad():
        pred = model(torch.as_tensor(x_test)).argmax(1).numpy()
    if private:
        optimizer.ledger.close()
    return float((pred == y_test).mean()), eps, curve


# ---------------------------------------------------------------------------------- tensorflow

def keras_model():
    """The same network in Keras (channels last): conv 1->8 3x3 (tanh), max-pool 2, dense 128->10."""
    import keras

    return keras.Sequential([keras.Input((8, 8, 1)),
                             keras.layers.Conv2D(8, 3, padding="same", activation="tanh"),
                             keras.layers.MaxPooling2D(), keras.layers.Flatten(),
                             keras.layers.Dense(10)])


def train_tensorflow(data, args, *, private: bool, progress: bool = True):
    """Train with Keras ``fit``; return (test accuracy, epsilon or inf, [(step, epsilon)] or [])."""
    import keras

    x_train, x_test, y_train, y_test = data
    x_train, x_test = x_train.transpose(0, 2, 3, 1), x_test.transpose(0, 2, 3, 1)
    keras.utils.set_random_seed(args.seed)
    model = keras_model()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = keras.optimizers.SGD(args.lr, momentum=args.momentum)
    steps = steps_per_epoch(args.batch_size / len(x_train))
    curve, eps = [], math.inf
    if private:
        from dpcore.accounting import calibrate_noise_multiplier, epsilon
        from dpcore_tensorflow import make_private

        q = args.batch_size / len(x_train)
        z = calibrate_noise_multiplier(args.epsilon, DELTA, q=q, steps=steps * args.epochs,
                                       accountant=args.accountant)
        model = make_private(model, n=len(x_train), q=q, max_grad_norm=args.clip,
                             noise_multiplier=z, ledger=args.ledger,
                             seed=args.seed if args.deterministic else None)

        class Epsilon(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                curve.append(((epoch + 1) * steps,
                              epsilon(model.aggregator.ledger, DELTA, accountant=args.accountant)))
                if progress:  # Keras's loss of the batches is not private: not shown
                    print(f"DP eps={args.epsilon:g} epoch {epoch + 1}: epsilon so far "
                          f"{curve[-1][1]:.3f}")
        model.compile(optimizer=optimizer, loss=loss)
        model.fit(x_train, y_train, epochs=args.epochs, steps_per_epoch=steps, verbose=0,
                  callbacks=[Epsilon()])
        model.aggregator.ledger.close()
        eps = curve[-1][1]
    else:
        model.compile(optimizer=optimizer, loss=loss)
        model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
                  verbose=2 if progress else 0)
    pred = np.asarray(model.predict(x_test, verbose=0)).argmax(1)
    return float((pred == y_test).mean()), eps, curve


# ----------------------------------------------------------------------------------------- jax

def jax_model(rng):
    """The same network as a pytree (channels last): conv 1->8 3x3 (tanh), max-pool 2,
    dense 128->10; returns (logits_fn, params)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def logits(p, x):
        h = lax.conv_general_dilated(x, p["conv"]["w"], (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
        h = jnp.tanh(h + p["conv"]["b"])
        h = lax.reduce_window(h, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        return h.reshape(h.shape[0], -1) @ p["fc"]["w"] + p["fc"]["b"]

    def uniform(shape, fan_in):  # PyTorch's default initialisation
        bound = 1.0 / math.sqrt(fan_in)
        return jnp.asarray(rng.uniform(-bound, bound, size=shape), jnp.float32)

    params = {"conv": {"w": uniform((3, 3, 1, 8), 9), "b": uniform((8,), 9)},
              "fc": {"w": uniform((128, 10), 128), "b": uniform((10,), 128)}}
    return jax.jit(logits), params


def train_jax(data, args, *, private: bool, progress: bool = True):
    """Train with a jitted step (dpcore_jax's fused private step for DP); return
    (test accuracy, epsilon or inf, [(step, epsilon)] or [])."""
    import jax
    import jax.numpy as jnp
    import optax

    x_train, x_test, y_train, y_test = data
    x_train, x_test = x_train.transpose(0, 2, 3, 1), x_test.transpose(0, 2, 3, 1)
    rng = np.random.default_rng(args.seed)
    logits, params = jax_model(rng)

    def loss_fn(p, batch):
        x, y = batch
        return -jnp.take_along_axis(jax.nn.log_softmax(logits(p, x)), y[:, None], 1)[:, 0]

    optimizer = optax.sgd(args.lr, momentum=args.momentum)
    steps = steps_per_epoch(args.batch_size / len(x_train))
    curve, eps = [], math.inf
    label = f"DP eps={args.epsilon:g}" if private else "non-private"
    if private:
        import dpcore
        from dpcore.accounting import calibrate_noise_multiplier, epsilon
        from dpcore_jax import PoissonBatches, PrivateStep, leaf_names

        q = args.batch_size / len(x_train)
        z = calibrate_noise_multiplier(args.epsilon, DELTA, q=q, steps=steps * args.epochs,
                                       accountant=args.accountant)
        aggregator = dpcore.PrivateAggregator(
            dpcore.flat(leaf_names(params), args.clip, z), n=len(x_train), q=q, backend="jax",
            ledger=args.ledger, seed=args.seed if args.deterministic else None)
        step_fn = PrivateStep(loss_fn, optimizer, aggregator)
        state = step_fn.init(params)
        batches = PoissonBatches((x_train, y_train.astype(np.int32)), aggregator)
        for epoch in range(args.epochs):
            for _ in range(steps):
                params, state = step_fn(params, state, *batches.next())
                batches.prefetch()  # the next sample, while the device computes
            eps = epsilon(aggregator.ledger, DELTA, accountant=args.accountant)
            curve.append(((epoch + 1) * steps, eps))
            if progress:
                print(f"{label} epoch {epoch + 1}: epsilon so far {eps:.3f}")
        aggregator.ledger.close()
    else:
        @jax.jit
        def step_fn(params, state, batch):
            grads = jax.grad(lambda p: jnp.mean(loss_fn(p, batch)))(params)
            updates, state = optimizer.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        state = optimizer.init(params)
        for epoch in range(args.epochs):
            order = rng.permutation(len(x_train))
            for i in range(steps):
                idx = order[i * args.batch_size:(i + 1) * args.batch_size]
                params, state = step_fn(params, state, (x_train[idx], y_train[idx]))
            if progress:
                print(f"{label} epoch {epoch + 1} done")
    pred = np.asarray(logits(params, x_test)).argmax(1)
    return float((pred == y_test).mean()), eps, curve


BACKENDS = {"torch": train_torch, "tensorflow": train_tensorflow, "jax": train_jax}



# --------------------------------------------------------------------------------------- main

def plot(curve, path: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, eps = zip(*curve)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(steps, eps, marker=".")
    ax.axhline(target, color="grey", linestyle="--", label=f"target {target:g}")
    ax.set_xlabel("step")
    ax.set_ylabel(f"epsilon (delta = {DELTA:g})")
    ax.set_title("Privacy spent on digits")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(args, train) -> None:
    data = load_digits(args.seed)
    rows = []
    for target in (0.5, 1, 2, 4, 8, math.inf):
        accs, epss = [], []
        for seed in range(args.seeds):
            run = argparse.Namespace(**{**vars(args), "epsilon": target, "seed": seed,
                                        "ledger": None})
            start = time.perf_counter()
            acc, eps, _ = train(data, run, private=math.isfinite(target), progress=False)
            accs.append(acc)
            epss.append(eps)
            print(f"  epsilon {target:g} seed {seed}: accuracy {acc:.4f}, spent {eps:.3f} "
                  f"({time.perf_counter() - start:.1f} s)", flush=True)
        rows.append((target, np.mean(accs), np.std(accs), max(epss)))
    print(f"\n| target epsilon | test accuracy (mean +- sd over {args.seeds} seeds) | "
          f"epsilon spent (delta = {DELTA:g}) |")
    print("|---|---|---|")
    for target, mean, sd, spent in rows:
        name = "inf (non-private)" if math.isinf(target) else f"{target:g}"
        spent = "-" if math.isinf(target) else f"{spent:.3f}"
        print(f"| {name} | {mean:.4f} +- {sd:.4f} | {spent} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="DP training on scikit-learn's digits")
    parser.add_argument("--backend", default="torch", choices=sorted(BACKENDS))
    parser.add_argument("--epsilon", type=float, default=2.0, help="target epsilon")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=64,
                        help="expected batch size q n (Poisson sampling)")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--momentum", type=float, default=0.6)
    parser.add_argument("--clip", type=float, default=1.0, help="max gradient norm S")
    parser.add_argument("--accountant", default="pld", choices=("pld", "rdp"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deterministic", action="store_true",
                        help="seed the sampling and noise too (for tests; not private)")
    parser.add_argument("--ledger", default="digits-ledger.jsonl")
    parser.add_argument("--plot", default="digits-epsilon.png")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (small models run fastest on one)")
    parser.add_argument("--table", action="store_true",
                        help="accuracy for epsilon in 0.5, 1, 2, 4, 8, inf")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per row of --table")
    args = parser.parse_args(argv)
    train = BACKENDS[args.backend]
    if args.backend == "torch":
        import torch

        torch.set_num_threads(args.threads)
    if args.table:
        table(args, train)
        return
    data = load_digits(args.seed)
    if Path(args.ledger).exists():
        Path(args.ledger).unlink()  # a new run; Ledger(path) would append to an old one
    start = time.perf_counter()
    acc, eps, curve = train(data, args, private=True)
    dp_time = time.perf_counter() - start
    base, _, _ = train(data, args, private=False)
    print(f"\nDP (target epsilon {args.epsilon:g}, delta {DELTA:g}): test accuracy {acc:.4f}, "
          f"epsilon spent {eps:.3f} ({dp_time:.1f} s)")
    print(f"non-private, same training:           test accuracy {base:.4f}")
    plot(curve, Path(args.plot), args.epsilon)
    print(f"ledger: {args.ledger}   epsilon plot: {args.plot}")


if __name__ == "__main__":
    main()
