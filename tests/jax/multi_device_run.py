"""Run by tests/jax/test_jax_multi_device.py in a process of its own, with the CPU split into
two XLA devices (XLA_FLAGS must be set before JAX starts): private steps on batches spread
over both devices against the same steps on one device. Prints one JSON object."""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec  # noqa: E402

import dpcore  # noqa: E402
from dpcore_jax import (Buckets, PoissonBatches, clipped_sums, leaf_names,  # noqa: E402
                        private_grad, private_optimizer, train)

N = 400
BUCKETS = Buckets(N * 0.1, granularity=32)  # 32 or 64 rows: few programs to compile
SHARDED = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data"))


def loss_fn(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return -jax.nn.log_softmax(h @ params["w2"])[jnp.arange(len(y)), y]


def zero_loss(params, batch):
    return loss_fn(params, batch) * 0.0


rng = np.random.default_rng(0)
PARAMS = {"w1": jnp.asarray(rng.normal(size=(6, 64)), jnp.float32), "b1": jnp.zeros(64),
          "w2": jnp.asarray(rng.normal(size=(64, 3)), jnp.float32)}
DATA = (rng.normal(size=(N, 6)).astype(np.float32), rng.integers(0, 3, N).astype(np.int32))


def aggregator(**options):
    options.setdefault("seed", 0)
    return dpcore.PrivateAggregator(dpcore.flat(leaf_names(PARAMS), 0.5, 1.1), n=N, q=0.1,
                                    backend="jax", **options)


def largest_difference(a, b) -> float:
    return max(float(jnp.abs(a[k] - b[k]).max()) for k in a)


def events(agg):
    return [repr(e) for e in agg.ledger.events]


def grads_and_noise() -> dict:
    out = {}
    results = {}
    for name, sharding in (("one", None), ("two", SHARDED)):  # other paddings, same rows
        agg = aggregator()
        pg = private_grad(loss_fn, agg)
        results[name] = ([pg(PARAMS, b, m) for b, m in
                          PoissonBatches(DATA, agg, steps=3, buckets=BUCKETS,
                                         sharding=sharding)], events(agg))
    out["grad_difference"] = max(largest_difference(a, b) for a, b in
                                 zip(results["one"][0], results["two"][0]))
    out["grad_events_equal"] = results["one"][1] == results["two"][1]
    out["grad_replicated"] = all(g.sharding.is_fully_replicated
                                 for g in results["two"][0][0].values())
    agg = aggregator(secure=True, seed=None)  # host normals, as an input of the step
    pg = private_grad(zero_loss, agg)
    noise = [jnp.concatenate([g.ravel() for g in pg(PARAMS, b, m).values()]) * agg.expected_size
             for b, m in PoissonBatches(DATA, agg, steps=20, buckets=BUCKETS, sharding=SHARDED)]
    out["secure_noise"] = np.asarray(jnp.stack(noise)).ravel().tolist()
    return out


def batches() -> dict:
    agg = aggregator()
    sizes, spread = [], []
    for batch, mask in PoissonBatches(DATA, agg, steps=20, sharding=SHARDED):
        sizes.append(int(mask.shape[0]))
        spread.append(len(batch[0].addressable_shards) == 2 and
                      batch[0].sharding.spec == PartitionSpec("data"))
    return {"sizes": sizes, "spread": all(spread)}


def training() -> dict:
    out = {}
    for chunk, buckets in ((None, BUCKETS), (8, None)):  # (8: buckets of 8 rows, lcm(8, 2))
        runs = {}
        for name, sharding in (("one", None), ("two", SHARDED)):
            agg = aggregator()
            params, _ = train(loss_fn, PARAMS, DATA, agg, optax.sgd(0.5, momentum=0.6),
                              steps=5, chunk_size=chunk, buckets=buckets, sharding=sharding)
            runs[name] = (params, events(agg))
        out[f"train_difference_{chunk}"] = largest_difference(runs["one"][0], runs["two"][0])
        out[f"train_events_equal_{chunk}"] = runs["one"][1] == runs["two"][1]
    return out


def explicit_mesh() -> dict:
    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,))
    try:
        PoissonBatches(DATA, aggregator(), sharding=NamedSharding(mesh, PartitionSpec("data")))
    except ValueError as error:
        return {"explicit_mesh": str(error)}
    return {"explicit_mesh": None}


def psum_over_devices(sums_fn):
    """``sums_fn`` run on each device's rows under ``shard_map``, its ClippedSums added up
    over the devices by ``psum``: the pattern the refusal of the optax route under shard_map
    advises."""
    def per_device(params, batch, mask):
        return jax.lax.psum(sums_fn(params, batch, mask), "data")

    return jax.shard_map(per_device, mesh=SHARDED.mesh, out_specs=PartitionSpec(),
                         in_specs=(PartitionSpec(), PartitionSpec("data"),
                                   PartitionSpec("data")), check_vma=False)


