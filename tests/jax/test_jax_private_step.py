"""Private steps end to end: ledger before release, the noise the ledger states, noise once per
logical batch under accumulation, the public denominator, bounded recompilation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dpcore
from dpcore.aggregation import NonFiniteNormError
from dpcore.ledger import SamplingEvent, SumQueryEvent
import dpcore_jax
from dpcore_jax import (Buckets, PoissonBatches, PrivateStep, clipped_sums, drop_parts,
                        leaf_names, leaf_sizes, private_aggregate, private_grad,
                        private_optimizer, train)
from dpcore_jax.batching import pad

import jax_models as models


def aggregator(mechanism, n, q, **kwargs):
    return dpcore.PrivateAggregator(mechanism, n=n, q=q, backend="jax", **kwargs)


def wide_model(rng):
    """A linear model with a 20,000-entry weight, so one step gives many noise draws."""
    params = {"w": jnp.asarray(rng.normal(size=(200, 100)) / 20, jnp.float32),
              "b": jnp.zeros(100, jnp.float32)}

    def loss(p, batch):
        x, y = batch
        return models.xent(x @ p["w"] + p["b"], y)

    return loss, params


def test_zero_noise_and_a_large_clip_give_the_non_private_mean_gradient():
    rng = np.random.default_rng(0)
    loss_fn, params = models.model(rng, "transformer")
    batch = models.data(rng, "transformer", 16)
    agg = aggregator(dpcore.flat(leaf_names(params), 1e6, 0.0), n=160, q=0.1, seed=0)
    agg.sample()
    grads = private_grad(loss_fn, agg)(params, batch)
    expected = jax.grad(lambda p: jnp.mean(loss_fn(p, batch)))(params)  # q n = 16 = B
    for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6 * float(jnp.abs(b).max()))


def test_the_denominator_is_q_n_not_the_realised_size():
    rng = np.random.default_rng(1)
    loss_fn, params = models.model(rng, "logistic")
    x, y = models.data(rng, "logistic", 10)
    agg = aggregator(dpcore.flat(leaf_names(params), 1e6, 0.0), n=100, q=0.25, seed=0)
    agg.sample()
    batch, mask = pad((x, y), np.arange(10), 16)
    grads = private_grad(loss_fn, agg)(params, batch, mask)
    total = jax.grad(lambda p: jnp.sum(loss_fn(p, (x, y))))(params)
    np.testing.assert_allclose(grads["w"], total["w"] / 25.0, rtol=2e-5)


def test_a_mask_of_other_values_than_booleans_or_0_1_is_refused_before_the_ledger():
    """The compiled program reads the mask as booleans: weights of 0.5 counted as records."""
    rng = np.random.default_rng(1)
    loss_fn, params = models.model(rng, "logistic")
    x, y = models.data(rng, "logistic", 4)
    agg = aggregator(dpcore.flat(leaf_names(params), 1.0, 1.0), n=100, q=0.04, seed=0)
    agg.sample()
    weights = np.array([1.0, 0.5, 0.5, 0.0])
    with pytest.raises(ValueError, match=r"booleans or 0/1 .* got \[0.5, 0.5\]"):
        private_grad(loss_fn, agg)(params, (x, y), weights)
    with pytest.raises(ValueError, match=r"booleans or 0/1 .* got \[0.5, 0.5\]"):
        PrivateStep(loss_fn, optax.sgd(0.1), agg)(params, optax.sgd(0.1).init(params), (x, y),
                                                  jnp.asarray(weights))
    assert [type(e) for e in agg.ledger.events] == [SamplingEvent]
    private_grad(loss_fn, agg)(params, (x, y), np.array([1.0, 1.0, 0.0, 0.0]))  # 0/1 floats


def test_a_mask_traced_with_another_dtype_than_bool_is_refused():
    """Inside the user's jit the mask's values cannot be read, and a float mask of weights
    0.5 counted each weighted record as a whole one (the sums were those of mask > 0):
    refused at tracing. Given on the host, 0/1 numbers still work (turned into booleans)."""
    rng = np.random.default_rng(1)
    loss_fn, params = models.model(rng, "logistic")
    x, y = models.data(rng, "logistic", 4)
    mechanism = dpcore.flat(leaf_names(params), 1.0, 1.0)
    sums_fn = jax.jit(clipped_sums(loss_fn, mechanism))
    for mask in (jnp.array([1.0, 0.5, 0.5, 0.0]), jnp.array([1, 1, 0, 0])):
        with pytest.raises(TypeError, match=f"traced with dtype {mask.dtype}.* read it as "
                                            f"booleans"):
            sums_fn(params, (x, y), mask)
    ones = np.array([1.0, 1.0, 0.0, 0.0])
    by_bool = sums_fn(params, (x, y), ones > 0).sums
    agg = aggregator(dpcore.flat(leaf_names(params), 1.0, 0.0), n=100, q=0.04, seed=0)
    agg.sample()
    step = PrivateStep(loss_fn, optax.sgd(0.1), agg)
    step(params, step.init(params), (x, y), jnp.asarray(ones))  # 0/1 floats, on the host
    agg.sample()
    grads = dpcore.get_backend("jax").private_gradient(loss_fn, params, (x, y), agg, mask=ones)
    for leaf, g in dpcore_jax.named_leaves(by_bool).items():
        np.testing.assert_allclose(grads[leaf], g / agg.expected_size, rtol=1e-6)


@pytest.fixture(params=["in the step", "separate"])
def noise_drawn(request, monkeypatch):
    """Both places a compiled step's noise is drawn (dpcore_jax.noise.NoiseSource)."""
    from dpcore_jax import noise

    monkeypatch.setattr(noise, "SEPARATE_DRAW", 0 if request.param == "separate" else 2 ** 62)
    return request.param


