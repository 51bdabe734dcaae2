"""The user-level federated example runs, learns, and accounts for what it released."""

import json

import pytest

from dpcore import read_ledger
from dpcore.accounting import epsilon


@pytest.fixture(scope="module")
def federated(load_example):
    return load_example("federated")


def test_example_learns_privately_and_its_ledger_prices_the_run(federated, tmp_path, capsys):
    path = tmp_path / "fed.jsonl"
    summary = federated.main(["--rounds", "60", "--users", "1000", "--ledger", str(path),
                              "--json"])
    assert json.loads(capsys.readouterr().out) == summary
    ledger = read_ledger(path)
    assert ledger.header.record == "user"
    assert sum(s.count for s in ledger.steps()) == 60
    assert all(s.noise_multiplier == pytest.approx(1.0, rel=1e-12) for s in ledger.steps())
    assert summary["epsilon"] == pytest.approx(epsilon(ledger, summary["delta"]))
    assert summary["final_clip"] > 0.1  # adaptive clipping moved up from C_0
    start = federated.mse(federated.np.zeros(20), *federated.make_users(
        1000, 20, 20, federated.np.random.default_rng(0)))
    assert summary["private_mse"] < 0.2 * start
    assert summary["private_mse"] < 1.5 * summary["non_private_mse"]
