"""A full DP step, ``backend.private_gradient``: clipping, masks, noise against the ledger,
exact noise-free output, fresh noise, seeds, and the ledger's events.

The problem is a tanh MLP with leaves W1, b1 (group "hidden", separate clipping) and w2, b2
(group "output", joint clipping with scales (1, 0.5)), so both mechanisms and several leaves
are exercised.
"""

from dataclasses import dataclass

import numpy as np
import pytest
from scipy import stats

from dpcore import Group, Mechanism, PrivateAggregator
from dpcore.ledger import SamplingEvent, SumQueryEvent

from .checks import ks_normal, record_secure_draws, repeated_run
from .plugin import converter
from .problems import ScaledModel, scalar_leaves, tanh_mlp

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


def test_a_step_reads_a_bound_method_loss_at_every_call(backend, convert):
    problem = tanh_mlp(batch=6, seed=5)
    model = ScaledModel(problem.loss(backend.namespace()))
    mech = mechanism(noise=(0.0, 0.0), clips=(1e6, 1e6))
    grads = problem.grads(problem.params, problem.batch)
    for scale in (1.0, 3.0, 0.5):
        model.scale = scale
        agg = PrivateAggregator(mech, n=N_RECORDS, q=RATE, backend=backend, seed=0)
        agg.begin_step()
        out = convert.numpy(backend.private_gradient(model.loss, convert(problem.params),
                                                     convert(problem.batch), agg))
        for leaf, g in grads.items():
            want = scale * g.sum(axis=0).reshape(out[leaf].shape) / (RATE * N_RECORDS)
            np.testing.assert_allclose(out[leaf], want, rtol=1e-4, atol=1e-6,
                                       err_msg=f"{leaf!r} at scale {scale}")


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


def test_masked_step_ignores_padded_rows(backend, convert):
    """A noise-free step on 12 real rows padded with 4 masked ones (two copies of real rows,
    two of NaN) equals the clipped mean of the real rows (1e-4 relative)."""
    problem = tanh_mlp(batch=12, seed=5)
    mech = mechanism(noise=(0.0, 0.0), clips=(0.3, 0.2))
    padded = problem.take(np.r_[np.arange(12), [0, 1, 2, 3]])
    padded.batch[0][14:] = np.nan
    mask = backend.asarray(np.arange(16) < 12, dtype="bool")
    agg = PrivateAggregator(mech, n=N_RECORDS, q=RATE, backend=backend, seed=0)
    agg.begin_step()
    out = convert.numpy(backend.private_gradient(problem.loss(backend.namespace()),
                                                 convert(padded.params), convert(padded.batch),
                                                 agg, mask=mask))
    sums, _ = oracle_clipped_sum(problem, mech)
    for leaf, total in sums.items():
        np.testing.assert_allclose(out[leaf], total / (RATE * N_RECORDS), rtol=1e-4, atol=1e-6,
                                   err_msg=f"masked noise-free private gradient of {leaf!r}")


STEPS = 60


@dataclass
class NoiseRun:
    """STEPS steps of one aggregator; ``z[leaf]`` (STEPS, leaf size): each step's noise on
    the leaf's sum in units of the standard deviation the ledger records for it."""
    outs: list
    z: dict
    first_kept: bool  # the first step's release was unchanged after the last step
    secure_draws: list | None  # secure: the N(0, 1) values the system's generator gave a step


@pytest.fixture(scope="module", params=[("float32", False), ("float32", True),
                                        ("float64", False)],
                ids=["float32", "float32-secure", "float64"])
def noise_run(request, backend):
    dtype, secure = request.param
    return run_steps(backend, converter(backend, dtype), tanh_mlp(batch=8, dim=50, hidden=200,
                                                                  seed=8), mechanism, secure)


def scalar_mechanism(noise=(1.5, 2.0)):
    """Even leaves of :func:`scalar_leaves` clipped one by one, odd ones jointly (scales 1
    and 0.5 in turn)."""
    leaves = list(scalar_leaves().params)
    odd = leaves[1::2]
    return Mechanism((Group("even", tuple(leaves[::2]), 1.0, noise[0]),
                      Group("odd", tuple(odd), 0.5, noise[1],
                            scales=tuple(1.0 if k % 2 else 0.5 for k in range(len(odd))))))


@pytest.fixture(scope="module")
def scalar_noise_run(backend, convert):
    return run_steps(backend, convert, scalar_leaves(batch=8, seed=9), scalar_mechanism, False)