def test_noise_std_matches_the_ledger(tmp_path, noise_drawn):
    rng = np.random.default_rng(2)
    loss_fn, params = wide_model(rng)
    mechanism = dpcore.Mechanism((dpcore.Group("w", ("w",), clip=1.0, noise_std=2.0),
                                  dpcore.Group("b", ("b",), clip=0.5, noise_std=1.5,
                                               scales=(3.0,))))
    agg = aggregator(mechanism, n=400, q=0.05, seed=11, ledger=tmp_path / "run.jsonl")
    x = rng.normal(size=(400, 200)).astype(np.float32)
    y = rng.integers(0, 100, size=400)
    step = private_grad(loss_fn, agg)
    sums_fn = jax.jit(clipped_sums(loss_fn, mechanism))
    noise = {"w": [], "b": []}
    for batch, mask in PoissonBatches((x, y), agg, steps=10):
        grads = step(params, batch, mask)
        sums, _ = sums_fn(params, batch, mask)
        for leaf in noise:  # noise on the sum = released mean * q n - clipped sum
            noise[leaf].append(np.ravel(grads[leaf] * agg.expected_size - sums[leaf]))
    agg.ledger.close()
    queries = {e.group: e for e in dpcore.read_ledger(tmp_path / "run.jsonl").events
               if isinstance(e, SumQueryEvent)}
    expected = {"w": queries["w"].noise_std, "b": 3.0 * queries["b"].noise_std}  # alpha sigma~
    for leaf, std in expected.items():
        draws = np.concatenate(noise[leaf])
        # relative standard error of a sample std is 1/sqrt(2 N): 0.16% for "w" (N = 200,000),
        # 2.2% for "b" (N = 1,000); tolerance 4.5 standard errors + 0.5% float32 slack, so a
        # 10% error in the noise is caught on both leaves.
        tol = 4.5 / np.sqrt(2 * draws.size) + 0.005
        assert np.std(draws) == pytest.approx(std, rel=tol), leaf
        assert abs(np.mean(draws)) < 5 * std / np.sqrt(draws.size)
    first, second = noise["w"][0], noise["w"][1]
    assert abs(np.corrcoef(first, second)[0, 1]) < 5 / np.sqrt(first.size)  # fresh every step


def test_noise_drawn_separately_is_the_noise_drawn_in_the_step(monkeypatch):
    """A large model's noise comes from a program of its own: the same draws from the same
    keys as inside the step, so the released gradients and the next key are the same."""
    from dpcore_jax import noise

    rng = np.random.default_rng(7)
    loss_fn, params = wide_model(rng)
    x = rng.normal(size=(400, 200)).astype(np.float32)
    y = rng.integers(0, 100, size=400)
    mechanism = dpcore.per_layer(leaf_sizes(params), 1.0, 1.5)
    runs = {}
    for where, threshold in (("step", 2 ** 62), ("separate", 0)):
        monkeypatch.setattr(noise, "SEPARATE_DRAW", threshold)
        agg = aggregator(mechanism, n=400, q=0.05, seed=3)
        grads = [private_grad(loss_fn, agg)(params, *sample)
                 for sample in PoissonBatches((x, y), agg, steps=2)]
        trained, _ = train(loss_fn, params, (x, y), agg, optax.sgd(0.1), steps=2)
        runs[where] = (grads, trained, jax.random.key_data(agg.rng))
    for a, b in zip(*(jax.tree_util.tree_leaves(run) for run in runs.values())):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert noise.NoiseSource(mechanism).plan(params) == (((20_100,), jnp.float32),)


def test_ledger_has_each_step_before_its_result_and_seeds_reproduce():
    rng = np.random.default_rng(3)
    loss_fn, params = models.model(rng, "mlp")
    x, y = models.data(rng, "mlp", 200)

    def run(seed):
        agg = aggregator(dpcore.per_layer(leaf_sizes(params), 1.0, 1.0), n=200, q=0.1, seed=seed)
        seen = []
        out, _ = train(loss_fn, params, (x, y), agg, optax.sgd(0.1), steps=3,
                       callback=lambda t, p: seen.append(len(agg.ledger.events)))
        return agg, seen, out

    agg, seen, out = run(4)
    groups = len(agg.mechanism.groups)
    assert seen == [(1 + groups) * (t + 1) for t in range(3)]
    kinds = [type(e) for e in agg.ledger.events]
    assert kinds == ([SamplingEvent] + [SumQueryEvent] * groups) * 3
    assert agg.ledger.steps() == [dpcore.Step(0.1, pytest.approx(1.0), 3)]
    _, _, again = run(4)
    _, _, other = run(5)
    for a, b, c in zip(*map(jax.tree_util.tree_leaves, (out, again, other))):
        np.testing.assert_array_equal(a, b)
        assert not np.allclose(a, c)


def test_train_in_chunks_pads_every_sample_to_whole_chunks():
    """chunk_size m: the buckets are multiples of m (a bucket of 21 rows in chunks of 8 would
    not split), and chunked steps equal the unchunked ones."""
    rng = np.random.default_rng(14)
    loss_fn, params = models.model(rng, "mlp")
    x, y = models.data(rng, "mlp", 200)
    results = []
    for chunk_size in (None, 8):
        agg = aggregator(dpcore.flat(leaf_names(params), 1.0, 1.0), n=200, q=0.1, seed=3)
        out, _ = train(loss_fn, params, (x, y), agg, optax.sgd(0.1), steps=3,
                       chunk_size=chunk_size)
        results.append(out)
    for a, b in zip(*map(jax.tree_util.tree_leaves, results)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    agg = aggregator(dpcore.flat(leaf_names(params), 1.0, 1.0), n=200, q=0.1, seed=3)
    with pytest.raises(ValueError, match=r"Buckets\(granularity=20\) pads batches to sizes "
                                         r"chunk_size=8 does not divide"):
        train(loss_fn, params, (x, y), agg, optax.sgd(0.1), steps=3, chunk_size=8,
              buckets=Buckets(20, 0.1, granularity=20))
    assert agg.ledger.events == ()  # refused before the first sample was drawn


def test_train_continues_from_an_optimizer_state_and_stops_at_the_budget():
    """Two runs of 2 steps, the second given the first's Adam state, are the run of 4 (the
    state was re-initialised); under a budget train returns what the steps it could afford
    made (it raised, losing them), and those steps fit the budget."""
    rng = np.random.default_rng(15)
    loss_fn, params = models.model(rng, "mlp")
    x, y = models.data(rng, "mlp", 200)
    mechanism = dpcore.flat(leaf_names(params), 1.0, 1.0)
    agg = aggregator(mechanism, n=200, q=0.1, seed=5)
    whole, _ = train(loss_fn, params, (x, y), agg, optax.adam(0.05), steps=4)
    agg = aggregator(mechanism, n=200, q=0.1, seed=5)
    half, state = train(loss_fn, params, (x, y), agg, optax.adam(0.05), steps=2)
    halves, _ = train(loss_fn, half, (x, y), agg, optax.adam(0.05), steps=2, opt_state=state)
    for a, b in zip(jax.tree_util.tree_leaves(whole), jax.tree_util.tree_leaves(halves)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)

    budget = dpcore.PrivacyBudget(target_epsilon=3.0, delta=1e-5)  # 11 steps
    agg = aggregator(mechanism, n=200, q=0.1, seed=5, budget=budget)
    seen = []
    out, _ = train(loss_fn, params, (x, y), agg, optax.sgd(0.1), steps=10_000,
                   callback=lambda t, p: seen.append(p))
    taken = sum(s.count for s in agg.ledger.steps())
    assert taken == len(seen) == 11
    assert dpcore.accounting.epsilon(agg.ledger, 1e-5) <= 3.0
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(seen[-1])):
        np.testing.assert_array_equal(a, b)


