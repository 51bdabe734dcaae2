"""PrivateAggregator end to end on the NumPy backend: ledger first, the right noise, exact sums."""

import math

import numpy as np
import pytest

from dpcore import Group, Ledger, Mechanism, PrivateAggregator, read_ledger
from dpcore.aggregation import NonFiniteNormError
from dpcore.ledger import SamplingEvent, SumQueryEvent

MECHANISM = Mechanism((
    Group("dense", ("w", "b"), clip=1.0, noise_std=3.0),
    Group("joint", ("m",), clip=0.5, noise_std=2.0, scales=(4.0,)),
))
SHAPES = {"w": (100, 100), "b": (5000,), "m": (20000,)}


def zeros(batch):
    return {leaf: np.zeros((batch, *shape)) for leaf, shape in SHAPES.items()}


def test_noise_per_leaf_has_the_standard_deviation_the_ledger_records(tmp_path):
    path = tmp_path / "run.jsonl"
    agg = PrivateAggregator(MECHANISM, n=1000, q=0.02, ledger=path, seed=0)
    steps = 5
    outputs = []
    for _ in range(steps):
        idx = agg.sample()
        outputs.append(agg.release(zeros(len(idx))))
    agg.ledger.close()
    events = read_ledger(path).events
    recorded = {e.group: e for e in events if isinstance(e, SumQueryEvent)}
    expected = {"w": recorded["dense"].noise_std, "b": recorded["dense"].noise_std,
                "m": 4.0 * recorded["joint"].noise_std}  # alpha_j * sigma~_g
    for leaf, std_on_sum in expected.items():
        draws = np.concatenate([o[leaf].ravel() for o in outputs]) * agg.expected_size
        # The sample std of N >= 25,000 normal draws has relative standard error
        # 1/sqrt(2N) <= 0.45%; a 3% tolerance is > 6 of those yet catches a 10% error.
        assert np.std(draws) == pytest.approx(std_on_sum, rel=0.03), leaf
        assert abs(np.mean(draws)) < 5 * std_on_sum / np.sqrt(draws.size)
    # fresh noise at every step and on every leaf: no correlation between draws
    a, b = outputs[0]["b"].ravel(), outputs[1]["b"].ravel()
    assert abs(np.corrcoef(a, b)[0, 1]) < 5 / np.sqrt(a.size)
    assert abs(np.corrcoef(outputs[0]["b"], outputs[0]["w"].ravel()[:5000])[0, 1]) < 5 / np.sqrt(5000)


def test_noiseless_release_is_the_exact_clipped_average():
    mechanism = MECHANISM.with_noise([0.0, 0.0])
    agg = PrivateAggregator(mechanism, n=40, q=0.5, seed=1)
    idx = agg.sample()
    rng = np.random.default_rng(2)
    per_record = {leaf: rng.normal(size=(len(idx), 3)) for leaf in ("w", "b", "m")}
    out = agg.release(per_record)
    expected = {leaf: np.zeros(3) for leaf in per_record}
    for i in range(len(idx)):
        dense = np.concatenate([per_record["w"][i], per_record["b"][i]])
        f = min(1.0, 1.0 / np.linalg.norm(dense))
        g = min(1.0, 0.5 / np.linalg.norm(per_record["m"][i] / 4.0))
        expected["w"] += f * per_record["w"][i]
        expected["b"] += f * per_record["b"][i]
        expected["m"] += g * per_record["m"][i]
    for leaf in per_record:
        np.testing.assert_allclose(out[leaf], expected[leaf] / 20.0, rtol=1e-12)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int32, np.int64, np.bool_])
def test_integer_and_bool_records_are_clipped_and_summed_as_numbers(dtype):
    """Squared in their own dtype, int8 100 gave 16 (not clipped); weighted by clip factors
    in it, the factors became 0 or 1; bools added up as a logical or (an accuracy of 3 of
    4 correct released 1/4). Float64 oracle."""
    rng = np.random.default_rng(0)
    records = (rng.random((40, 3)) < 0.6 if dtype is np.bool_
               else rng.integers(0, 100, (40, 3)).astype(dtype))
    for clip in (1.0, 30.0, 1e9):
        agg = PrivateAggregator(Mechanism((Group("m", ("m",), clip, 0.0),)), n=40, q=0.5)
        agg.begin_step()
        values = records.astype(np.float64)
        norms = np.linalg.norm(values, axis=1, keepdims=True)
        expected = (clip / np.maximum(norms, clip) * values).sum(0) / 20
        np.testing.assert_allclose(agg.release({"m": records})["m"], expected, rtol=1e-12)