def optax_route() -> dict:
    """Also ("psum") with the clipped sums of each device's rows added up by psum under
    shard_map and the update outside it."""
    runs = {}
    for name, sharding in (("one", None), ("two", SHARDED), ("psum", SHARDED)):
        agg = aggregator()
        opt = private_optimizer(optax.sgd(0.5), agg, accumulation_steps=2)
        sums_fn = clipped_sums(loss_fn, agg.mechanism)
        if name == "psum":
            sums_fn = psum_over_devices(sums_fn)
        params = jax.device_put(PARAMS, NamedSharding(SHARDED.mesh, PartitionSpec()))
        state = opt.init(params)

        @jax.jit
        def micro_step(params, state, batch, mask):
            updates, state = opt.update(sums_fn(params, batch, mask), state, params)
            return optax.apply_updates(params, updates), state

        for parts in PoissonBatches(DATA, agg, splits=2, steps=4, buckets=BUCKETS,
                                    sharding=sharding):
            for batch, mask in parts:
                params, state = jax.block_until_ready(micro_step(params, state, batch, mask))
        jax.block_until_ready(params)
        runs[name] = (params, events(agg))
    return {"optax_difference": largest_difference(runs["one"][0], runs["two"][0]),
            "optax_events_equal": runs["one"][1] == runs["two"][1],
            "optax_events": len(runs["two"][1]),
            "psum_difference": largest_difference(runs["one"][0], runs["psum"][0]),
            "psum_events_equal": runs["one"][1] == runs["psum"][1]}


def manual_axes() -> dict:
    """The optax route's update traced under shard_map or pmap over both devices: refused
    (every device would write the events and draw noise), nothing recorded."""
    out = {}
    for k in (1, 2):
        agg = aggregator()
        opt = private_optimizer(optax.sgd(0.5), agg, accumulation_steps=k)
        sums_fn = clipped_sums(loss_fn, agg.mechanism)
        state = opt.init(PARAMS)
        batch, mask = next(iter(PoissonBatches(DATA, agg, steps=1, buckets=BUCKETS)))

        def update(params, batch, mask):
            return opt.update(sums_fn(params, batch, mask), state, params)[0]

        split = jax.tree_util.tree_map(lambda a: a.reshape(2, -1, *a.shape[1:]), (batch, mask))
        for how, run in (
                ("shard_map", lambda: jax.jit(jax.shard_map(
                    update, mesh=SHARDED.mesh, out_specs=PartitionSpec(),
                    in_specs=(PartitionSpec(), PartitionSpec("data"), PartitionSpec("data")),
                    check_vma=False))(PARAMS, batch, mask)),
                ("pmap", lambda: jax.pmap(update, in_axes=(None, 0, 0))(PARAMS, *split))):
            try:
                run()
                out[f"{how}_{k}"] = None
            except RuntimeError as error:
                out[f"{how}_{k}"] = str(error)
        out[f"manual_events_{k}"] = [type(e).__name__ for e in agg.ledger.events]
    return out


def secure_optax() -> dict:
    """A secure aggregator's optax route, its sums spread over both devices: the update is
    the host's normals times -lr sigma~ / (q n) (zero gradients)."""
    agg = aggregator(secure=True, seed=None)
    draws, draw = [], agg.rng.standard_normal
    agg.rng.standard_normal = lambda size: draws.append(draw(size)) or draws[-1]
    opt = private_optimizer(optax.sgd(0.5), agg)
    sums_fn = clipped_sums(zero_loss, agg.mechanism)
    params = jax.device_put(PARAMS, NamedSharding(SHARDED.mesh, PartitionSpec()))
    state = opt.init(params)
    update = jax.jit(lambda params, state, batch, mask: opt.update(
        sums_fn(params, batch, mask), state, params)[0])
    moves = []
    for batch, mask in PoissonBatches(DATA, agg, steps=2, buckets=BUCKETS, sharding=SHARDED):
        moves.append(np.concatenate([np.ravel(leaf) for leaf in  # b1, w1, w2: the draw's order
                                     jax.tree_util.tree_leaves(update(params, state, batch,
                                                                      mask))]))
    expected = [-0.5 * 0.55 * z / agg.expected_size for z in draws]
    return {"secure_optax_draws": len(draws),
            "secure_optax_difference": max(float(np.abs(m - e).max())
                                           for m, e in zip(moves, expected))}


if __name__ == "__main__":
    assert len(jax.devices()) == 2
    print(json.dumps({**grads_and_noise(), **batches(), **training(), **explicit_mesh(),
                      **optax_route(), **secure_optax(), **manual_axes()}))
