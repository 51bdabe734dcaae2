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


EXPECTED_FAILURES = {
    "noise_too_small": {
        "test_noise.py::test_noise_has_unit_standard_deviation_and_zero_mean",
        "test_noise.py::test_noise_is_normal",
        "test_step.py::test_step_noise_has_the_standard_deviation_the_ledger_records"},
    "clipping_skipped": {
        "test_step.py::test_noise_free_step_is_the_exact_clipped_mean",
        "test_step.py::test_one_record_contributes_at_most_the_clip_bound"},
    "noise_reused": {
        # repeated noise also spoils the variance estimate: 60 copies of 200 draws are not
        # 12,000 independent ones
        "test_step.py::test_step_noise_has_the_standard_deviation_the_ledger_records",
        "test_noise.py::test_fresh_noise_at_every_draw",
        "test_noise.py::test_seeds_reproduce_and_differ",
        "test_noise.py::test_unseeded_generators_differ",
        "test_step.py::test_fresh_noise_at_every_step_and_on_every_leaf",
        "test_step.py::test_seeded_steps_reproduce_and_differ"},
    "ledger_disagrees": {
        "test_step.py::test_step_noise_has_the_standard_deviation_the_ledger_records",
        "test_step.py::test_ledger_has_one_sampling_and_one_query_per_group_per_step"},
    "batch_mean_gradients": {
        "test_gradients.py::test_per_example_gradients",
        "test_gradients.py::test_per_example_squared_norms",
        "test_step.py::test_noise_free_step_is_the_exact_clipped_mean"},
    "fixed_size_batches": {
        "test_sampling.py::test_batch_sizes_follow_the_binomial_law"},
}


@pytest.mark.parametrize("name", EXPECTED_FAILURES)
def test_suite_fails_each_broken_backend_for_the_right_reason(pytester, monkeypatch, name):
    failed = run_suite(pytester, monkeypatch, name, "-p", "broken_backends")
    assert failed == EXPECTED_FAILURES[name]
