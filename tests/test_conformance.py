"""The conformance suite is tested too: it passes every installed backend and fails each
deliberately broken one (``broken_backends.py``), for the right reason.

The suite runs in pytest processes of its own, as a user's run does (in-process runs would
unload and reload framework modules between runs, which torch does not survive): one for the
installed backends, one for the broken ones, each checking all its backends (a repeated
``--dpcore-backend``), so that the frameworks load once."""

import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

import pytest

import dpcore

pytest.importorskip(
    "dpcore_tinytorch.backend", reason="the example third-party backend (docs/examples/dpcore-tinytorch) "
    "is the base of the broken backends; pip install -e docs/examples/dpcore-tinytorch")
pytest.importorskip("torch")

HERE = pathlib.Path(__file__).parent
INSTALLED = [n for n in ("numpy", "tinytorch", "torch", "jax", "tensorflow")
             if n in dpcore.available_backends()]


@dataclass
class Outcome:
    """One backend's run of the suite: the checks that failed or erred, how many ran, and
    the messages of the failures, by check."""
    failed: set = field(default_factory=set)
    ran: int = 0
    messages: dict = field(default_factory=dict)


def run_suite(directory, names, *extra) -> dict[str, Outcome]:
    """Run the conformance suite once against every backend of ``names``."""
    report = directory / "report.xml"
    path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    backends = [arg for name in names for arg in ("--dpcore-backend", name)]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "dpcore_conformance.plugin", "--pyargs",
         "dpcore_conformance", *backends, "-p", "no:cacheprovider", "-q",
         f"--junitxml={report}", *extra], cwd=directory,
        env=dict(os.environ, PYTHONPATH=path), capture_output=True,
        text=True, timeout=1500)
    assert report.exists(), (run.stdout + run.stderr)[-8000:]
    outcomes = {name: Outcome() for name in names}
    for case in ET.parse(report).getroot().iter("testcase"):
        check, _, params = case.get("name").partition("[")
        (name,) = set(names) & set(params.rstrip("]").split("-")) if len(names) > 1 else names
        if case.find("skipped") is not None:
            continue
        outcomes[name].ran += 1
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        if failure is not None:
            module = case.get("classname").rsplit(".", 1)[-1]
            outcomes[name].failed.add(f"{module}.py::{check}")
            outcomes[name].messages[f"{module}.py::{check}"] = (
                outcomes[name].messages.get(f"{module}.py::{check}", "")
                + (failure.get("message") or "") + "\n")
    return outcomes


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    return run_suite(tmp_path_factory.mktemp("installed"), INSTALLED)


@pytest.mark.parametrize("name", INSTALLED)
def test_suite_passes_every_installed_backend(installed, name):
    assert installed[name].ran > 0 and installed[name].failed == set()


NOISE_STD = "test_noise.py::test_noise_has_unit_standard_deviation_and_zero_mean"
NOISE_LAW = {NOISE_STD, "test_noise.py::test_noise_is_normal",
             "test_noise.py::test_noise_has_normal_tails"}
STEP_STD = {"test_step.py::test_step_noise_has_the_standard_deviation_the_ledger_records",
            "test_step.py::test_every_leaf_gets_the_noise_the_ledger_records"}
STEP_NOISE = STEP_STD | {"test_step.py::test_step_noise_is_normal"}
ONE_VALUE_LEAVES = "test_step.py::test_one_value_leaves_get_the_noise_the_ledger_records"
SECURE_DRAWS = "test_step.py::test_secure_steps_add_the_secure_generators_draws"
REPEATS = "test_step.py::test_no_noise_values_repeat_in_the_releases"
MASKED_STEP = "test_step.py::test_masked_step_ignores_padded_rows"
MANY_STEPS = "test_step.py::test_no_release_repeats_over_many_steps"
MANY_DRAWS = {"test_noise.py::test_no_small_draw_repeats", MANY_STEPS}
SCHEDULE_CLIPS = "test_step.py::test_clip_schedule_steps_clip_at_each_steps_clip"
SCHEDULE_NOISE = "test_step.py::test_clip_schedule_steps_add_each_steps_noise"
ADAPTIVE = "test_step.py::test_adaptive_clipping_steps_clip_where_the_counts_move_the_clips"
LARGE_BATCH = {"test_gradients.py::test_per_example_gradients_of_a_large_batch",
               "test_step.py::test_noise_free_step_on_a_large_batch"}
