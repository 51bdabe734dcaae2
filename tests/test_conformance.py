"""The conformance suite is tested too: it passes every installed backend and fails each
deliberately broken one (``broken_backends.py``), for the right reason.

Each run is a separate pytest process, as a user's run is: in-process runs would unload and
reload framework modules between runs, which torch does not survive."""

import os
import pathlib
import re

import pytest

import dpcore

pytest.importorskip(
    "dpcore_tinytorch.backend", reason="the example third-party backend (docs/examples/dpcore-tinytorch) "
    "is the base of the broken backends; pip install -e docs/examples/dpcore-tinytorch")
pytest.importorskip("torch")

HERE = pathlib.Path(__file__).parent


def run_suite(pytester, monkeypatch, name, *extra):
    """Run the conformance suite against backend ``name``; the names of the failed checks."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    result = pytester.runpytest_subprocess(
        "-p", "dpcore_conformance.plugin", "--pyargs", "dpcore_conformance",
        "--dpcore-backend", name, "-p", "no:cacheprovider", "-rf", *extra, timeout=600)
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) + outcomes.get("failed", 0) > 0, result.stdout.str()
    return set(re.findall(r"^FAILED \S*?(test_\w+\.py::test_\w+)", result.stdout.str(),
                          re.MULTILINE))


@pytest.mark.parametrize("name", [n for n in ("numpy", "tinytorch", "torch", "jax", "tensorflow")
                                  if n in dpcore.available_backends()])
def test_suite_passes_every_installed_backend(pytester, monkeypatch, name):
    assert run_suite(pytester, monkeypatch, name) == set()


NOISE_LAW = {f"test_noise.py::test_noise_{check}" for check in (
    "has_unit_standard_deviation_and_zero_mean", "is_normal", "has_normal_tails")}
STEP_NOISE = {f"test_step.py::test_{check}" for check in (
    "step_noise_has_the_standard_deviation_the_ledger_records",
    "every_leaf_gets_the_noise_the_ledger_records", "step_noise_is_normal")}
EXPECTED_FAILURES = {
    "noise_too_small": NOISE_LAW | STEP_NOISE,
    "clipping_skipped": {
        "test_step.py::test_noise_free_step_is_the_exact_clipped_mean",
        "test_step.py::test_one_record_contributes_at_most_the_clip_bound",
        "test_step.py::test_masked_step_ignores_padded_rows"},
    "noise_reused": STEP_NOISE | {
        # repeated noise also spoils the variance estimates: 60 copies of one draw are not
        # 60 independent ones
        "test_noise.py::test_fresh_noise_at_every_draw",
        "test_noise.py::test_seeds_reproduce_and_differ",
        "test_noise.py::test_unseeded_generators_differ",
        "test_step.py::test_fresh_noise_at_every_step",
        "test_step.py::test_fresh_noise_on_every_leaf",
        "test_step.py::test_seeded_steps_reproduce_and_differ"},
    "ledger_disagrees": STEP_NOISE | {
        "test_step.py::test_ledger_has_one_sampling_and_one_query_per_group_per_step",
        "test_step.py::test_masked_step_ignores_padded_rows"},  # it drops the mask too
    "batch_mean_gradients": {
        "test_gradients.py::test_per_example_gradients",
        "test_gradients.py::test_per_example_squared_norms",
        "test_step.py::test_noise_free_step_is_the_exact_clipped_mean",
        "test_step.py::test_masked_step_ignores_padded_rows"},
    "fixed_size_batches": {
        "test_sampling.py::test_batch_sizes_follow_the_binomial_law"},
    "undeclared_capabilities": {
        "test_capabilities.py::test_overridden_methods_are_declared"},
    "noise_too_small_on_records": STEP_NOISE,  # pooled with the empty steps' right noise
    "small_leaves_unnoised": {
        "test_step.py::test_every_leaf_gets_the_noise_the_ledger_records",
        "test_step.py::test_fresh_noise_on_every_leaf"},  # b2's noise is constant: no correlation
    "groups_share_noise": {"test_step.py::test_fresh_noise_on_every_leaf"},
    "laplace_noise": {"test_step.py::test_step_noise_is_normal"},
    "noise_ring": STEP_NOISE | {  # 60 steps hold 5 draws: the variance estimates spread
        "test_noise.py::test_fresh_noise_at_every_draw",
        "test_step.py::test_fresh_noise_at_every_step"},
    "shared_noise_buffer": {
        "test_noise.py::test_fresh_noise_at_every_draw",
        "test_step.py::test_a_kept_release_is_not_overwritten"},
    "truncated_noise": {"test_noise.py::test_noise_has_normal_tails"},
    "cycling_noise": NOISE_LAW | {"test_noise.py::test_noise_does_not_cycle"},
    "float64_noise_too_small": NOISE_LAW | {  # the float64 draw and step
        "test_step.py::test_step_noise_has_the_standard_deviation_the_ledger_records",
        "test_step.py::test_every_leaf_gets_the_noise_the_ledger_records",
        "test_step.py::test_step_noise_is_normal"},
    "mask_ignored": {"test_step.py::test_masked_step_ignores_padded_rows"},
    "epoch_sampler": {
        "test_sampling.py::test_every_record_is_equally_likely",
        "test_sampling.py::test_consecutive_batches_are_independent"},
    "rounded_rate_sampler": {"test_sampling.py::test_the_sampling_rate_is_q"},
}


@pytest.mark.parametrize("name", EXPECTED_FAILURES)
def test_suite_fails_each_broken_backend_for_the_right_reason(pytester, monkeypatch, name):
    failed = run_suite(pytester, monkeypatch, name, "-p", "broken_backends")
    assert failed == EXPECTED_FAILURES[name]
