"""Calibration never exceeds the target and is tight to its tolerance."""

import pytest

from dpcore.accounting import (calibrate_noise_multiplier, calibrate_sampling_rate,
                               calibrate_steps, epsilon)
from dpcore.accounting.pld import MIN_NOISE_MULTIPLIER


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_noise_multiplier(accountant):
    z = calibrate_noise_multiplier(2.0, 1e-5, 0.01, 1000, accountant=accountant)
    assert epsilon([(0.01, z, 1000)], 1e-5, accountant=accountant) <= 2.0
    assert epsilon([(0.01, z * (1 - 1e-3), 1000)], 1e-5, accountant=accountant) > 2.0


def test_noise_multiplier_near_the_smallest_the_pld_accountant_prices():
    """The search stops at the PLD accountant's smallest z (it went below it and failed
    where the answer lay above it); an answer below it is refused naming the RDP one."""
    z = calibrate_noise_multiplier(3000.0, 1e-5, 0.01, 10)
    assert z >= MIN_NOISE_MULTIPLIER and epsilon([(0.01, z, 10)], 1e-5) <= 3000.0
    with pytest.raises(ValueError, match="the smallest the PLD accountant prices; use "
                                         "accountant='rdp'"):
        calibrate_noise_multiplier(1e6, 1e-5, 0.01, 10)
    z = calibrate_noise_multiplier(1e6, 1e-5, 0.01, 10, accountant="rdp")
    assert z < MIN_NOISE_MULTIPLIER and epsilon([(0.01, z, 10)], 1e-5, accountant="rdp") <= 1e6


def test_full_batch_noise_below_the_pld_grids_smallest_z_is_calibrated():
    """At q = 1 the PLD accountant prices any z in closed form: a target needing z below
    the grids' smallest was refused, naming a floor that does not apply."""
    z = calibrate_noise_multiplier(5000.0, 1e-5, 1.0, 1)
    assert z < MIN_NOISE_MULTIPLIER
    assert epsilon([(1.0, z, 1)], 1e-5) <= 5000.0 < epsilon([(1.0, z * (1 - 1e-3), 1)], 1e-5)


def test_sampling_rate():
    q = calibrate_sampling_rate(2.0, 1e-5, 1.0, 1000)
    assert epsilon([(q, 1.0, 1000)], 1e-5) <= 2.0
    assert epsilon([(q * (1 + 1e-3), 1.0, 1000)], 1e-5) > 2.0
    assert calibrate_sampling_rate(50.0, 1e-5, 1.0, 10) == 1.0  # full batch already fits


def test_steps():
    T = calibrate_steps(2.0, 1e-5, 0.01, 1.0)
    assert epsilon([(0.01, 1.0, T)], 1e-5) <= 2.0 < epsilon([(0.01, 1.0, T + 1)], 1e-5)
    assert calibrate_steps(0.01, 1e-5, 0.5, 0.5) == 0  # not even one step fits
    assert calibrate_steps(1.0, 1e-5, 1e-6, 100.0, max_steps=1000) == 1000


def test_mnist_example_calibrates_back():
    z = calibrate_noise_multiplier(2.382, 1e-5, 256 / 60000, 14063)
    assert z == pytest.approx(1.1, rel=2e-3)


@pytest.mark.parametrize("call,message", [
    (lambda: calibrate_noise_multiplier(-1.0, 1e-5, 0.01, 100), "target_epsilon must be"),
    (lambda: calibrate_noise_multiplier(0.0, 1e-5, 0.01, 100), "target_epsilon must be"),
    (lambda: calibrate_noise_multiplier(1.0, 0.0, 0.01, 100), "delta must be in"),
    (lambda: calibrate_noise_multiplier(1.0, 1e-5, 1.5, 100), "q"),
    (lambda: calibrate_noise_multiplier(1.0, 1e-5, 0.01, 0), "steps must be an integer >= 1"),
    (lambda: calibrate_sampling_rate(1.0, 1e-5, -1.0, 100), "noise_multiplier must be"),
    (lambda: calibrate_steps(1.0, 1e-5, 0.01, 0.0), "noise_multiplier must be"),
])
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()