def test_train_called_again_and_a_new_step_reuse_the_compiled_shapes():
    """Every train() call and every PrivateStep made a new jitted step and compiled each
    bucket again: train called an epoch at a time (20 steps of the MLP benchmark) took 5-7 s
    a call, nearly all of it compiling. The program is now kept per loss and configuration;
    another optimizer gets its own."""
    rng = np.random.default_rng(17)
    loss_fn, params = models.model(rng, "mlp")
    x, y = models.data(rng, "mlp", 200)
    agg = aggregator(dpcore.flat(leaf_names(params), 1.0, 1.0), n=200, q=0.1, seed=6)
    opt = optax.sgd(0.1)
    one_bucket = Buckets(20, 0.1, granularity=64)  # samples of 20 +- 4.2 rows: all in 64
    state = None
    for _ in range(2):
        params, state = train(loss_fn, params, (x, y), agg, opt, steps=2, opt_state=state,
                              buckets=one_bucket)
    assert PrivateStep(loss_fn, opt, agg).compiled_shapes() == 1
    assert PrivateStep(loss_fn, optax.sgd(0.1), agg).compiled_shapes() == 0
    assert len(agg.ledger.events) == 8


def test_train_refused_for_a_nan_record_hands_back_the_last_released_state():
    rng = np.random.default_rng(16)
    loss_fn, params = models.model(rng, "mlp")
    x, y = models.data(rng, "mlp", 100)
    x[:, 0] = np.where(np.arange(100) == 37, np.inf, x[:, 0])  # record 37
    agg = aggregator(dpcore.flat(leaf_names(params), 1.0, 1.0), n=100, q=0.2, seed=1)
    seen = []
    with pytest.raises(NonFiniteNormError) as raised:
        train(loss_fn, params, (x, y), agg, optax.sgd(0.1), steps=100,
              callback=lambda t, p: seen.append(p))
    last = seen[-1] if seen else params
    for a, b in zip(jax.tree_util.tree_leaves(raised.value.params),
                    jax.tree_util.tree_leaves(last)):
        np.testing.assert_array_equal(a, b)
    assert raised.value.opt_state is not None


def test_leaves_that_cannot_be_differentiated_are_refused_before_a_step():
    """A Flax nnx state split whole holds PRNG keys and counters: named, nothing recorded
    (it failed mid-step on a key dtype, after the sampling event)."""
    rng = np.random.default_rng(17)
    loss_fn, params = models.model(rng, "mlp")
    x, y = models.data(rng, "mlp", 100)
    state = {**params, "count": jnp.zeros((), jnp.uint32)}
    agg = aggregator(dpcore.flat(leaf_names(state), 1.0, 1.0), n=100, q=0.2, seed=1)
    with pytest.raises(TypeError, match=r"leaves \['count'\] are not"):
        train(lambda p, b: loss_fn({k: p[k] for k in params}, b), state, (x, y), agg,
              optax.sgd(0.1), steps=2)
    assert agg.ledger.events == ()


def test_prefetch_draws_the_same_samples_and_writes_each_sampling_event_when_its_step_begins():
    rng = np.random.default_rng(12)
    x, y = models.data(rng, "mlp", 300)

    def batches(seed):
        agg = aggregator(dpcore.flat(["w"], 1.0, 1.0), n=300, q=0.1, seed=seed)
        return agg, PoissonBatches((x, y), agg)

    plain_agg, plain = batches(6)
    agg, ahead = batches(6)
    for _ in range(4):
        expected_batch, expected_mask = plain.next()
        ahead.prefetch()
        ahead.prefetch()  # a second call draws nothing more
        events = len(agg.ledger.events)
        (got_x, got_y), got_mask = ahead.next()
        assert len(agg.ledger.events) == events + 1
        assert isinstance(agg.ledger.events[-1], SamplingEvent)
        np.testing.assert_array_equal(got_mask, expected_mask)
        np.testing.assert_array_equal(got_x, expected_batch[0])
        np.testing.assert_array_equal(got_y, expected_batch[1])
    assert len(agg.ledger.events) == len(plain_agg.ledger.events) == 4


def test_raise_policy_releases_nothing_and_drop_policy_continues():
    rng = np.random.default_rng(4)
    loss_fn, params = models.model(rng, "mlp")
    x, y = models.data(rng, "mlp", 8)
    x[3] = np.nan
    for policy in ("raise", "drop"):
        agg = aggregator(dpcore.flat(leaf_names(params), 1.0, 1.0), n=80, q=0.1, seed=0,
                         on_nonfinite=policy)
        agg.sample()
        step = private_grad(loss_fn, agg)
        if policy == "raise":
            with pytest.raises(NonFiniteNormError, match="1 record"):
                step(params, (x, y))
            assert not any(isinstance(e, SumQueryEvent) for e in agg.ledger.events)
        else:
            grads = step(params, (x, y))
            assert all(np.all(np.isfinite(g)) for g in jax.tree_util.tree_leaves(grads))
            assert isinstance(agg.ledger.events[-1], SumQueryEvent)