SAMPLING_RATE = "test_sampling.py::test_the_sampling_rate_is_q"
# the checks of the 60-step runs, which all fail when the masked run errs
NOISE_RUNS = STEP_NOISE | {SECURE_DRAWS, REPEATS, "test_step.py::test_fresh_noise_at_every_step",
                           "test_step.py::test_fresh_noise_on_every_leaf",
                           "test_step.py::test_a_kept_release_is_not_overwritten"}
# every check whose batches hold masked NaN rows
PADDED = NOISE_RUNS | {MASKED_STEP, MANY_STEPS, SCHEDULE_CLIPS, ADAPTIVE}

EXPECTED_FAILURES = {
    # the shape checks (normality, tails) standardise by the sample's std: a wrong scale
    # fails the standard-deviation checks only
    "noise_too_small": STEP_STD | {
        NOISE_STD, "test_noise.py::test_shaped_draws_have_the_law_in_every_row",
        ONE_VALUE_LEAVES, SCHEDULE_NOISE},
    "clipping_skipped": {
        "test_step.py::test_noise_free_step_is_the_exact_clipped_mean",
        "test_step.py::test_one_record_contributes_at_most_the_clip_bound",
        "test_step.py::test_noise_free_step_on_a_large_batch", MASKED_STEP, SCHEDULE_CLIPS},
    "noise_reused": STEP_NOISE | MANY_DRAWS | {
        # repeated noise also spoils the variance estimates: 60 copies of one draw are not
        # 60 independent ones
        "test_noise.py::test_fresh_noise_at_every_draw",
        "test_noise.py::test_seeds_reproduce_and_differ",
        "test_noise.py::test_unseeded_generators_differ",
        "test_step.py::test_fresh_noise_at_every_step",
        "test_step.py::test_fresh_noise_on_every_leaf",
        "test_step.py::test_seeded_steps_reproduce_and_differ", REPEATS},
    "ledger_disagrees": STEP_STD | {
        "test_step.py::test_ledger_has_one_sampling_and_one_query_per_group_per_step",
        ONE_VALUE_LEAVES, SECURE_DRAWS, SCHEDULE_NOISE,
        ADAPTIVE},  # it records its own events and releases no counts: the clips stay put
    "batch_mean_gradients": LARGE_BATCH | NOISE_RUNS | {
        # a padded NaN row makes every row's mean NaN: the masked run errs
        "test_gradients.py::test_per_example_gradients",
        "test_gradients.py::test_a_bound_method_loss_is_read_at_every_call",
        "test_gradients.py::test_per_example_squared_norms",
        "test_step.py::test_noise_free_step_is_the_exact_clipped_mean", MASKED_STEP,
        SCHEDULE_CLIPS, ADAPTIVE},
    "fixed_size_batches": {  # drawn without replacement: records exclude each other
        "test_sampling.py::test_batch_sizes_follow_the_binomial_law",
        "test_sampling.py::test_records_are_sampled_independently_of_each_other",
        SAMPLING_RATE},  # round(12.5) records at q n = 12.5
    "undeclared_capabilities": {
        "test_capabilities.py::test_overridden_methods_are_declared"},
    # pooled with the empty steps' right noise; the secure steps' noise is 0.9x the draws
    "noise_too_small_on_records": STEP_STD | {SECURE_DRAWS, SCHEDULE_NOISE},
    "small_leaves_unnoised": {
        "test_step.py::test_every_leaf_gets_the_noise_the_ledger_records",
        "test_step.py::test_fresh_noise_on_every_leaf",  # b2's noise is constant: no correlation
        ONE_VALUE_LEAVES},
    "groups_share_noise": {"test_step.py::test_fresh_noise_on_every_leaf"},
    "laplace_noise": {"test_step.py::test_step_noise_is_normal", SECURE_DRAWS},
    "one_value_leaves_short": {ONE_VALUE_LEAVES},
    "tiled_leaf_noise": {REPEATS},
    "secure_ignored": {SECURE_DRAWS},
    # 60 steps hold 5 draws: the variance estimates spread
    "noise_ring": STEP_NOISE | MANY_DRAWS | {
        "test_noise.py::test_fresh_noise_at_every_draw",
        "test_step.py::test_fresh_noise_at_every_step", REPEATS},
    "shared_noise_buffer": {
        "test_noise.py::test_fresh_noise_at_every_draw",
        "test_step.py::test_a_kept_release_is_not_overwritten"},
    "truncated_noise": {"test_noise.py::test_noise_has_normal_tails"},
    "cycling_noise": NOISE_LAW | {"test_noise.py::test_noise_does_not_cycle",
                                  "test_noise.py::test_noise_values_are_uncorrelated_within_a_draw",
                                  "test_noise.py::test_shaped_draws_have_the_law_in_every_row"},
    "float64_noise_too_small": STEP_STD | {NOISE_STD},  # the float64 draw and step
    "mask_ignored": PADDED,  # the NaN rows' norms are refused
    "epoch_sampler": {
        "test_sampling.py::test_every_record_is_equally_likely",
        "test_sampling.py::test_consecutive_batches_are_independent"},
    "rounded_rate_sampler": {SAMPLING_RATE},
    "percent_rate_sampler": {SAMPLING_RATE},
    "window_sampler": {
        "test_sampling.py::test_records_are_sampled_independently_of_each_other"},
    "int_seeded_sampler": {
        "test_sampling.py::test_sampler_seeds_of_the_aggregator_reproduce_and_differ"},
    "mirrored_noise": {"test_noise.py::test_noise_values_are_uncorrelated_within_a_draw"},
    "row_repeated_noise": {"test_noise.py::test_shaped_draws_have_the_law_in_every_row"},
    "float32_in_float64_noise": {"test_noise.py::test_noise_has_the_precision_of_its_dtype"},
    "global_generator": {"test_noise.py::test_generators_keep_streams_of_their_own"},
    "chunk_mean_gradients": LARGE_BATCH | {"test_gradients.py::test_per_example_gradients"},
    "loss_kept_by_equality": {
        "test_gradients.py::test_a_bound_method_loss_is_read_at_every_call",
        "test_step.py::test_a_step_reads_a_bound_method_loss_at_every_call"},
    "step_keeps_its_loss": {"test_step.py::test_a_step_reads_a_bound_method_loss_at_every_call"},
    # each of these the suite passed before the check named was added
    "noise_pool": MANY_DRAWS,  # period 64 draws: 60 steps, 10 draws saw none repeat
    "fused_noise_pool": {MANY_STEPS},
    "masked_noise_half": STEP_STD,  # the masked run's
    "mask_shifted": {MASKED_STEP, SCHEDULE_CLIPS, ADAPTIVE},  # a padding row counted
    "stale_clips": {SCHEDULE_CLIPS},  # a fused step: it refuses adaptive clipping
    "stale_noise": {SCHEDULE_NOISE},
    "adaptive_counts_padding": {ADAPTIVE},
    "chunk_shift_gradients": LARGE_BATCH,
    "integer_batch_sampler": {SAMPLING_RATE},  # 12 records at q n = 12.5
}


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    return run_suite(tmp_path_factory.mktemp("broken"), list(EXPECTED_FAILURES),
                     "-p", "broken_backends")


@pytest.mark.parametrize("name", EXPECTED_FAILURES)
def test_suite_fails_each_broken_backend_for_the_right_reason(broken, name):
    assert broken[name].ran > 0 and broken[name].failed == EXPECTED_FAILURES[name]


def test_failure_messages_name_the_fault(broken):
    """A secure step's noise that is the secure draws at a wrong scale is reported as a wrong
    scale (it was reported as noise from another generator), noise from another generator
    as such."""
    assert "0.9000 x the draws on group 'hidden'" in broken[
        "noise_too_small_on_records"].messages[SECURE_DRAWS]
    assert "0.8000 x the draws on group 'output'" in broken["ledger_disagrees"].messages[
        SECURE_DRAWS]  # the ledger records 1.25x the noise added
    for name in ("secure_ignored", "laplace_noise"):
        message = broken[name].messages[SECURE_DRAWS]
        assert "another generator" in message and "wrong scale" not in message, message