def run_steps(backend, convert, problem, mechanism, secure, seed=0):
    """STEPS steps, alternately on an empty batch (legal under Poisson sampling: the output
    is pure noise) and on a fixed batch of 8 records, whose noise is the output less the
    backend's own noise-free output for it. ``mechanism(noise)`` makes the mechanism.
    ``secure``: the noise is the system's CSPRNG's (unseeded), which the backend must add as
    it adds its own generator's; its draws are recorded as the generator hands them out."""
    empty = problem.take(np.arange(0))
    loss_fn = problem.loss(backend.namespace())
    params = convert(problem.params)
    batches = [convert(empty.batch), convert(problem.batch)]
    exact = PrivateAggregator(mechanism(noise=(0.0, 0.0)), n=N_RECORDS, q=RATE,
                              backend=backend, seed=0)
    exact.begin_step()
    noise_free = convert.numpy(backend.private_gradient(loss_fn, params, batches[1], exact))
    agg = PrivateAggregator(mechanism(), n=N_RECORDS, q=RATE, backend=backend,
                            seed=None if secure else seed, secure=secure)
    drawn = record_secure_draws(agg) if secure else None
    outs, secure_draws = [], [] if secure else None
    for t in range(STEPS):
        agg.begin_step()
        before = len(drawn) if secure else 0
        released = backend.private_gradient(loss_fn, params, batches[t % 2], agg)
        if secure:
            secure_draws.append(np.concatenate(drawn[before:] or [np.zeros(0)]))
        if t == 0:
            first = released  # kept, as a caller may keep a release
        outs.append(convert.numpy(released))
    recorded = {e.group: e.noise_std for e in agg.ledger.events if isinstance(e, SumQueryEvent)}
    z = {}
    for group in agg.mechanism.groups:
        for leaf in group.leaves:
            want = group.scale(leaf) * recorded[group.name]  # on the sum: alpha_j sigma~_g
            z[leaf] = np.stack([(o[leaf] - (noise_free[leaf] if t % 2 else 0)).ravel()
                                for t, o in enumerate(outs)]) * agg.expected_size / want
    kept = convert.numpy(first)
    return NoiseRun(outs, z, all(np.array_equal(kept[k], outs[0][k]) for k in kept),
                    secure_draws)


def test_step_noise_has_the_standard_deviation_the_ledger_records(noise_run):
    """Pooled per group over both kinds of step, the noise's standard deviation is 1 in the
    ledger's units within 7 standard errors 7/sqrt(2 N) (0.63% for the 612,000 values of
    group "hidden", 4.5% for the 12,060 of "output"), and each leaf's mean 0 within 6."""
    for group in mechanism().groups:
        for leaf in group.leaves:
            z = noise_run.z[leaf]
            assert abs(z.mean()) < 6 / np.sqrt(z.size), (
                f"noise on {leaf!r} has mean {z.mean():.4f} x the ledger's std, expected 0 +- "
                f"{6 / np.sqrt(z.size):.4f}")
        pooled = np.concatenate([noise_run.z[leaf].ravel() for leaf in group.leaves])
        tolerance = 7 / np.sqrt(2 * pooled.size)
        assert abs(pooled.std() - 1) < tolerance, (
            f"noise on group {group.name!r} is {pooled.std():.4f} x what the ledger records, "
            f"expected 1 +- {tolerance:.4f}")


def test_every_leaf_gets_the_noise_the_ledger_records(noise_run):
    """Per leaf, the sum of squared normalised noise values is chi-square with as many degrees
    of freedom as values (60 for the one-value leaf b2), checked two-sided at p > 1e-6: a leaf
    without noise gives 0."""
    for leaf, z in noise_run.z.items():
        statistic = np.sum(z ** 2)
        p = 2 * min(stats.chi2.cdf(statistic, z.size), stats.chi2.sf(statistic, z.size))
        assert p > 1e-6, (
            f"noise on {leaf!r} has variance {statistic / z.size:.4f} x what the ledger records "
            f"over {z.size} values (chi-square, two-sided p = {p:.2g})")


def test_step_noise_is_normal(noise_run):
    """Kolmogorov-Smirnov test of all normalised noise values (624,060) against N(0, 1):
    p > 1e-6 (Laplace noise of the right standard deviation has distance 0.03, p ~ 0)."""
    z = np.concatenate([z.ravel() for z in noise_run.z.values()])
    distance, p = ks_normal(z)
    assert p > 1e-6, (f"step noise is not Gaussian: Kolmogorov-Smirnov distance {distance:.5f} "
                      f"in {z.size} values, p = {p:.2g} (required > 1e-6)")


def test_one_value_leaves_get_the_noise_the_ledger_records(scalar_noise_run):
    """Pooled over the 48 one-value leaves of :func:`scalar_leaves` (shapes () and (1,), in
    a separate and a joint group), the sum of squared normalised noise values is chi-square
    with 2,880 degrees of freedom, two-sided p > 1e-6 (0.9x the noise: p ~ 1e-12), and the
    mean is 0 within 6 standard errors."""
    z = np.concatenate([z.ravel() for z in scalar_noise_run.z.values()])
    statistic = np.sum(z ** 2)
    p = 2 * min(stats.chi2.cdf(statistic, z.size), stats.chi2.sf(statistic, z.size))
    assert p > 1e-6, (
        f"noise on one-value leaves has variance {statistic / z.size:.4f} x what the ledger "
        f"records over {z.size} values (chi-square, two-sided p = {p:.2g})")
    assert abs(z.mean()) < 6 / np.sqrt(z.size), (
        f"noise on one-value leaves has mean {z.mean():.4f} x the ledger's std, expected 0 +- "
        f"{6 / np.sqrt(z.size):.4f}")