def test_complex_records_are_refused():
    """Cast to float64 they lost their imaginary parts (a ComplexWarning only)."""
    agg = PrivateAggregator(Mechanism((Group("m", ("m",), 1.0, 0.0),)), n=40, q=0.5)
    agg.begin_step()
    with pytest.raises(TypeError, match=r"leaf 'm' is complex \(complex128\)"):
        agg.release({"m": np.full((2, 3), 1j)})
    assert agg.ledger.events == (SamplingEvent(0.5, 40),)


def test_float16_records_get_noise_of_the_recorded_std():
    """NumPy draws no float16: the noise is drawn in float32 and cast (the release failed
    after its events were written)."""
    agg = PrivateAggregator(Mechanism((Group("m", ("m",), 1.0, 3.0),)), n=40, q=0.5, seed=0)
    agg.begin_step()
    out = agg.release({"m": np.zeros((5, 20_000), np.float16)})["m"]
    assert out.dtype == np.float16
    assert float(np.std(out.astype(np.float64))) == pytest.approx(3.0 / 20, rel=0.03)


def test_ledger_gets_one_sampling_event_then_one_query_per_group_each_step():
    agg = PrivateAggregator(MECHANISM, n=100, q=0.1, seed=3)
    for _ in range(3):
        agg.release(zeros(len(agg.sample())))
    kinds = [type(e) for e in agg.ledger.events]
    assert kinds == [SamplingEvent, SumQueryEvent, SumQueryEvent] * 3
    assert agg.ledger.events[0] == SamplingEvent(0.1, 100)
    assert agg.ledger.events[2] == SumQueryEvent("joint", 0.5, 2.0)
    assert agg.ledger.steps()[0].count == 3
    assert agg.ledger.steps()[0].noise_multiplier == pytest.approx(MECHANISM.noise_multiplier)


@pytest.mark.parametrize("route", ["sums", "noise draws", "events only"])
def test_a_second_release_of_one_step_under_a_budget_is_refused(route):
    """The budget prices a step as one release: a second query of the same sample would not
    be stopped (a target of 2 ended at 3.76). Without a budget it is one more sum query of
    the step. "events only": record_release, which compiled steps that draw their own noise
    call."""
    from dpcore.budget import PrivacyBudget

    like = {leaf: np.zeros(shape) for leaf, shape in SHAPES.items()}
    for budget in (None, PrivacyBudget(2.0, 1e-5, accountant="rdp")):
        agg = PrivateAggregator(MECHANISM, n=100, q=0.1, seed=3, budget=budget)
        with pytest.raises(RuntimeError, match="no sample to release from"):
            agg.record_release()
        agg.sample()
        for attempt in range(2):
            release = {"sums": lambda: agg.release_sums(like),
                       "noise draws": lambda: agg.release_noisy_sums(agg.noise_draws(like)),
                       "events only": agg.record_release}[route]
            if attempt and budget is not None:
                with pytest.raises(RuntimeError, match="released already"):
                    release()
            else:
                release()
        queries = 2 if budget is not None else 4
        assert [type(e) for e in agg.ledger.events] == [SamplingEvent] + [SumQueryEvent] * queries
        agg.sample()
        agg.release_sums(like)  # the next step releases again


def test_seeds_reproduce_and_differ():
    def run(seed):
        agg = PrivateAggregator(MECHANISM, n=100, q=0.1, seed=seed)
        idx = agg.sample()
        return idx, agg.release(zeros(len(idx)))["b"]

    (i1, o1), (i2, o2), (_, o3) = run(7), run(7), run(8)
    np.testing.assert_array_equal(i1, i2)
    np.testing.assert_array_equal(o1, o2)
    assert not np.array_equal(o1, o3)


def test_padded_batch_uses_only_real_rows():
    mechanism = MECHANISM.with_noise([0.0, 0.0])
    agg = PrivateAggregator(mechanism, n=10, q=0.5, seed=0)
    agg.begin_step()
    rng = np.random.default_rng(0)
    per_record = {leaf: rng.normal(size=(4, 2)) * 0.01 for leaf in ("w", "b", "m")}
    mask = np.array([True, True, False, False])
    for v in per_record.values():
        v[2:] = np.nan
    out = agg.release(per_record, mask=mask)
    np.testing.assert_allclose(out["w"], per_record["w"][:2].sum(axis=0) / 5.0)