def test_an_optax_state_restored_from_a_checkpoint_draws_new_noise():
    """A state saved after step 0 and restored after step 1 was released (a crash after
    the checkpoint): the ledger's next step gets other noise than step 1 had, though the
    state's key is the one step 1 drew from (equal noise would cancel in the difference
    of the two releases)."""
    mechanism = dpcore.flat(["w"], 1.0, 1.0)
    agg = aggregator(mechanism, n=100, q=0.1, seed=4)
    opt = private_aggregate(agg)
    zeros = dpcore_jax.ClippedSums({"w": jnp.zeros(1000)}, jnp.zeros((), jnp.int32))
    update = jax.jit(lambda state: opt.update(zeros, state))
    state = opt.init({"w": jnp.zeros(1000)})
    noises = []
    for _ in range(2):
        agg.begin_step()
        noise, state = update(state)
        noises.append(np.asarray(noise["w"]))
        if not noises[1:]:
            checkpoint = state
    agg.begin_step()
    again = np.asarray(update(checkpoint)[0]["w"])  # step 1's key, at the ledger's step 2
    assert agg.ledger.samplings == 3
    assert np.std(again) == pytest.approx(np.std(noises[1]), rel=0.15)  # noise of step 2's std
    assert np.abs(np.corrcoef(again, noises[1])[0, 1]) < 0.15  # and independent of step 1's


def test_two_sessions_resuming_one_optax_state_draw_different_noise():
    """Unseeded, the noise was a function of the state's key and the ledger's index alone:
    two sessions resuming one checkpoint (a crash and its restart, a sweep's branches) drew
    the same noise at the same step, and the difference of their releases was noise-free."""
    mechanism = dpcore.flat(["w"], 1.0, 1.0)
    zeros = dpcore_jax.ClippedSums({"w": jnp.zeros(1000)}, jnp.zeros((), jnp.int32))
    state = private_aggregate(aggregator(mechanism, n=100, q=0.1)).init({"w": jnp.zeros(1000)})
    releases = []
    for _ in range(2):  # each session: its aggregator (OS entropy), its ledger at step 0
        agg = aggregator(mechanism, n=100, q=0.1)
        opt = private_aggregate(agg)
        agg.begin_step()
        releases.append(np.asarray(opt.update(zeros, state)[0]["w"]))
    assert np.abs(np.corrcoef(*releases)[0, 1]) < 0.15


@pytest.mark.parametrize("made_secure", [False, True])
def test_a_state_made_for_the_other_kind_of_aggregator_is_refused(made_secure):
    """A state holding a key, restored under a secure aggregator, drew its noise from that
    key (predictable from the checkpoint) instead of the host's secure generator."""
    mechanism = dpcore.flat(["w"], 1.0, 1.0)
    made = (aggregator(mechanism, n=100, q=0.1, secure=True) if made_secure
            else aggregator(mechanism, n=100, q=0.1, seed=1))
    state = private_aggregate(made).init({"w": jnp.zeros(10)})
    agg = (aggregator(mechanism, n=100, q=0.1, seed=1) if made_secure
           else aggregator(mechanism, n=100, q=0.1, secure=True))
    opt = private_aggregate(agg)
    agg.begin_step()
    zeros = dpcore_jax.ClippedSums({"w": jnp.zeros(10)}, jnp.zeros((), jnp.int32))
    with pytest.raises(ValueError, match="init the state again with this aggregator"):
        opt.update(zeros, state)
    assert agg.ledger.events == (SamplingEvent(0.1, 100),)


@pytest.mark.parametrize("secure", [False, True])
def test_optax_transformation_adds_noise_once_per_logical_batch(secure, record_normals):
    """Also with a secure aggregator, whose normals the compiled update fetches from the host
    at each release: the update is then exactly the sums plus 3 times those normals."""
    rng = np.random.default_rng(5)
    loss_fn, params = wide_model(rng)
    mechanism = dpcore.flat(["b", "w"], 1.0, 3.0)
    agg = (aggregator(mechanism, n=400, q=0.1, secure=True) if secure else
           aggregator(mechanism, n=400, q=0.1, seed=6))
    drawn = record_normals(agg) if secure else None
    x = rng.normal(size=(400, 200)).astype(np.float32)
    y = rng.integers(0, 100, size=400)
    k = 4
    sums_fn = clipped_sums(loss_fn, mechanism)
    opt = private_optimizer(optax.sgd(1.0), agg, accumulation_steps=k)
    state = opt.init(params)

    @jax.jit
    def micro_step(params, state, batch, mask):
        clipped = sums_fn(params, batch, mask)
        updates, state = opt.update(clipped, state, params)
        return optax.apply_updates(params, updates), state, clipped.sums

    noise = []
    for parts in PoissonBatches((x, y), agg, splits=k, steps=3):
        before, total = params, 0
        for i, (batch, mask) in enumerate(parts):
            params, state, sums = micro_step(params, state, batch, mask)
            total = total + sums["w"]
            moved = not np.array_equal(params["w"], before["w"])
            assert moved == (i == k - 1), i  # only the k-th call releases
        jax.block_until_ready(params)
        # sgd(1): w_new = w - (total + noise) / (q n)
        noise.append(np.ravel((before["w"] - params["w"]) * agg.expected_size - total))
    draws = np.concatenate(noise)
    # one draw of std 3 per logical batch; k draws would give std 3 sqrt(k) = 6 (N = 60,000)
    assert np.std(draws) == pytest.approx(3.0, rel=0.03)
    if secure:
        # one draw a release, over the leaves in the sums' order: b (100 values), then w
        normals = np.concatenate([z[100:] for z in drawn])
        np.testing.assert_allclose(draws, 3 * normals, atol=2e-3)
    kinds = [type(e) for e in agg.ledger.events]
    assert kinds == [SamplingEvent, SumQueryEvent] * 3


