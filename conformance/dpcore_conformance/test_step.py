"""A full DP step, ``backend.private_gradient``: clipping, masks, noise against the ledger,
exact noise-free output, fresh noise, seeds, the ledger's events, and clips that move from step
to step (a clip schedule, adaptive clipping).

The problem is a tanh MLP with leaves W1, b1 (group "hidden", separate clipping) and w2, b2
(group "output", joint clipping with scales (1, 0.5)), so both mechanisms and several leaves
are exercised.
"""

from dataclasses import dataclass

import numpy as np
import pytest
from scipy import stats

from dpcore import Group, Mechanism, PrivateAggregator
from dpcore.adaptive import QuantileClipping, update_clip
from dpcore.ledger import SamplingEvent, SumQueryEvent
from dpcore.schedules import ClipSchedule

from .checks import ks_normal, matched_fraction, record_secure_draws, repeated_run, scale_of_draws
from .plugin import converter
from .problems import Problem, ScaledModel, linear_regression, scalar_leaves, tanh_mlp

pytestmark = pytest.mark.requires_capability("per_example_grads")

N_RECORDS, RATE = 400, 0.05  # expected batch q n = 20
LARGE_BATCH = 2100


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


def padded(problem: Problem, others: int, nans: int, seed: int = 0):
    """``problem``'s batch followed by ``others`` padding rows of other random values (three
    times the scale of the real ones: distinct from every real row, and clipped) and ``nans``
    rows of NaN; and the mask (B,) of the real rows, as NumPy booleans."""
    rng = np.random.default_rng(seed)
    batch = tuple(np.concatenate([a, 3 * rng.normal(size=(others, *a.shape[1:])),
                                  np.full((nans, *a.shape[1:]), np.nan)]) for a in problem.batch)
    rows = problem.batch[0].shape[0]
    return (Problem(problem.name, problem.params, batch, problem.loss, problem.grads),
            np.arange(rows + others + nans) < rows)


def test_masked_step_ignores_padded_rows(backend, convert):
    """A noise-free step on 12 real rows padded with 4 masked ones (two of other random
    values, two of NaN) equals the clipped mean of the real rows (1e-4 relative): a mask
    applied a row late counts the first padding row (copies of real rows would hide it), one
    applied a row early a NaN row."""
    problem = tanh_mlp(batch=12, seed=5)
    mech = mechanism(noise=(0.0, 0.0), clips=(0.3, 0.2))
    pad, mask = padded(problem, 2, 2)
    agg = PrivateAggregator(mech, n=N_RECORDS, q=RATE, backend=backend, seed=0)
    agg.begin_step()
    out = convert.numpy(backend.private_gradient(problem.loss(backend.namespace()),
                                                 convert(pad.params), convert(pad.batch),
                                                 agg, mask=backend.asarray(mask, dtype="bool")))
    sums, _ = oracle_clipped_sum(problem, mech)
    for leaf, total in sums.items():
        np.testing.assert_allclose(out[leaf], total / (RATE * N_RECORDS), rtol=1e-4, atol=1e-6,
                                   err_msg=f"masked noise-free private gradient of {leaf!r}")


def test_noise_free_step_on_a_large_batch(backend, convert):
    """A noise-free step on LARGE_BATCH records of linear regression (one group, clipped at
    the records' median norm) is the exact clipped mean, to 1e-3 of the clip (float32 sums of
    2,100 terms are good to about 1e-5 of it): a step cutting the batch into chunks of 512,
    1024 or 2048 rows that mishandles a chunk's rows is off by a record's clipped gradient
    per chunk, 0.1 of the clip in the mean."""
    problem = linear_regression(batch=LARGE_BATCH, seed=4)
    grads = problem.grads(problem.params, problem.batch)
    clip = float(np.median(np.sqrt(sum(np.sum(g.reshape(LARGE_BATCH, -1) ** 2, axis=1)
                                       for g in grads.values()))))
    mech = Mechanism((Group("all", ("w", "b"), clip, 0.0),))
    _, out = step(backend, convert, problem, mech)
    sums, _ = oracle_clipped_sum(problem, mech)
    for leaf, total in sums.items():
        np.testing.assert_allclose(out[leaf], total / (RATE * N_RECORDS), rtol=1e-4,
                                   atol=1e-3 * clip,
                                   err_msg=f"noise-free private gradient of {leaf!r} on "
                                   f"{LARGE_BATCH} records")


STEPS = 60


@dataclass
class NoiseRun:
    """STEPS steps of one aggregator; ``z[leaf]`` (STEPS, leaf size): each step's noise on
    the leaf's sum in units of the standard deviation the ledger records for it."""
    outs: list
    z: dict
    first_kept: bool  # the first step's release was unchanged after the last step
    secure_draws: list | None  # secure: the N(0, 1) values the system's generator gave a step