@pytest.mark.parametrize("mask, error, message", [
    (np.array([1.0, np.nan, 0.0, 0.0]), ValueError, r"booleans or 0/1 .* got \[nan\]"),
    (np.array([1.0, 0.5, 0.0, 0.0]), ValueError, r"booleans or 0/1 .* got \[0.5\]"),
    (np.array([True, True, False]), ValueError, r"shape \(4,\), one entry per row, got \(3,\)"),
    ([1, 1, 0, 0], TypeError, "mask must be an array of the backend's namespace, got list"),
])
def test_a_mask_that_is_not_one_boolean_per_row_is_refused(mask, error, message):
    """A NaN or fractional entry was read as True: a padded row counted as a record."""
    mechanism = Mechanism((Group("g", ("w",), clip=1.0, noise_std=0.0),))
    agg = PrivateAggregator(mechanism, n=40, q=0.5, seed=1)
    agg.begin_step()
    with pytest.raises(error, match=message):
        agg.release({"w": np.ones((4, 3))}, mask=mask)
    assert agg.ledger.events == (SamplingEvent(0.5, 40),)  # nothing released
    out = agg.release({"w": np.ones((4, 3))}, mask=np.array([1.0, 1.0, 0.0, 0.0]))
    np.testing.assert_allclose(out["w"], np.full(3, 2 / np.sqrt(3) / 20))


def test_errors():
    agg = PrivateAggregator(MECHANISM, n=10, q=0.5)
    with pytest.raises(RuntimeError, match="call sample\\(\\) or begin_step\\(\\) first"):
        agg.release(zeros(0))
    agg.begin_step()
    with pytest.raises(ValueError, match=r"leaves in no group: \['x'\]"):
        agg.release({**zeros(1), "x": np.zeros((1, 2))})
    bad = zeros(2)
    bad["w"][1, 0, 0] = np.nan
    with pytest.raises(NonFiniteNormError, match=r"records \[1\]"):
        agg.release(bad)
    # nothing was released, so nothing but the sampling event is in the ledger
    assert agg.ledger.events == (SamplingEvent(0.5, 10),)
    with pytest.raises(ValueError, match=r"q must be in \(0, 1\], got 2"):
        PrivateAggregator(MECHANISM, n=10, q=2)
    with pytest.raises(ValueError, match=r"n must be .*>= 1, got 0"):
        PrivateAggregator(MECHANISM, n=0, q=0.5)  # q n = 0 divides the releases
    with pytest.raises(TypeError, match="must be a dpcore Mechanism"):
        PrivateAggregator({"w": 1.0}, n=10, q=0.5)


def test_dropped_records_under_on_nonfinite_drop():
    agg = PrivateAggregator(MECHANISM.with_noise([0.0, 0.0]), n=4, q=0.5, on_nonfinite="drop")
    agg.begin_step()
    per_record = {leaf: np.full((2, 1), 0.1) for leaf in ("w", "b", "m")}
    per_record["m"][0, 0] = np.inf
    out = agg.release(per_record)
    assert out["w"][0] == pytest.approx(0.1 / 2.0)


METRIC = Mechanism((Group("metric", ("correct", "loss"), clip=2.0, noise_std=8.0),))


