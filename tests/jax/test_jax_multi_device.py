"""Private steps on batches spread over two devices (the CPU split in two by XLA_FLAGS, in a
process of its own: multi_device_run.py) give what one device gives: the same gradients,
training and ledger, batches cut evenly, the noise drawn once."""

import math
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")


@pytest.fixture(scope="module")
def results(run_script):
    return run_script(Path(__file__).with_name("multi_device_run.py"))


def test_private_gradients_over_two_devices_are_those_of_one(results):
    assert results["grad_difference"] < 1e-6
    assert results["grad_events_equal"] and results["grad_replicated"]


def test_batches_are_cut_evenly_over_the_devices(results):
    """Default buckets: granularity ceil(sqrt(40 * 0.9) / 2) = 3, rounded up to a multiple of
    the 2 devices: 4 (an odd size could not be cut in two)."""
    assert results["spread"]
    assert all(size % 4 == 0 for size in results["sizes"]) and len(set(results["sizes"])) > 1


@pytest.mark.parametrize("chunk", ["None", "8"])
def test_training_over_two_devices_is_training_on_one(results, chunk):
    """train(..., sharding=...) five steps, plain and in chunks of 8 (buckets of multiples
    of lcm(8, 2)): the parameters and the ledger of one device."""
    assert results[f"train_difference_{chunk}"] < 1e-5
    assert results[f"train_events_equal_{chunk}"]


def test_the_optax_route_over_two_devices_records_each_release_once(results):
    assert results["optax_difference"] < 1e-5
    assert results["optax_events_equal"] and results["optax_events"] == 4 * 2


def test_secure_noise_over_two_devices_is_drawn_once(results):
    """Zero gradients: the release times q n is the noise, std z S = 0.55 (once; drawn per
    device and added up it would be 0.55 sqrt(2)). 20 steps of 640 values: relative
    standard error 0.63%, 4 of them (2.5%) catch a 10% error."""
    noise = np.asarray(results["secure_noise"])
    tolerance = 4 / math.sqrt(2 * noise.size)
    assert noise.size == 20 * 640 and tolerance < 0.1 / 3
    assert abs(noise.std() / (1.1 * 0.5) - 1) < tolerance
    assert abs(noise.mean()) < 4 * 0.55 / math.sqrt(noise.size)


def test_the_secure_optax_route_over_two_devices_adds_the_hosts_normals(results):
    """Zero gradients, one release a step: the update is -lr S z / (q n) times the normals
    the compiled program fetched from the host at that step."""
    assert results["secure_optax_draws"] == 2
    assert results["secure_optax_difference"] < 1e-7


def test_a_mesh_with_explicit_axes_is_refused(results):
    assert "has explicit axes ('data',)" in results["explicit_mesh"]
    assert "AxisType.Auto" in results["explicit_mesh"]


def test_clipped_sums_added_up_by_psum_under_shard_map_train_as_on_one_device(results):
    """The pattern the refusal below advises: each device's clipped sums added by psum
    inside shard_map, the optax update outside it."""
    assert results["psum_difference"] < 1e-5 and results["psum_events_equal"]


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("how", ["shard_map", "pmap"])
def test_the_optax_update_under_shard_map_or_pmap_is_refused(results, how, k):
    """Every device would run its callbacks: write the step's events and draw noise."""
    assert "traced under pmap or shard_map" in results[f"{how}_{k}"]
    assert results[f"manual_events_{k}"] == ["SamplingEvent"]
