"""A model under a tf.distribute strategy of several replicas is refused by every route
(replicas_run.py, in a process of its own with the CPU split into two logical devices): each
replica would add its own noise to its part of the batch."""

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def results(run_script):
    return run_script(Path(__file__).with_name("replicas_run.py"), timeout=600)


def test_fit_and_the_tape_style_call_refuse_replicas_before_the_ledger(results):
    assert results["replicas"] == 2
    for route in ("fit", "call"):
        assert "strategy of 2 replicas" in results[route]["error"], route
        assert "outside the strategy's scope" in results[route]["error"], route
        assert results[route]["events"] == 0, route


def test_the_graph_step_run_per_replica_is_refused(results):
    assert "strategy of 2 replicas" in results["run"]["error"]