def test_another_mechanism_released_on_the_step_is_priced_with_it(tmp_path):
    """A metric of the sample (its own group, clip and noise) released after the gradient:
    without noise, the exact clipped average (float64 oracle); with noise, noise of the std
    its event records; the event in the step, and the step priced by Eq. (1) over all its
    groups."""
    from dpcore import accounting

    rng = np.random.default_rng(4)
    quiet = PrivateAggregator(MECHANISM, n=100, q=0.2, seed=3)
    idx = quiet.sample()
    rows = {"correct": rng.normal(size=(len(idx), 3)), "loss": rng.normal(size=(len(idx), 2))}
    out = quiet.release(rows, mechanism=METRIC.with_noise([0.0]))
    joined = np.concatenate([rows["correct"], rows["loss"]], axis=1)
    factors = np.minimum(1.0, 2.0 / np.linalg.norm(joined, axis=1))
    assert factors.min() < 0.9  # some rows clipped
    expected = (factors[:, None] * joined).sum(0) / quiet.expected_size
    np.testing.assert_allclose(np.concatenate([out["correct"], out["loss"]]), expected,
                               rtol=1e-12)
    # noise=False (a share that another process's noisy share joins): the noisy mechanism,
    # no noise, the events of the noisy one
    out = quiet.release(rows, mechanism=METRIC, noise=False)
    np.testing.assert_allclose(np.concatenate([out["correct"], out["loss"]]), expected,
                               rtol=1e-12)
    assert quiet.ledger.events[-1] == SumQueryEvent("metric", 2.0, 8.0)
    with pytest.raises(ValueError, match="noise_draws"):
        quiet.release(rows, noise=False)

    path = tmp_path / "run.jsonl"
    agg = PrivateAggregator(MECHANISM, n=1000, q=0.02, ledger=path, seed=3)
    noise = []
    for _ in range(40):
        idx = agg.sample()
        agg.release(zeros(len(idx)))
        out = agg.release({"correct": np.zeros((len(idx), 300)),
                           "loss": np.zeros((len(idx), 200))}, mechanism=METRIC)
        noise.append(np.concatenate([out["correct"], out["loss"]]) * agg.expected_size)
    agg.ledger.close()
    draws = np.concatenate(noise)  # 20,000 draws: relative standard error 0.5%
    assert np.std(draws) == pytest.approx(8.0, rel=0.03)
    assert abs(np.mean(draws)) < 5 * 8.0 / np.sqrt(draws.size)
    events = read_ledger(path).events
    assert [type(e) for e in events[:4]] == [SamplingEvent, SumQueryEvent, SumQueryEvent,
                                             SumQueryEvent]
    assert events[3] == SumQueryEvent("metric", 2.0, 8.0)
    z = (1 / 3.0 ** 2 + (0.5 / 2.0) ** 2 + (2.0 / 8.0) ** 2) ** -0.5  # Eq. (1), all groups
    assert [(s.q, s.noise_multiplier, s.count) for s in agg.ledger.steps()] == [
        (0.02, pytest.approx(z), 40)]
    assert accounting.epsilon(path, 1e-5) == pytest.approx(
        accounting.epsilon([(0.02, z, 40)], 1e-5))


def test_another_mechanism_s_release_refuses_what_it_cannot_price():
    """Nothing written for any of the refusals."""
    from dpcore import PrivacyBudget

    rows = {"correct": np.zeros((3, 2)), "loss": np.zeros((3, 1))}
    agg = PrivateAggregator(MECHANISM, n=100, q=0.1, seed=0)
    with pytest.raises(RuntimeError, match="no sample to release from"):
        agg.release(rows, mechanism=METRIC)
    agg.sample()
    with pytest.raises(ValueError, match=r"\['dense'\] are the aggregator's own"):
        agg.release(rows, mechanism=Mechanism((Group("dense", ("correct", "loss"), 1.0, 1.0),)))
    with pytest.raises(ValueError, match="mechanism is for record='user'"):
        agg.release(rows, mechanism=Mechanism(METRIC.groups, record="user"))
    with pytest.raises(TypeError, match="must be a dpcore Mechanism"):
        agg.release(rows, mechanism="metric")
    bad = {"correct": np.full((3, 2), np.nan), "loss": np.zeros((3, 1))}
    with pytest.raises(NonFiniteNormError):
        agg.release(bad, mechanism=METRIC)
    assert [type(e) for e in agg.ledger.events] == [SamplingEvent]
    budgeted = PrivateAggregator(MECHANISM, n=100, q=0.1, seed=0,
                                 budget=PrivacyBudget(0.5, 1e-5))
    budgeted.sample()
    with pytest.raises(RuntimeError, match="not given as extra, under a privacy budget"):
        budgeted.release(rows, mechanism=METRIC)
    assert [type(e) for e in budgeted.ledger.events] == [SamplingEvent]
    with pytest.raises(ValueError, match="group names must differ"):
        PrivateAggregator(MECHANISM, n=100, q=0.1, extra=[METRIC, METRIC])
    with pytest.raises(TypeError, match="extra must hold dpcore Mechanisms"):
        PrivateAggregator(MECHANISM, n=100, q=0.1, extra=["metric"])