def accumulating(seed: int, aggregator_seed: int, inner, k: int, **options):
    """A wide model, an aggregator over 400 records (q = 0.1, on_nonfinite="drop", and
    ``options``), the optax route with accumulation_steps=k around ``inner`` and its jitted
    micro-step: (params, state, micro_step, data, aggregator)."""
    rng = np.random.default_rng(seed)
    loss_fn, params = wide_model(rng)
    mechanism = dpcore.flat(["b", "w"], 1.0, 1.0)
    agg = aggregator(mechanism, n=400, q=0.1, seed=aggregator_seed, on_nonfinite="drop",
                     **options)
    data = (rng.normal(size=(400, 200)).astype(np.float32), rng.integers(0, 100, size=400))
    sums_fn = clipped_sums(loss_fn, mechanism)
    opt = private_optimizer(inner, agg, accumulation_steps=k)

    @jax.jit
    def micro_step(params, state, batch, mask):
        updates, state = opt.update(sums_fn(params, batch, mask), state, params)
        return optax.apply_updates(params, updates), state

    return params, opt.init(params), micro_step, data, agg


@pytest.mark.parametrize("splits, parts_run, released", [(2, 2, 0), (4, 3, 0), (3, 3, 1)])
def test_an_optax_release_summing_two_samples_is_refused(splits, parts_run, released):
    """accumulation_steps=4 over samples split in 2, a sample left after 3 of its 4 parts,
    or accumulation_steps=2 over samples split in 3 (the third part held): the next
    sample's first part would be added to another sample's (a record in both would count
    twice under one step's events). Refused from the program before anything is added."""
    params, state, micro_step, data, agg = accumulating(12, 6, optax.sgd(1.0),
                                                        4 if splits != 3 else 2)
    batches = PoissonBatches(data, agg, splits=splits)
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"part\(s\) of step 0, and a part of step 1"):
        for _ in range(2):
            for batch, mask in batches.next()[:parts_run]:
                params, state = micro_step(params, state, batch, mask)
        jax.block_until_ready(params)
    assert [type(e) for e in agg.ledger.events] == (
        [SamplingEvent] + [SumQueryEvent] * released + [SamplingEvent])


def test_a_resumed_run_refuses_a_part_before_its_first_sample(tmp_path):
    """An aggregator on a ledger that holds steps (a resumed run) has begun none of its own:
    a part before its first sample is refused (it would join the last run's last step);
    its samples are then numbered on from the ledger's."""
    path = tmp_path / "run.jsonl"
    first = aggregator(dpcore.flat(["b", "w"], 1.0, 1.0), n=400, q=0.1, ledger=path)
    first.sample(), first.sample()
    first.ledger.close()
    params, state, micro_step, data, agg = accumulating(14, 8, optax.sgd(1.0), 2,
                                                        ledger=path)
    assert agg.start_step == 2
    with pytest.raises(jax.errors.JaxRuntimeError, match="no sample to release from"):
        jax.block_until_ready(micro_step(params, state, (data[0][:16], data[1][:16]),
                                         jnp.ones(16, bool)))
    for batch, mask in PoissonBatches(data, agg, splits=2).next():
        params, state = micro_step(params, state, batch, mask)
    jax.block_until_ready(params)
    assert agg.step == 2 and [type(e) for e in agg.ledger.events] == (
        [SamplingEvent] * 3 + [SumQueryEvent])
    agg.ledger.close()


def test_drop_parts_goes_on_after_a_refused_part_keeping_the_optimizer_state():
    """A sample left after one of its two parts: the next sample's first part is refused;
    drop_parts on the state from before it drops the held part and keeps Adam's moments, its
    step count and the key, and the next whole sample is released from them."""
    params, state, micro_step, data, agg = accumulating(13, 7, optax.adam(0.1), 2)
    batches = PoissonBatches(data, agg, splits=2)
    for batch, mask in batches.next():  # one whole sample: Adam takes a step
        params, state = micro_step(params, state, batch, mask)
    params, state = micro_step(params, state, *batches.next()[0])  # left part-way
    with pytest.raises(jax.errors.JaxRuntimeError, match="drop_parts"):
        jax.block_until_ready(micro_step(params, state, *batches.next()[0]))
    dropped = drop_parts(state)
    assert int(dropped.count) == 0 and int(dropped.step) == -1
    assert not np.asarray(dropped.sums["w"]).any() and np.asarray(state.sums["w"]).any()
    for kept, old in zip(jax.tree_util.tree_leaves((dropped.inner, jax.random.key_data(
            dropped.key))), jax.tree_util.tree_leaves((state.inner, jax.random.key_data(
                state.key)))):
        np.testing.assert_array_equal(np.asarray(kept), np.asarray(old))
    assert int(dropped.inner[0].count) == 1
    for batch, mask in batches.next():
        params, dropped = micro_step(params, dropped, batch, mask)
    assert int(dropped.inner[0].count) == 2
    kinds = [type(e) for e in agg.ledger.events]
    assert kinds == [SamplingEvent, SumQueryEvent] + [SamplingEvent] * 3 + [SumQueryEvent]


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("policy", ["raise", "drop"])
def test_the_optax_route_follows_the_nonfinite_policy(policy, k):
    """A record with a NaN gradient in the first part of a sample: under "raise" the release
    (at the k-th part) fails before its events are written; under "drop" it is released with
    the record at weight 0. Bare sums cannot carry the count: refused under "raise"."""
    rng = np.random.default_rng(14)
    loss_fn, params = wide_model(rng)
    mechanism = dpcore.flat(["b", "w"], 1.0, 1.0)
    agg = aggregator(mechanism, n=8, q=0.5, seed=1, on_nonfinite=policy)
    x = rng.normal(size=(8, 200)).astype(np.float32)
    x[0, 3] = np.nan
    y = rng.integers(0, 100, size=8)
    sums_fn = clipped_sums(loss_fn, mechanism)
    opt = private_optimizer(optax.sgd(1.0), agg, accumulation_steps=k)
    state = opt.init(params)
    step = jax.jit(lambda p, s, b, m: opt.update(sums_fn(p, b, m), s, p))
    agg.begin_step()
    parts = [((x[:4], y[:4]), np.ones(4, bool)), ((x[4:], y[4:]), np.ones(4, bool))][:k]
    if policy == "raise":
        with pytest.raises(jax.errors.JaxRuntimeError, match="1 record.*NaN or infinite"):
            for batch, mask in parts:
                updates, state = step(params, state, batch, mask)
            updates["w"].block_until_ready()
        assert [type(e) for e in agg.ledger.events] == [SamplingEvent]
        with pytest.raises(TypeError, match="pass the ClippedSums"):
            opt.update(sums_fn(params, *parts[0]).sums, state, params)
        # training goes on with the next sample; the refused sample's parts are dropped
        agg.begin_step()
        x[0, 3] = 0.0
        clean = [((x[:4], y[:4]), np.ones(4, bool)), ((x[4:], y[4:]), np.ones(4, bool))][:k]
        for batch, mask in clean:
            updates, state = step(params, state, batch, mask)
        expected = (sums_fn(params, *clean[0]).sums["w"] if k == 1 else
                    sums_fn(params, *clean[0]).sums["w"] + sums_fn(params, *clean[1]).sums["w"])
        noise = -updates["w"] * agg.expected_size - expected  # sgd(1): -(sums + noise) / (q n)
        assert np.std(noise) == pytest.approx(1.0, rel=0.03)  # the clean parts alone, noised
        assert [type(e) for e in agg.ledger.events] == [SamplingEvent, SamplingEvent,
                                                        SumQueryEvent]
    else:
        for batch, mask in parts:
            updates, state = step(params, state, batch, mask)
        assert np.all(np.isfinite(updates["w"]))
        assert [type(e) for e in agg.ledger.events] == [SamplingEvent, SumQueryEvent]


