"""DP step time of the JAX backend against the non-private jitted step, side by side.

Workloads (as in the PyTorch issue): (a) MNIST CNN conv 1->10 5x5, conv 10->20 5x5, fc 320->50,
fc 50->10 at batch 256 on random 28x28 inputs; (b) covertype MLP 54-100-100-7 tanh at batch 512;
(c) a transformer encoder (embedding 10,000 x 128, 2 blocks of 4-head attention and a 512-wide
MLP with layer norms, sequence 64) at batch 32.

The non-private step is ``jit(grad of the mean loss + SGD update)`` on a fixed batch of B (the
goal's baseline), and the same step on a fresh random batch of B rows per step gathered on the
host ("fresh": the data movement a real input pipeline adds, which the DP step also pays). The
DP step is everything a private step costs, run as ``dpcore_jax.train`` runs it: the step's
sampling event written, its Poisson sample (of expected size B = q n, padded to its bucket)
handed over, the fused compiled step (norms, clipping, noise, SGD update) dispatched, the
sum-query events written and the next sample drawn and padded while the device computes, until
the new parameters are ready. The fresh step gathers its next batch the same way. Rounds alternate
``--steps`` steps of each kind so all see the same machine load; DP steps that compiled a new
bucket are not timed (their count is reported). Reported: median step times and their ratio,
each step waited for ("blocked"), and per step of ``--steps`` steps dispatched back to back and
waited for once ("pipelined"): how a training loop runs them, since JAX dispatches
asynchronously and the host prepares the next batch while the device computes.

Long rounds measure the steady state of a training loop (which runs one kind of step): with
rounds of 10 steps the sub-millisecond MLP step pays for switching between the kinds' programs
and data, and its DP/non-private ratio moved from about 1.9x to 2.1x. Many rounds spread each
kind over the whole run, so the machine's drift hits all kinds alike: the MLP gets 40 rounds
(about 20 s; with 3 rounds, 2 s, its ratio moved between 1.25x and 1.45x from run to run),
the CNN and the transformer 3 (about a minute each).

    python benchmarks/jax_step.py [--workloads cnn mlp transformer] [--rounds N] [--steps 50]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import dpcore
from dpcore_jax import PoissonBatches, PrivateStep, leaf_names


def xent(logits, labels):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1)[:, 0]


def dense(rng, a, b):
    return {"w": jnp.asarray(rng.normal(size=(a, b)) / np.sqrt(a), jnp.float32),
            "b": jnp.zeros(b, jnp.float32)}


def cnn(rng):
    def conv(x, p):
        y = lax.conv_general_dilated(x, p["w"], (1, 1), "VALID",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return y + p["b"]

    def pool(x):
        return lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")

    def loss(p, batch):
        x, y = batch
        h = jax.nn.relu(pool(conv(x, p["conv1"])))
        h = jax.nn.relu(pool(conv(h, p["conv2"])))
        h = jax.nn.relu(h.reshape(h.shape[0], -1) @ p["fc1"]["w"] + p["fc1"]["b"])
        return xent(h @ p["fc2"]["w"] + p["fc2"]["b"], y)

    params = {"conv1": {"w": jnp.asarray(rng.normal(size=(5, 5, 1, 10)) / 5, jnp.float32),
                        "b": jnp.zeros(10, jnp.float32)},
              "conv2": {"w": jnp.asarray(rng.normal(size=(5, 5, 10, 20)) / 16, jnp.float32),
                        "b": jnp.zeros(20, jnp.float32)},
              "fc1": dense(rng, 320, 50), "fc2": dense(rng, 50, 10)}

    def data(n):
        return (rng.normal(size=(n, 28, 28, 1)).astype(np.float32),
                rng.integers(0, 10, size=n).astype(np.int32))

    return loss, params, data, 256


def mlp(rng):
    def loss(p, batch):
        x, y = batch
        h = jnp.tanh(x @ p["l1"]["w"] + p["l1"]["b"])
        h = jnp.tanh(h @ p["l2"]["w"] + p["l2"]["b"])
        return xent(h @ p["l3"]["w"] + p["l3"]["b"], y)

    params = {"l1": dense(rng, 54, 100), "l2": dense(rng, 100, 100), "l3": dense(rng, 100, 7)}

    def data(n):
        return (rng.normal(size=(n, 54)).astype(np.float32),
                rng.integers(0, 7, size=n).astype(np.int32))

    return loss, params, data, 512


def transformer(rng, vocab=10_000, d=128, heads=4, blocks=2, seq=64, classes=2):
    def norm(h, p):
        mean = h.mean(-1, keepdims=True)
        var = ((h - mean) ** 2).mean(-1, keepdims=True)
        return (h - mean) * lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]

    def block(h, p):
        b, t, _ = h.shape
        qkv = (h @ p["qkv"]["w"] + p["qkv"]["b"]).reshape(b, t, 3, heads, d // heads)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        a = jax.nn.softmax(jnp.einsum("bthe,bshe->bhts", q, k) / np.sqrt(d // heads), axis=-1)
        o = jnp.einsum("bhts,bshe->bthe", a, v).reshape(b, t, d)
        h = norm(h + o @ p["out"]["w"] + p["out"]["b"], p["norm1"])
        f = jax.nn.gelu(h @ p["ff1"]["w"] + p["ff1"]["b"]) @ p["ff2"]["w"] + p["ff2"]["b"]
        return norm(h + f, p["norm2"])

    def loss(p, batch):
        tokens, y = batch
        h = p["embed"][tokens] + p["pos"]
        for i in range(blocks):
            h = block(h, p[f"block{i}"])
        return xent(h.mean(1) @ p["head"]["w"] + p["head"]["b"], y)

    def layer_norm():
        return {"scale": jnp.ones(d, jnp.float32), "bias": jnp.zeros(d, jnp.float32)}

    params = {"embed": jnp.asarray(rng.normal(size=(vocab, d)) / 10, jnp.float32),
              "pos": jnp.asarray(rng.normal(size=(seq, d)) / 10, jnp.float32),
              "head": dense(rng, d, classes)}
    for i in range(blocks):
        params[f"block{i}"] = {"qkv": dense(rng, d, 3 * d), "out": dense(rng, d, d),
                               "ff1": dense(rng, d, 4 * d), "ff2": dense(rng, 4 * d, d),
                               "norm1": layer_norm(), "norm2": layer_norm()}

    def data(n):
        return (rng.integers(0, vocab, size=(n, seq)).astype(np.int32),
                rng.integers(0, classes, size=n).astype(np.int32))

    return loss, params, data, 32


WORKLOADS = {"cnn": cnn, "mlp": mlp, "transformer": transformer}
DEFAULT_ROUNDS = {"cnn": 3, "mlp": 40, "transformer": 3}


def timed(fn):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def run(name, rounds, steps, method, seed=0):
    rng = np.random.default_rng(seed)
    loss_fn, params, make_data, size = WORKLOADS[name](rng)
    n = 100 * size
    data = make_data(n)
    fixed = jax.tree_util.tree_map(lambda a: jnp.asarray(a[:size]), data)
    optimizer = optax.sgd(0.05)

    @jax.jit
    def plain_step(params, opt_state, batch):
        grads = jax.grad(lambda p: jnp.mean(loss_fn(p, batch)))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    aggregator = dpcore.PrivateAggregator(dpcore.flat(leaf_names(params), 1.0, 1.0), n=n,
                                          q=size / n, backend="jax", seed=seed,
                                          on_nonfinite="drop")
    private_step = PrivateStep(loss_fn, optimizer, aggregator, method=method)
    batches = PoissonBatches(data, aggregator)
    plain = {"params": params, "state": optimizer.init(params)}
    dp = {"params": params, "state": private_step.init(params)}

    def plain_once():
        plain["params"], plain["state"] = plain_step(plain["params"], plain["state"], fixed)
        return plain["params"]

    def fresh_batch():
        rows = np.sort(rng.choice(n, size, replace=False))
        return jax.tree_util.tree_map(lambda a: a[rows], data)

    ahead = [fresh_batch()]

    def plain_fresh_once():  # a new random batch of B rows per step, gathered on the host
        plain["params"], plain["state"] = plain_step(plain["params"], plain["state"], ahead[0])
        ahead[0] = fresh_batch()  # the next one, while the device computes (as train() does)
        return plain["params"]

    def dp_once():  # as dpcore_jax.train runs a step
        batch, mask = batches.next()
        dp["params"], dp["state"] = private_step(dp["params"], dp["state"], batch, mask)
        batches.prefetch()
        return dp["params"]

    def pipelined(fn):  # per step of `steps` dispatched back to back, waited for once
        start = time.perf_counter()
        for _ in range(steps):
            out = fn()
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / steps

    timed(plain_once)
    timed(plain_fresh_once)
    compile_time = timed(dp_once)
    times = {kind: {"blocked": [], "pipelined": []} for kind in ("plain", "fresh", "dp")}
    compiles = [1]

    def dp_timed(measure, mode):  # DP steps that compiled a new bucket are not timed
        before = private_step.compiled_shapes()
        t = measure(dp_once)
        if private_step.compiled_shapes() > before:
            compiles[0] += 1
        else:
            times["dp"][mode].append(t)

    for _ in range(rounds):
        times["plain"]["blocked"] += [timed(plain_once) for _ in range(steps)]
        times["plain"]["pipelined"].append(pipelined(plain_once))
        times["fresh"]["blocked"] += [timed(plain_fresh_once) for _ in range(steps)]
        times["fresh"]["pipelined"].append(pipelined(plain_fresh_once))
        for _ in range(steps):
            dp_timed(timed, "blocked")
        dp_timed(pipelined, "pipelined")
    result = {"workload": name, "batch": size, "dp_steps_timed": len(times["dp"]["blocked"]),
              "compiles": compiles[0], "first_compile_s": compile_time}
    for mode in ("blocked", "pipelined"):
        # nan when every DP step of a mode compiled a new bucket (a short run)
        a, f, b = (statistics.median(times[k][mode] or [math.nan])
                   for k in ("plain", "fresh", "dp"))
        result[mode] = {"plain_ms": 1e3 * a, "dp_ms": 1e3 * b, "ratio": b / a,
                        "fresh_ms": 1e3 * f, "fresh_ratio": b / f}
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds per workload (default: 3, the MLP 40)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--method", default="ghost", choices=["ghost", "vmap"])
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, {os.cpu_count()} CPUs, load average "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}, method {args.method}")
    print(f"{'workload':<12}{'B':>5}{'mode':>10}{'non-private ms':>16}{'DP ms':>10}{'ratio':>8}"
          f"{'fresh ms':>10}{'ratio':>8}{'timed':>7}{'compiles':>10}")
    for name in args.workloads:
        r = run(name, args.rounds or DEFAULT_ROUNDS[name], args.steps, args.method)
        for mode in ("blocked", "pipelined"):
            m = r[mode]
            print(f"{r['workload']:<12}{r['batch']:>5}{mode:>10}{m['plain_ms']:>16.2f}"
                  f"{m['dp_ms']:>10.2f}{m['ratio']:>7.2f}x{m['fresh_ms']:>10.2f}"
                  f"{m['fresh_ratio']:>7.2f}x{r['dp_steps_timed']:>7}{r['compiles']:>10}",
                  flush=True)
    print(f"load average after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