def test_a_budget_prices_the_declared_extra_mechanisms_with_each_step():
    """Declared as extra, a metric's release is priced by the budget with the step (Eq. (1)
    over all groups): the run stops where a ledger of such steps reaches the target, earlier
    than without it; under the budget it is released once a step."""
    from dpcore import PrivacyBudget, accounting

    rows = {"correct": np.zeros((4, 2)), "loss": np.zeros((4, 1))}
    z = (1 / 3.0 ** 2 + (0.5 / 2.0) ** 2 + (2.0 / 8.0) ** 2) ** -0.5
    steps = {}
    for extra in ((), (METRIC,)):
        agg = PrivateAggregator(MECHANISM, n=100, q=0.1, seed=0, extra=extra,
                                budget=PrivacyBudget(0.5, 1e-5))
        if extra:
            assert agg.next_noise_multiplier() == pytest.approx(z)
        while agg.next_step_fits():
            agg.sample()
            agg.release(zeros(4))
            if extra:
                agg.release(rows, mechanism=METRIC)
        steps[extra] = len(agg.ledger.steps()) and agg.ledger.steps()[0].count
        assert accounting.epsilon(agg.ledger, 1e-5) <= 0.5
    assert steps[(METRIC,)] < steps[()]
    assert accounting.epsilon([(0.1, z, steps[(METRIC,)] + 1)], 1e-5) > 0.5  # the next
    fresh = PrivateAggregator(MECHANISM, n=100, q=0.1, seed=0, extra=[METRIC],
                              budget=PrivacyBudget(0.5, 1e-5))
    fresh.sample()
    fresh.release(rows, mechanism=METRIC)
    with pytest.raises(RuntimeError, match="released this extra mechanism already"):
        fresh.release(rows, mechanism=METRIC)
    assert len(fresh.ledger.events) == 2


def test_an_aggregator_refuses_to_release_under_another_ones_sampling(tmp_path):
    # two aggregators on one Ledger object, steps interleaved: A's release would sit under
    # B's sampling event (q = 0.01) and A's own (q = 0.5) would be priced as free
    from dpcore import Ledger

    ledger = Ledger(tmp_path / "run.jsonl")
    mech_a = Mechanism((Group("a", ("x",), clip=1.0, noise_std=1.0),))
    mech_b = Mechanism((Group("b", ("y",), clip=1.0, noise_std=1.0),))
    extra = Mechanism((Group("metric", ("m",), clip=1.0, noise_std=1.0),))
    a = PrivateAggregator(mech_a, n=100, q=0.5, ledger=ledger, seed=0)
    b = PrivateAggregator(mech_b, n=100, q=0.01, ledger=ledger, seed=1)
    a.begin_step()
    b.begin_step()
    before = list(ledger.events)
    with pytest.raises(RuntimeError, match="another aggregator began a step on the same ledger"):
        a.release({"x": np.ones((50, 3))})
    with pytest.raises(RuntimeError, match="another aggregator began a step on the same ledger"):
        a.release({"m": np.ones((50, 1))}, mechanism=extra)
    draws = a.noise_draws({"x": np.zeros(3)})
    with pytest.raises(RuntimeError, match="another aggregator began a step on the same ledger"):
        a.release_noisy_sums(draws)
    with pytest.raises(RuntimeError, match="Give each aggregator a ledger of its own"):
        b.release({"y": np.ones((1, 3))})  # B counted its step as the ledger's first
    assert list(ledger.events) == before
    ledger.close()


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_sums_are_refused_before_anything_is_recorded(tmp_path, bad):
    mechanism = Mechanism((Group("g", ("x",), clip=1.0, noise_std=1.0),))
    agg = PrivateAggregator(mechanism, n=100, q=0.1, ledger=tmp_path / "run.jsonl", seed=0)
    agg.begin_step()
    events = list(agg.ledger.events)
    with pytest.raises(FloatingPointError, match=r"leaves \['x'\] hold NaN or Inf"):
        agg.release_sums({"x": np.array([bad, 1.0])})
    draws = agg.noise_draws({"x": np.zeros(2)})
    draws["x"] += np.array([1.0, bad])
    with pytest.raises(FloatingPointError, match="noise draws hold NaN or Inf"):
        agg.release_noisy_sums(draws)
    assert list(agg.ledger.events) == events
    assert np.all(np.isfinite(agg.release_sums({"x": np.array([0.5, 1.0])})["x"]))
    agg.ledger.close()