def test_a_compiled_step_under_a_budget_releases_a_sample_once():
    """The budget priced each step as one release: a second release of the same sample
    through a compiled step is refused before it is recorded, as in the core."""
    rng = np.random.default_rng(13)
    loss_fn, params = models.model(rng, "logistic")
    batch = models.data(rng, "logistic", 8)
    agg = aggregator(dpcore.flat(["b", "w"], 1.0, 2.0), n=80, q=0.1, seed=0,
                     budget=dpcore.PrivacyBudget(8.0, 1e-5, accountant="rdp"))
    step = private_grad(loss_fn, agg)
    agg.sample()
    step(params, batch)
    with pytest.raises(RuntimeError, match="released already"):
        step(params, batch)
    assert [type(e) for e in agg.ledger.events] == [SamplingEvent, SumQueryEvent]


@pytest.mark.parametrize("entry", ["private_grad", "PrivateStep", "backend"])
def test_a_host_side_step_inside_the_users_jit_is_refused(entry):
    """Traced once, it would advance the key and write the ledger once, and every call of
    the cached program would add the same noise: refused, nothing released or recorded, the
    aggregator's key untouched."""
    rng = np.random.default_rng(10)
    loss_fn, params = models.model(rng, "logistic")
    batch = models.data(rng, "logistic", 8)
    agg = aggregator(dpcore.flat(["b", "w"], 1.0, 1.0), n=80, q=0.1, seed=0,
                     on_nonfinite="drop")
    agg.sample()
    key = agg.rng
    if entry == "private_grad":
        call = private_grad(loss_fn, agg)
    elif entry == "PrivateStep":
        step = PrivateStep(loss_fn, optax.sgd(0.1), agg)
        state = step.init(params)
        call = lambda p, b: step(p, state, b)  # noqa: E731
    else:
        call = lambda p, b: dpcore.get_backend("jax").private_gradient(  # noqa: E731
            loss_fn, p, b, agg)
    with pytest.raises(RuntimeError, match="inside jax.jit"):
        jax.jit(call)(params, batch)
    assert agg.rng is key and [type(e) for e in agg.ledger.events] == [SamplingEvent]


def test_the_optax_init_inside_jit_is_refused():
    """A traced init would give every state of its cached program the same noise key."""
    rng = np.random.default_rng(11)
    _, params = models.model(rng, "logistic")
    agg = aggregator(dpcore.flat(["b", "w"], 1.0, 1.0), n=80, q=0.1, seed=0)
    for k in (1, 3):
        opt = private_optimizer(optax.sgd(0.1), agg, accumulation_steps=k)
        key = agg.rng  # after the salt the optimizer split off it
        with pytest.raises(RuntimeError, match="init outside jit"):
            jax.jit(opt.init)(params)
        assert agg.rng is key
    first, second = opt.init(params), opt.init(params)  # outside: distinct keys
    assert not np.array_equal(jax.random.key_data(first.key), jax.random.key_data(second.key))


@pytest.mark.parametrize("k", [1, 3])
def test_optax_multi_steps_around_the_private_optimizer_is_refused(k):
    """MultiSteps runs the wrapped update on every mini-step (the step's events written k
    times) and hands it the parts' mean (1/k of the clipped sum; ClippedSums do not even fit
    its accumulator): refused at init, before any key is split off."""
    rng = np.random.default_rng(12)
    _, params = wide_model(rng)
    agg = aggregator(dpcore.flat(["b", "w"], 1.0, 1.0), n=400, q=0.1, seed=0,
                     on_nonfinite="drop")
    opt = optax.MultiSteps(private_optimizer(optax.sgd(1.0), agg, accumulation_steps=k),
                           every_k_schedule=4)
    key = agg.rng  # after the salt the optimizer split off it
    with pytest.raises(TypeError, match="wrapped in optax.MultiSteps.*accumulation_steps=k"):
        opt.init(params)
    assert agg.rng is key and agg.ledger.events == ()


def test_compiled_shapes_over_a_thousand_poisson_steps_stay_few():
    rng = np.random.default_rng(7)
    loss_fn, params = models.model(rng, "logistic")
    n, q = 10_000, 0.0256  # q n = 256, std 15.8, granularity 8
    x, y = models.data(rng, "logistic", n)
    agg = aggregator(dpcore.flat(leaf_names(params), 1.0, 1.0), n=n, q=q, seed=8,
                     on_nonfinite="drop")
    step = PrivateStep(loss_fn, optax.sgd(0.1), agg)
    state = step.init(params)
    batches = PoissonBatches((x, y), agg, steps=1000)
    sizes = set()
    for batch, mask in batches:
        sizes.add(len(mask))
        params, state = step(params, state, batch, mask)
    print(f"\n1000 Poisson steps (q n = 256): {step.compiled_shapes()} compiled shapes, "
          f"buckets {sorted(sizes)}")
    assert step.compiled_shapes() == len(sizes) <= 20
    assert batches.buckets.granularity == 8
    assert len(agg.ledger.events) == 2000


