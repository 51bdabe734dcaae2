"""A full DP step, ``backend.private_gradient``: clipping, noise against the ledger, exact
noise-free output, fresh noise, seeds, and the ledger's events.

The problem is a tanh MLP with leaves W1, b1 (group "hidden", separate clipping) and w2, b2
(group "output", joint clipping with scales (1, 0.5)), so both mechanisms and several leaves
are exercised.
"""

import numpy as np
import pytest

from dpcore import Group, Mechanism, PrivateAggregator
from dpcore.ledger import SamplingEvent, SumQueryEvent

from .problems import tanh_mlp

pytestmark = pytest.mark.requires_capability("per_example_grads")

N_RECORDS, RATE = 400, 0.05  # expected batch q n = 20


def mechanism(noise=(1.5, 2.0), clips=(1.0, 0.5)):
    return Mechanism((Group("hidden", ("W1", "b1"), clips[0], noise[0]),
                      Group("output", ("w2", "b2"), clips[1], noise[1], scales=(1.0, 0.5))))


def step(backend, convert, problem, mech, seed=0, aggregator=None):
    agg = aggregator or PrivateAggregator(mech, n=N_RECORDS, q=RATE, backend=backend, seed=seed)
    agg.begin_step()
    out = backend.private_gradient(problem.loss(backend.namespace()), convert(problem.params),
                                   convert(problem.batch), agg)
    return agg, convert.numpy(out)


def oracle_clipped_sum(problem, mech):
    grads = problem.grads(problem.params, problem.batch)
    sums = {leaf: np.zeros(g.shape[1:]) for leaf, g in grads.items()}
    clipped = 0
    for i in range(problem.batch[0].shape[0]):
        for group in mech.groups:
            norm = np.sqrt(sum(np.sum(grads[leaf][i] ** 2) / group.scale(leaf) ** 2
                               for leaf in group.leaves))
            factor = min(1.0, group.clip / norm) if norm > 0 else 1.0
            clipped += factor < 1
            for leaf in group.leaves:
                sums[leaf] += factor * grads[leaf][i]
    return sums, clipped


def test_noise_free_step_is_the_exact_clipped_mean(backend, convert):
    problem = tanh_mlp(batch=12, seed=5)
    mech = mechanism(noise=(0.0, 0.0), clips=(0.3, 0.2))
    _, out = step(backend, convert, problem, mech)
    sums, clipped = oracle_clipped_sum(problem, mech)
    assert 0 < clipped < 24, "test data must have clipped and unclipped records"
    for leaf, total in sums.items():
        np.testing.assert_allclose(out[leaf], total / (RATE * N_RECORDS), rtol=1e-4, atol=1e-6,
                                   err_msg=f"noise-free private gradient of {leaf!r}")


def test_one_record_contributes_at_most_the_clip_bound(backend, convert):
    mech = mechanism(noise=(0.0, 0.0), clips=(0.3, 0.2))
    problem = tanh_mlp(batch=5, seed=6)
    problem = problem.__class__(problem.name, problem.params,
                                (problem.batch[0] * 50.0, problem.batch[1] * 50.0),
                                problem.loss, problem.grads)
    for row in range(5):
        _, out = step(backend, convert, problem.take([row]), mech)
        for group in mech.groups:
            norm = np.sqrt(sum(np.sum((out[leaf] * RATE * N_RECORDS / group.scale(leaf)) ** 2)
                               for leaf in group.leaves))
            assert norm <= group.clip * (1 + 1e-4), (
                f"record {row} contributes norm {norm} to group {group.name!r} "
                f"(clip {group.clip})")


STEPS = 60


def noise_run(backend, convert, seed=0, secure=False):
    """STEPS empty-batch steps (legal under Poisson sampling): the output is pure noise
    (``secure``: the system's CSPRNG's, unseeded, which the backend must add as it adds its
    own generator's)."""
    problem = tanh_mlp(batch=0, dim=50, hidden=200)
    agg = PrivateAggregator(mechanism(), n=N_RECORDS, q=RATE, backend=backend,
                            seed=None if secure else seed, secure=secure)
    outs = [step(backend, convert, problem, None, aggregator=agg)[1] for _ in range(STEPS)]
    return agg, outs


@pytest.mark.parametrize("secure", [False, True])
def test_step_noise_has_the_standard_deviation_the_ledger_records(backend, convert, secure):
    agg, outs = noise_run(backend, convert, secure=secure)
    recorded = {e.group: e.noise_std for e in agg.ledger.events if isinstance(e, SumQueryEvent)}
    mech = agg.mechanism
    for group in mech.groups:
        pooled = []
        for leaf in group.leaves:
            want = group.scale(leaf) * recorded[group.name]  # on the sum: alpha_j sigma~_g
            draws = np.concatenate([o[leaf].ravel() for o in outs]) * agg.expected_size / want
            pooled.append(draws)
            # relative standard error of a sample std: 1/sqrt(2 N); 7 of them, checked per
            # leaf where that is at most 5% (N >= 9,800), else only in the group's pool
            tolerance = 7 / np.sqrt(2 * draws.size)
            if tolerance <= 0.05:
                assert draws.std() == pytest.approx(1.0, rel=tolerance), (
                    f"noise on {leaf!r} is {draws.std():.3f} x what the ledger records")
            assert abs(draws.mean()) < 6 / np.sqrt(draws.size), f"noise on {leaf!r} is biased"
        pooled = np.concatenate(pooled)
        assert pooled.std() == pytest.approx(1.0, rel=7 / np.sqrt(2 * pooled.size)), (
            f"noise on group {group.name!r} is {pooled.std():.3f} x what the ledger records")


def test_fresh_noise_at_every_step_and_on_every_leaf(backend, convert):
    _, outs = noise_run(backend, convert, seed=1)
    a, b = outs[0]["W1"].ravel(), outs[1]["W1"].ravel()
    assert not np.array_equal(a, b), "the same noise was added at two steps"
    assert abs(np.corrcoef(a, b)[0, 1]) < 6 / np.sqrt(a.size), "noise correlated across steps"
    b1 = np.concatenate([o["b1"].ravel() for o in outs])
    w2 = np.concatenate([o["w2"].ravel() for o in outs])
    assert abs(np.corrcoef(b1, w2)[0, 1]) < 6 / np.sqrt(b1.size), "noise correlated across leaves"


def test_seeded_steps_reproduce_and_differ(backend, convert):
    problem = tanh_mlp(batch=6, seed=3)
    _, a = step(backend, convert, problem, mechanism(), seed=11)
    _, b = step(backend, convert, problem, mechanism(), seed=11)
    _, c = step(backend, convert, problem, mechanism(), seed=12)
    for leaf in a:
        np.testing.assert_array_equal(a[leaf], b[leaf])
    assert not np.array_equal(a["W1"], c["W1"])


def test_ledger_has_one_sampling_and_one_query_per_group_per_step(backend, convert):
    data = tanh_mlp(batch=N_RECORDS, seed=4)
    mech = mechanism()
    agg = PrivateAggregator(mech, n=N_RECORDS, q=RATE, backend=backend, seed=2)
    loss_fn = data.loss(backend.namespace())
    for _ in range(4):
        rows = agg.sample()
        part = data.take(rows)
        backend.private_gradient(loss_fn, convert(part.params), convert(part.batch), agg)
    expected = [SamplingEvent(RATE, N_RECORDS)] + [
        SumQueryEvent(g.name, g.clip, g.noise_std) for g in mech.groups]
    assert list(agg.ledger.events) == expected * 4