def test_sums_that_are_not_arrays_are_refused_before_anything_is_recorded():
    """A Python list was recorded as a release, then failed (AttributeError): each try
    added a sum query to the ledger."""
    mechanism = Mechanism((Group("g", ("x",), clip=1.0, noise_std=1.0),))
    agg = PrivateAggregator(mechanism, n=100, q=0.1, seed=0)
    agg.begin_step()
    for bad in ([1.0, 2.0], 3.0):
        with pytest.raises(TypeError, match=r"arrays of the backend's namespace, got \{'x': "):
            agg.release_sums({"x": bad})
    assert agg.ledger.events == (SamplingEvent(0.1, 100),)


def test_a_unit_of_privacy_mismatch_names_both_units():
    """Microbatches of 8 against a ledger of microbatches of 4 printed record='microbatch'
    for both."""
    fours = Ledger(record="microbatch", microbatch_size=4)
    eights = Mechanism((Group("g", ("x",), 1.0, 1.0),), "microbatch", 8)
    with pytest.raises(ValueError, match=r"ledger is for record='microbatch', microbatch_size="
                                         r"4, the mechanism for record='microbatch', "
                                         r"microbatch_size=8"):
        PrivateAggregator(eights, n=100, q=0.1, ledger=fours)
    agg = PrivateAggregator(Mechanism((Group("g", ("x",), 1.0, 1.0),), "microbatch", 4),
                            n=100, q=0.1, ledger=fours)
    agg.begin_step()
    other = Mechanism((Group("metric", ("m",), 1.0, 1.0),))
    with pytest.raises(ValueError, match=r"the mechanism is for record='example', the ledger "
                                         r"for record='microbatch', microbatch_size=4"):
        agg.release({"m": np.ones((2, 1))}, mechanism=other)


def test_a_step_whose_clip_is_refused_records_nothing():
    """The sampling event was written before the step's mechanism was made: a schedule's
    bad factor left the ledger a step ahead of the aggregator, one more at every retry."""
    from dpcore import ClipSchedule

    agg = PrivateAggregator(Mechanism((Group("g", ("x",), 1.0, 1.0),)), n=10, q=0.5,
                            clipping=ClipSchedule(lambda t: 1.0 if t == 0 else math.nan))
    agg.begin_step()
    for _ in range(2):
        with pytest.raises(ValueError, match="clip schedule factor at step 1 must be a number"):
            agg.begin_step()
    assert agg.step == 0 and agg.ledger.events == (SamplingEvent(0.5, 10),)


def test_a_float16_record_is_released_within_its_clip():
    """Norms, factors and sums in float16 released a clipped record at 1.00098 of its clip
    (float64 oracle); formed in float32, only the output's rounding to float16 remains."""
    for value, width in ((0.849609375, 3), (0.137451171875, 100)):
        agg = PrivateAggregator(Mechanism((Group("g", ("x",), 1.0, 0.0),)), n=1, q=1.0)
        agg.begin_step()
        out = agg.release({"x": np.full((1, width), value, np.float16)})["x"]
        assert out.dtype == np.float16
        assert np.linalg.norm(out.astype(np.float64)) <= 1.0 + 2.0 ** -11



def test_16_bit_sums_are_noised_in_float32():
    """Scaled in float16, noise of std 2e-8 (below float16's smallest subnormal, 6e-8) was
    mostly exact zeros before division by q n = 0.4; now drawn and scaled in float32, the
    release is only rounded to float16 at the end (post-processing). 16-bit noise_draws, into
    which a backend adds its sums, are refused."""
    agg = PrivateAggregator(Mechanism((Group("m", ("m",), 1.0, 2e-8),)), n=4, q=0.1, seed=0)
    agg.begin_step()
    out = agg.release_sums({"m": np.zeros(20_000, np.float16)})["m"]
    assert out.dtype == np.float16
    assert np.mean(out == 0) < 0.5
    agg.begin_step()
    with pytest.raises(TypeError, match=r"16-bit ones would scale the noise.*'m': 'float16'"):
        agg.noise_draws({"m": np.zeros(10, np.float16)})
    assert len(agg.ledger.events) == 3  # the refused step recorded no query