def test_backend_private_gradient_is_the_fused_step_and_writes_the_ledger():
    rng = np.random.default_rng(9)
    loss_fn, params = models.model(rng, "logistic")
    x, y = models.data(rng, "logistic", 12)
    backend = dpcore.get_backend("jax")
    agg = aggregator(dpcore.flat(["b", "w"], 0.5, 0.0), n=120, q=0.1, seed=0)
    agg.sample()
    mask = np.arange(12) < 10
    grads = backend.private_gradient(loss_fn, params, (x, y), agg, mask=mask)
    per_example = models.logistic_oracle(params, x, y)
    norms = np.sqrt(per_example["w"] ** 2 @ np.ones(5) + per_example["b"] ** 2)
    factor = np.minimum(1.0, 0.5 / norms) * mask
    np.testing.assert_allclose(grads["w"], factor @ per_example["w"] / 12.0, rtol=1e-5)
    assert [type(e) for e in agg.ledger.events] == [SamplingEvent, SumQueryEvent]
    agg.sample()
    with pytest.raises(ValueError, match=r"booleans or 0/1 .* got \[0.5, 0.5\]"):  # as True
        backend.private_gradient(loss_fn, params, (x, y), agg, mask=np.where(mask, 1.0, 0.5))
    assert [type(e) for e in agg.ledger.events] == [SamplingEvent, SumQueryEvent, SamplingEvent]
    with pytest.raises(TypeError, match="backend must be the JAX backend"):
        private_grad(loss_fn, dpcore.PrivateAggregator(agg.mechanism, n=10, q=0.5))


def test_a_metric_of_a_compiled_steps_sample_is_released_on_that_step():
    """After a PrivateStep, the core's aggregator.release(values, mask=, mechanism=) releases
    a metric of the same padded sample (JAX arrays, on the host) as a query of that step:
    the clipped mean over q n (float64 oracle; padded rows left out), its event after the
    gradient's, and noise of the std its event records."""
    rng = np.random.default_rng(21)
    loss_fn, params = models.model(rng, "logistic")
    x, y = models.data(rng, "logistic", 12)
    agg = aggregator(dpcore.flat(leaf_names(params), 1.0, 1.0), n=120, q=0.1, seed=3)
    step = PrivateStep(loss_fn, optax.sgd(0.1), agg)
    metric = dpcore.Mechanism((dpcore.Group("loss", ("loss",), 0.5, 0.0),))
    noisy = dpcore.Mechanism((dpcore.Group("noisy", ("v",), 0.5, 50.0),))
    agg.sample()
    batch, mask = pad((x, y), np.arange(12), 16)
    losses = loss_fn(params, batch)  # the sample's per-record losses, before the step
    step(params, step.init(params), batch, mask)
    got = agg.release({"loss": losses[:, None]}, mask=mask, mechanism=metric)["loss"]
    want = np.minimum(np.float64(losses[:12]), 0.5).sum() / 12.0  # q n = 12
    np.testing.assert_allclose(np.asarray(got), [want], rtol=1e-6)
    draws = np.asarray(agg.release({"v": jnp.zeros((16, 4000))}, mask=mask,
                                   mechanism=noisy)["v"]) * 12.0
    assert np.std(draws) == pytest.approx(50.0, rel=0.05)  # 4.5 standard errors
    groups = [getattr(e, "group", None) for e in agg.ledger.events]
    assert groups == [None, "all", "loss", "noisy"]


def test_the_main_job_runs_with_the_jax_backend(tmp_path, capsys, load_example):
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    digits = load_example("digits")
    ledger, plot = tmp_path / "ledger.jsonl", tmp_path / "eps.png"
    digits.main(["--backend", "jax", "--epochs", "2", "--epsilon", "4", "--ledger", str(ledger),
                 "--plot", str(plot)])
    out = capsys.readouterr().out
    assert "test accuracy" in out and "non-private" in out
    steps = dpcore.read_ledger(ledger).steps()
    assert sum(s.count for s in steps) == 2 * 22  # round(1437 / 64) steps per epoch


def test_a_secure_aggregator_gets_host_noise_in_the_compiled_steps():
    """secure=True draws the noise on the host from the system's CSPRNG: private_grad and
    backend.private_gradient, and the optax route in the user's jit (the program fetches
    them at every run), add the noise the ledger records (zero gradients; a 10% error
    fails)."""
    agg = dpcore.PrivateAggregator(dpcore.flat(["w"], 1.0, 3.0), n=100, q=0.5, backend="jax",
                                   secure=True)
    loss = lambda p, b: jnp.sum(p["w"] * 0 * b, axis=1)  # noqa: E731
    params, batch = {"w": jnp.zeros(50_000)}, jnp.ones((7, 50_000))
    grad_fn = private_grad(loss, agg)
    opt = private_optimizer(optax.sgd(1.0), agg)
    sums_fn = clipped_sums(loss, agg.mechanism)

    @jax.jit
    def update(state):
        return opt.update(sums_fn(params, batch, jnp.ones(7, bool)), state, params)

    def optax_step():
        agg.sample()
        return {"w": -update(state)[0]["w"]}

    state = opt.init(params)
    for grads in (dpcore.get_backend("jax").private_gradient(loss, params, batch,
                                                             _begun(agg)),
                  grad_fn(params, batch), grad_fn(params, batch), optax_step(), optax_step()):
        std = float(jnp.std(grads["w"])) * agg.expected_size
        assert grads["w"].dtype == jnp.float32 and abs(std / 3.0 - 1) < 0.03
    for step in (lambda: grad_fn(params, batch), optax_step):
        first, second = step(), step()
        assert not jnp.array_equal(first["w"], second["w"])  # fresh noise every step
    assert sum(isinstance(e, SumQueryEvent) for e in agg.ledger.events) == 9



@pytest.mark.parametrize("secure", [False, True])
def test_a_release_inside_the_users_jit_is_refused(secure):
    """Under jax.jit the release would draw the noise and write the ledger once, at tracing,
    and every call of the program would reuse that draw."""
    agg = dpcore.PrivateAggregator(dpcore.flat(["w"], 1.0, 1.0), n=10, q=0.5, backend="jax",
                                   secure=secure)
    agg.sample()
    for release in (lambda s: agg.release_sums({"w": s}),
                    lambda s: agg.release({"w": s[None]}),
                    lambda s: agg.noise_draws({"w": s})["w"]):
        with pytest.raises(RuntimeError, match="values of a compiled trace"):
            jax.jit(release)(jnp.zeros(3))
    assert not any(isinstance(e, SumQueryEvent) for e in agg.ledger.events)