def test_secure_steps_add_the_secure_generators_draws(noise_run):
    """With ``secure=True`` each step's noise (in the ledger's units) is the N(0, 1) values
    the aggregator's secure generator handed out for that step: at least 99% of the 10,401
    values lie within 1e-5 of one of them (float32 rounding is ~1e-7 here; noise from any
    other generator matches by chance about 6% of the time)."""
    if noise_run.secure_draws is None:
        pytest.skip("the run's aggregator is not secure")
    for t, drawn in enumerate(noise_run.secure_draws):
        z = np.concatenate([noise_run.z[leaf][t] for leaf in noise_run.z])
        edges = np.concatenate([[-np.inf], np.sort(drawn), [np.inf]])
        at = np.searchsorted(edges, z)  # edges[at - 1] < z <= edges[at]
        matched = np.mean(np.minimum(z - edges[at - 1], edges[at] - z) < 1e-5)
        assert matched >= 0.99, (
            f"step {t} of a secure aggregator released noise of which {matched:.1%} is the "
            f"{drawn.size} values its secure generator drew (expected all): the noise came "
            f"from another generator")


def test_no_noise_values_repeat_in_the_releases(noise_run):
    """In the pure-noise releases (the empty batches' 30 x 10,401 values, leaves in order),
    no run of 8 consecutive values occurs twice: a key or buffer reused for parts of a leaf,
    for two leaves or for two steps repeats runs exactly."""
    x = np.concatenate([np.concatenate([out[leaf].ravel() for leaf in noise_run.z])
                        for out in noise_run.outs[::2]])
    repeat = repeated_run(x, 8)
    assert repeat is None, (
        f"the pure-noise releases repeat {x[repeat[0]:repeat[0] + 8]} at positions {repeat[0]} "
        f"and {repeat[1]} of {x.size} (leaves concatenated in order, step by step)")


def test_fresh_noise_at_every_step(noise_run):
    """No two of the STEPS releases are equal, and no two steps' noise vectors (10,401
    values) correlate beyond 6.5/sqrt(10,401): a correct generator exceeds that for one of
    the 1,770 pairs with probability 1e-7, a generator repeating every 2 to 59 draws gives 1."""
    z = np.concatenate(list(noise_run.z.values()), axis=1)
    flat = [np.concatenate([o[leaf].ravel() for leaf in noise_run.z]) for o in noise_run.outs]
    corr = np.corrcoef(z)
    bound = 6.5 / np.sqrt(z.shape[1])
    for i in range(STEPS):
        for j in range(i + 1, STEPS):
            assert not np.array_equal(flat[i], flat[j]), f"steps {i} and {j} released the same"
            assert abs(corr[i, j]) < bound, (
                f"the noise of steps {i} and {j} has correlation {corr[i, j]:.4f}, expected 0 "
                f"+- {bound:.4f}")


def test_fresh_noise_on_every_leaf(noise_run):
    """For every pair of leaves, the correlation of equal-length prefixes of their noise over
    all steps (n = STEPS x the smaller leaf's size) is below 6/sqrt(n): noise drawn twice from
    one seed, for two groups or leaves, gives 1."""
    leaves = list(noise_run.z)
    for i, a in enumerate(leaves):
        for b in leaves[i + 1:]:
            size = min(noise_run.z[a].shape[1], noise_run.z[b].shape[1])
            x, y = noise_run.z[a][:, :size].ravel(), noise_run.z[b][:, :size].ravel()
            r = np.corrcoef(x, y)[0, 1]
            assert abs(r) < 6 / np.sqrt(x.size), (
                f"the noise on {a!r} and {b!r} has correlation {r:.4f} over {x.size} values, "
                f"expected 0 +- {6 / np.sqrt(x.size):.4f}")


def test_a_kept_release_is_not_overwritten(noise_run):
    """The first step's release, kept by the caller, still holds its values after the
    following steps (noise buffers reused across draws overwrite it)."""
    assert noise_run.first_kept, "a later step changed the values of the first step's release"


def test_seeded_steps_reproduce_and_differ(backend, convert):
    problem = tanh_mlp(batch=6, seed=3)
    _, a = step(backend, convert, problem, mechanism(), seed=11)
    _, b = step(backend, convert, problem, mechanism(), seed=11)
    _, c = step(backend, convert, problem, mechanism(), seed=12)
    for leaf in a:
        np.testing.assert_array_equal(a[leaf], b[leaf],
                                      err_msg=f"two steps seeded 11 differ on {leaf!r}")
    assert not np.array_equal(a["W1"], c["W1"]), "steps seeded 11 and 12 released the same W1"


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
    assert list(agg.ledger.events) == expected * 4, (
        f"ledger events {list(agg.ledger.events)}, expected {expected} at each of 4 steps")
