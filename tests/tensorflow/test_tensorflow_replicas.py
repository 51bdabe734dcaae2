"""Keras fit of a private model under a MirroredStrategy of two replicas (replicas_run.py, in
a process of its own with the CPU split into two logical devices): each replica clips its part
of the batch, the first adds the noise, and the sum is the one-device step."""

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def results(run_script):
    return run_script(Path(__file__).with_name("replicas_run.py"), timeout=600)


def test_two_replicas_take_the_steps_of_one_device(results):
    """q = 1 and a clip that binds, no noise: three steps leave the weights where one device
    leaves them, the ledger records three steps, the independence check ran."""
    same = results["same"]
    assert results["replicas"] == 2
    assert same["difference"] < 1e-4 * same["largest_update"]
    assert same["steps"] == 3 and same["checked"] and same["check_source_dropped"]


def test_seeded_runs_under_replicas_repeat(results):
    assert results["reproducible"]["difference"] == 0


@pytest.mark.parametrize("kind", ["noise", "secure_noise"])
def test_the_noise_is_added_once_over_the_replicas(results, kind):
    """Zero gradients: the update times q n has the std the ledger records, not sqrt(2) times
    it (noise in both replicas). 14,000 values: relative standard error 0.6%, 4 of them."""
    noise = results[kind]
    assert noise["values"] == 14_000
    assert abs(noise["std_ratio"] - 1) < 4 / (2 * noise["values"]) ** 0.5


def test_a_nonfinite_record_of_the_second_replica_stops_fit(results):
    assert results["nonfinite"]["error"].startswith("NonFiniteNormError: 1 record(s)")


def test_the_independence_check_refuses_a_mixing_model_before_any_step(results):
    assert results["mixing"]["error"].startswith("NotPerExampleError: the model mixes")
    assert results["mixing"]["events"] == 0


def test_graph_step_per_replica_adds_up_to_the_whole_batchs_step(results):
    assert results["per_replica"]["difference"] < 1e-4 * results["per_replica"]["largest"]


def test_the_tape_style_call_under_replicas_is_refused_before_the_ledger(results):
    assert "not under a tf.distribute strategy of 2 replicas" in results["call"]["error"]
    assert results["call"]["events"] == 0


def test_a_strategy_other_than_mirrored_is_refused_before_the_ledger(results):
    """With several workers each host would draw its own sample and write its own ledger."""
    error = results["other_strategy"]["error"]
    assert error.startswith("ValueError: a CentralStorageStrategy of 2 replicas")
    assert "MirroredStrategy" in error and results["other_strategy"]["events"] == 0


def test_an_optimizer_that_clips_each_replicas_part_is_refused(results):
    """Keras clips per replica, before the sum: a part without noise clipped is not
    post-processing of the private sum."""
    assert "{'clipnorm': 1.0} would act on each of the 2 replicas'" in results["clipnorm"][
        "error"]
    assert results["clipnorm"]["events"] == 0


def test_three_replicas_take_cut_batches_and_the_steps_of_one_device(run_script):
    results = run_script(Path(__file__).with_name("replicas_run.py"), "3", timeout=600)
    assert results["replicas"] == 3
    assert results["three"]["difference"] < 1e-4 * results["three"]["largest_update"]


def test_validation_batches_with_a_padding_mask_are_taken(results):
    assert results["validation"]["error"] is None and results["validation"]["steps"] == 1


def test_a_datasets_batches_that_do_not_divide_over_the_replicas_are_padded(results):
    got = results["odd_batches"]
    assert got["error"] is None and got["steps"] == 3
    assert got["difference"] < 1e-4 * got["largest_update"]


def test_a_dataset_of_unknown_length_records_the_steps_trained_on(results):
    assert results["unknown_length"] == {"error": None, "trained": 6, "steps": 6}


@pytest.mark.parametrize("kind, message", [
    ("jit", "jit_compile=True under 2 replicas"),
    ("train_on_batch", "train_on_batch under several replicas would give every replica")])
def test_what_the_replicas_cannot_take_is_refused_before_the_ledger(results, kind, message):
    assert message in results[kind]["error"] and results[kind]["events"] == 0