def _begun(aggregator):
    aggregator.sample()
    return aggregator


@pytest.mark.parametrize("transformation", ["private_optimizer", "private_aggregate"])
def test_sums_clipped_under_another_mechanism_are_refused(transformation):
    """Records of norm 17: the sums clipped at 100 passed to an aggregator whose ledger says
    1 released 17 times the sensitivity recorded; refused at tracing, as are other groups. A
    mechanism equal to the aggregator's, clips passed in, and sums added up across devices
    (jax.lax.psum keeps what they were clipped under) pass."""
    params = {"w": jnp.ones(3), "b": jnp.zeros(())}
    names = ["b", "w"]
    loss_fn = lambda p, b: b @ p["w"] + p["b"]  # noqa: E731
    agg = aggregator(dpcore.flat(names, clip=1.0, noise_multiplier=0.0), n=200, q=0.1)
    opt = (dpcore_jax.private_optimizer(optax.sgd(1.0), agg)
           if transformation == "private_optimizer" else dpcore_jax.private_aggregate(agg))
    state = opt.init(params)
    batch, mask = jnp.full((8, 3), 10.0), jnp.ones(8, bool)
    for other in [dpcore.flat(names, clip=100.0, noise_multiplier=0.0),
                  dpcore.per_layer({"w": 3, "b": 1}, total_clip=2 ** 0.5, noise_multiplier=0.0)]:
        with pytest.raises(ValueError, match="other groups or clips than the aggregator's"):
            opt.update(clipped_sums(loss_fn, other)(params, batch, mask), state, params)
    assert agg.ledger.events == ()
    same = clipped_sums(loss_fn, dpcore.flat(names, clip=1.0, noise_multiplier=0.0))
    sums = same(params, batch, mask, clips=jnp.ones(1))
    assert sums.clipping[0][3] is None  # a clip passed in is not checked
    added = jax.vmap(lambda s: jax.lax.psum(s, "d"), axis_name="d")(
        jax.tree_util.tree_map(lambda a: a[None], sums))
    assert added.clipping == sums.clipping
    agg.begin_step()
    updates, state = jax.jit(lambda p, s, b, m: opt.update(same(p, b, m), s, p))(
        params, state, batch, mask)
    sign = 1 if transformation == "private_aggregate" else -1  # the mean, or sgd's step
    assert float(jnp.linalg.norm(sign * updates["w"])) <= 8 * 1.0 / agg.expected_size + 1e-6


def _samples_of_poisson_batches(x, agg, steps):
    return PoissonBatches(x, agg, steps=steps)


def _samples_drawn_by_hand(x, agg, steps):
    """The padded samples of a loop that draws them itself, ``aggregator.sample()``."""
    buckets = Buckets(agg.expected_size, agg.q)
    for _ in range(steps):
        indices = agg.sample()
        yield pad(x, indices, buckets.size_for(len(indices)))


@pytest.mark.parametrize("samples", [_samples_of_poisson_batches, _samples_drawn_by_hand],
                         ids=["PoissonBatches", "aggregator.sample"])
def test_each_release_is_recorded_under_its_own_sampling_event(samples):
    """A step the host does not wait for: on one CPU the jitted update returned before its
    ledger callback ran, and the next sample's event came first (2-3 releases in 40 were
    recorded under the next sample: one step with z = inf, one with z / sqrt 2; under a
    budget, a refusal). Every sample now begins once the callbacks dispatched before have
    run (``begin_step`` settles the backend), also in a loop that calls
    ``aggregator.sample()`` itself, which was documented as the caller's to do."""
    rng = np.random.default_rng(0)
    n = 400
    x = rng.normal(size=(n, 256)).astype(np.float32)
    params = {"w": jnp.asarray(rng.normal(size=(256, 256)) / 16, jnp.float32)}

    def loss_fn(p, b):
        h = b
        for _ in range(20):
            h = jnp.tanh(h @ p["w"])
        return jnp.sum(h ** 2, axis=1)

    mechanism = dpcore.flat(["w"], 1.0, 1.0)
    agg = aggregator(mechanism, n=n, q=0.25)
    opt = private_optimizer(optax.sgd(1e-3), agg)
    state = opt.init(params)
    sums_fn = clipped_sums(loss_fn, mechanism, method="vmap")

    @jax.jit
    def step(p, s, b, m):
        updates, s = opt.update(sums_fn(p, b, m), s, p)
        return optax.apply_updates(p, updates), s

    for batch, mask in samples(x, agg, 40):
        params, state = step(params, state, batch, mask)
    jax.block_until_ready(params)
    kinds = "".join("S" if e.kind == "sampling" else "Q" for e in agg.ledger.events)
    assert kinds == "SQ" * 40


def test_one_state_updated_twice_in_a_step_draws_two_noises():
    """The key was the state's and the step's: a state updated twice in one step (a retry, a
    what-if) drew the same noise twice, and the difference of the two releases was record
    0's gradient exactly, while the ledger priced two independent queries."""
    params = {"w": jnp.zeros(5)}
    loss_fn = lambda p, b: b @ p["w"]  # noqa: E731
    mechanism = dpcore.Mechanism((dpcore.Group("g", ("w",), clip=100.0, noise_std=100.0),))
    agg = aggregator(mechanism, n=100, q=0.1)
    sums_fn = clipped_sums(loss_fn, mechanism)
    opt = private_aggregate(agg)
    state = opt.init(params)
    update = jax.jit(lambda s, b, m: opt.update(sums_fn(params, b, m), s, params))
    x = np.random.default_rng(0).normal(size=(100, 5)).astype(np.float32)
    batch, mask = pad(x, agg.sample(), 40)
    first = update(state, batch, mask)[0]["w"]
    other = batch.copy()
    other[0] = 0.0
    second = update(state, other, mask)[0]["w"]
    difference = np.asarray(first - second) * agg.expected_size
    assert mask[0] and not np.allclose(difference, batch[0], atol=1.0)
    assert [e.kind for e in agg.ledger.events] == ["sampling", "sum_query", "sum_query"]