@pytest.fixture(scope="module", params=[("float32", False, False), ("float32", True, False),
                                        ("float64", False, False), ("float32", False, True)],
                ids=["float32", "float32-secure", "float64", "float32-masked"])
def noise_run(request, backend):
    dtype, secure, masked = request.param
    return run_steps(backend, converter(backend, dtype), tanh_mlp(batch=8, dim=50, hidden=200,
                                                                  seed=8), mechanism, secure,
                     masked=masked)


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


def run_steps(backend, convert, problem, mechanism, secure, seed=0, masked=False):
    """STEPS steps, alternately on an empty batch (legal under Poisson sampling: the output
    is pure noise) and on a fixed batch of 8 records, whose noise is the output less the
    backend's own noise-free output for it. ``mechanism(noise)`` makes the mechanism.
    ``secure``: the noise is the system's CSPRNG's (unseeded), which the backend must add as
    it adds its own generator's; its draws are recorded as the generator hands them out.
    ``masked``: every step is padded, as a compiled backend pads its batches to a fixed
    size, and passes a mask: the empty batch is 4 masked rows, the 8 records are followed
    by 4 (two of other random values, two of NaN)."""
    empty = problem.take(np.arange(0))
    masks = [None, None]
    if masked:
        (empty, masks[0]), (problem, masks[1]) = padded(empty, 2, 2, 1), padded(problem, 2, 2, 2)
        masks = [backend.asarray(m, dtype="bool") for m in masks]
    loss_fn = problem.loss(backend.namespace())
    params = convert(problem.params)
    batches = [convert(empty.batch), convert(problem.batch)]

    def release(agg, t):
        if masks[t % 2] is None:
            return backend.private_gradient(loss_fn, params, batches[t % 2], agg)
        return backend.private_gradient(loss_fn, params, batches[t % 2], agg, mask=masks[t % 2])

    exact = PrivateAggregator(mechanism(noise=(0.0, 0.0)), n=N_RECORDS, q=RATE,
                              backend=backend, seed=0)
    exact.begin_step()
    noise_free = convert.numpy(release(exact, 1))
    agg = PrivateAggregator(mechanism(), n=N_RECORDS, q=RATE, backend=backend,
                            seed=None if secure else seed, secure=secure)
    drawn = record_secure_draws(agg) if secure else None
    outs, secure_draws = [], [] if secure else None
    for t in range(STEPS):
        agg.begin_step()
        before = len(drawn) if secure else 0
        released = release(agg, t)
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
    """Kolmogorov-Smirnov test of all normalised noise values (624,060), standardised by
    their own standard deviation (a wrong scale is the standard-deviation checks' to name),
    against N(0, 1): p > 1e-6 (Laplace noise has distance 0.03, p ~ 0)."""
    z = np.concatenate([z.ravel() for z in noise_run.z.values()])
    distance, p = ks_normal(z / z.std())
    assert p > 1e-6, (f"step noise is not Gaussian: Kolmogorov-Smirnov distance {distance:.5f} "
                      f"in {z.size} values standardised by their std ({z.std():.4f} x the "
                      f"ledger's), p = {p:.2g} (required > 1e-6)")


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
    other generator matches by chance about 6% of the time). When they do not, each group's
    noise is compared with the draws up to a scale (:func:`.checks.scale_of_draws`): the
    draws at a wrong scale are reported as a wrong scale, anything else as noise from
    another generator."""
    if noise_run.secure_draws is None:
        pytest.skip("the run's aggregator is not secure")
    for t, drawn in enumerate(noise_run.secure_draws):
        z = np.concatenate([noise_run.z[leaf][t] for leaf in noise_run.z])
        matched = matched_fraction(z, drawn, 1e-5)
        if matched >= 0.99:
            continue
        assert np.any(z != 0), f"step {t} of a secure aggregator released no noise at all"
        scales = {g.name: scale_of_draws(np.concatenate([noise_run.z[leaf][t]
                                                         for leaf in g.leaves]), drawn)
                  for g in mechanism().groups}
        if None not in scales.values():
            pytest.fail(
                f"step {t} of a secure aggregator released the values its secure generator "
                f"drew at the wrong scale: its noise is " + ", ".join(
                    f"{c:.4f} x the draws on group {name!r}" for name, c in scales.items())
                + " in units of the std the ledger records, where it should be the draws "
                "(the noise is scaled wrongly, or the ledger records another std)")
        pytest.fail(
            f"step {t} of a secure aggregator released noise of which {matched:.1%} is the "
            f"{drawn.size} values its secure generator drew (expected all), and which is not "
            f"those values at another scale: the noise came from another generator")


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


MANY_STEPS = 2048


def test_no_release_repeats_over_many_steps(backend, convert):
    """MANY_STEPS pure-noise steps of linear regression (6 values a step), alternately on an
    empty batch and on 4 masked padding rows, concatenated: no run of 6 values occurs twice
    (found by hashing every run). A step that takes its noise from a pool of draws, or a
    generator cycling, with a period below MANY_STEPS steps (below 1,024 steps of one of the
    two paths) repeats whole releases; the 60 steps of the other checks see periods below 60
    only. A correct generator repeats a run of 6 float32 values among 12,283 with
    probability below 2^-110."""
    problem = linear_regression(batch=0, seed=3)
    pad, mask = padded(problem, 2, 2, seed=3)
    mask = backend.asarray(mask, dtype="bool")
    loss_fn, params = problem.loss(backend.namespace()), convert(problem.params)
    empty, padding = convert(problem.batch), convert(pad.batch)
    agg = PrivateAggregator(Mechanism((Group("all", ("w", "b"), 1.0, 1.0),)), n=N_RECORDS,
                            q=RATE, backend=backend, seed=5)
    releases = []
    for t in range(MANY_STEPS):
        agg.begin_step()
        out = (backend.private_gradient(loss_fn, params, empty, agg) if t % 2 == 0 else
               backend.private_gradient(loss_fn, params, padding, agg, mask=mask))
        out = convert.numpy(out)
        releases.append(np.concatenate([out["w"].ravel(), out["b"].ravel()]))
    x = np.concatenate(releases)
    repeat = repeated_run(x, 6)
    assert repeat is None, (
        f"releases of pure-noise steps repeat: the 6 values at {repeat[0]} reappear at "
        f"{repeat[1]} of {MANY_STEPS} steps' releases concatenated (6 values a step: a pool "
        f"or cycle of {(repeat[1] - repeat[0]) / 6:g} steps?)")


SCHEDULE = (1.0, 0.5, 2.0, 0.25)


def step_events(ledger) -> list[dict]:
    """The sum-query events of each step of ``ledger``, by group name."""
    steps = []
    for event in ledger.events:
        if isinstance(event, SamplingEvent):
            steps.append({})
        elif isinstance(event, SumQueryEvent):
            steps[-1][event.group] = event
    return steps


def test_clip_schedule_steps_clip_at_each_steps_clip(backend, convert):
    """A :class:`~dpcore.schedules.ClipSchedule` moves the clips (0.3, 0.2) by SCHEDULE's
    factors, step by step; odd steps are padded (4 masked rows). Each noise-free step records
    the schedule's clips in the ledger and its output is the exact clipped mean at those
    clips (1e-4 relative): a step that keeps the clips (or the program built for them) of its
    first step releases the second with twice its recorded bound."""
    problem = tanh_mlp(batch=12, seed=5)
    pad, mask = padded(problem, 2, 2)
    base = mechanism(noise=(0.0, 0.0), clips=(0.3, 0.2))
    agg = PrivateAggregator(base, n=N_RECORDS, q=RATE, backend=backend, seed=0,
                            clipping=ClipSchedule(lambda t: SCHEDULE[t % len(SCHEDULE)]))
    loss_fn, params = problem.loss(backend.namespace()), convert(problem.params)
    clipped = []
    for t, factor in enumerate(SCHEDULE):
        agg.begin_step()
        if t % 2:
            out = backend.private_gradient(loss_fn, params, convert(pad.batch), agg,
                                           mask=backend.asarray(mask, dtype="bool"))
        else:
            out = backend.private_gradient(loss_fn, params, convert(problem.batch), agg)
        out = convert.numpy(out)
        events = step_events(agg.ledger)[t]
        for group in base.groups:
            assert np.isclose(events[group.name].clip, group.clip * factor, rtol=1e-12), (
                f"step {t} records clip {events[group.name].clip} for group {group.name!r}, "
                f"the schedule's is {group.clip * factor}")
        mech = mechanism(noise=(0.0, 0.0), clips=(events["hidden"].clip,
                                                  events["output"].clip))
        sums, count = oracle_clipped_sum(problem, mech)
        clipped.append(count)
        for leaf, total in sums.items():
            np.testing.assert_allclose(
                out[leaf], total / (RATE * N_RECORDS), rtol=1e-4, atol=1e-6,
                err_msg=f"step {t} of a clip schedule (factor {factor}): the noise-free "
                f"private gradient of {leaf!r} is not clipped at the clips the ledger records")
    assert len(set(clipped)) > 1, "test data must be clipped differently at the steps' clips"


def test_clip_schedule_steps_add_each_steps_noise(backend, convert):
    """A clip schedule holding the noise multiplier: the noise moves with the clip (SCHEDULE's
    factors in turn). Twelve steps, alternately on an empty batch and on 8 records, each
    step's noise (its output less the backend's noise-free output under the same schedule)
    over its 10,401 values in units of the std the ledger records for that step has standard
    deviation 1 within 7 standard errors 7/sqrt(2 x 10,401) (4.9%): a step keeping the noise
    of its first step adds 0.5x, 2x or 4x."""
    problem = tanh_mlp(batch=8, dim=50, hidden=200, seed=8)
    empty = problem.take(np.arange(0))
    loss_fn, params = problem.loss(backend.namespace()), convert(problem.params)
    batches = [convert(empty.batch), convert(problem.batch)]

    def schedule():
        return ClipSchedule(lambda t: SCHEDULE[t % len(SCHEDULE)], hold="noise_multiplier")

    exact = PrivateAggregator(mechanism(noise=(0.0, 0.0)), n=N_RECORDS, q=RATE,
                              backend=backend, seed=0, clipping=schedule())
    agg = PrivateAggregator(mechanism(), n=N_RECORDS, q=RATE, backend=backend, seed=6,
                            clipping=schedule())
    for t in range(12):
        exact.begin_step()
        noise_free = convert.numpy(backend.private_gradient(loss_fn, params, batches[1], exact))
        agg.begin_step()
        out = convert.numpy(backend.private_gradient(loss_fn, params, batches[t % 2], agg))
        events = step_events(agg.ledger)[t]
        z = np.concatenate([
            (out[leaf] - (noise_free[leaf] if t % 2 else 0)).ravel() * agg.expected_size
            / (group.scale(leaf) * events[group.name].noise_std)
            for group in agg.mechanism.groups for leaf in group.leaves])
        tolerance = 7 / np.sqrt(2 * z.size)
        assert abs(z.std() - 1) < tolerance, (
            f"step {t} of a clip schedule (factor {SCHEDULE[t % len(SCHEDULE)]}) adds "
            f"{z.std():.4f} x the noise the ledger records for it, expected 1 +- "
            f"{tolerance:.4f}")


def test_adaptive_clipping_steps_clip_where_the_counts_move_the_clips(backend, convert):
    """:class:`~dpcore.adaptive.QuantileClipping` without noise (gradient and counts), over
    six steps of 12 records (odd steps padded with 4 masked rows): each step's output is the
    exact clipped mean at the clips the ledger records for it (1e-4 relative), and each next
    step's clip is the geometric update of the last from the exact fraction of the real
    records left unclipped (1e-6 relative). A step that keeps its first clips, or counts
    padded rows or factors other than those it applied, fails. A backend whose
    ``private_gradient`` refuses adaptive clipping (raising before any query is recorded) is
    skipped, with its reason."""
    problem = tanh_mlp(batch=12, seed=5)
    pad, mask = padded(problem, 2, 2)
    base = mechanism(noise=(0.0, 0.0), clips=(0.3, 0.2))
    config = QuantileClipping(learning_rate=1.0, count_noise_std=0.0)
    agg = PrivateAggregator(base, n=N_RECORDS, q=RATE, backend=backend, seed=0,
                            clipping=config)
    loss_fn, params = problem.loss(backend.namespace()), convert(problem.params)
    clips = [g.clip for g in base.groups]
    for t in range(6):
        agg.begin_step()
        try:
            if t % 2:
                out = backend.private_gradient(loss_fn, params, convert(pad.batch), agg,
                                               mask=backend.asarray(mask, dtype="bool"))
            else:
                out = backend.private_gradient(loss_fn, params, convert(problem.batch), agg)
        except (ValueError, TypeError, NotImplementedError) as exc:
            if t == 0 and not step_events(agg.ledger)[0]:
                pytest.skip(f"backend {backend.name!r} refuses adaptive clipping in "
                            f"private_gradient: {type(exc).__name__}: {exc}")
            raise
        out = convert.numpy(out)
        events = step_events(agg.ledger)[t]
        recorded = [events[g.name].clip for g in base.groups]
        np.testing.assert_allclose(recorded, clips, rtol=1e-6, err_msg=(
            f"the clips step {t} records are not the update of the last step's clips from the "
            f"fraction of its records left unclipped"))
        mech = mechanism(noise=(0.0, 0.0), clips=recorded)
        sums, _ = oracle_clipped_sum(problem, mech)
        for leaf, total in sums.items():
            np.testing.assert_allclose(
                out[leaf], total / (RATE * N_RECORDS), rtol=1e-4, atol=1e-6,
                err_msg=f"step {t} of adaptive clipping: the noise-free private gradient of "
                f"{leaf!r} is not clipped at the clips the ledger records")
        grads = problem.grads(problem.params, problem.batch)
        for g, group in enumerate(mech.groups):
            norms = np.sqrt(sum(np.sum(grads[leaf].reshape(12, -1) ** 2, axis=1)
                                / group.scale(leaf) ** 2 for leaf in group.leaves))
            fraction = (np.sum(norms <= group.clip) - 6) / (RATE * N_RECORDS) + 0.5
            clips[g] = update_clip(group.clip, fraction, config)
