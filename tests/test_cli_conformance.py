"""`dpcore conformance NAME` runs the suite and returns pytest's status."""

import subprocess
import sys


def dpcore(*args):
    return subprocess.run([sys.executable, "-m", "dpcore.cli", *args], capture_output=True,
                          text=True, timeout=600)


def test_conformance_command_runs_the_suite_on_a_backend():
    out = dpcore("conformance", "numpy", "-p", "no:cacheprovider")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "dpcore backend: numpy" in out.stdout
    assert "passed" in out.stdout and "skipped" in out.stdout  # no per-example gradients


def test_conformance_command_names_an_unknown_backend():
    out = dpcore("conformance", "nope")
    assert out.returncode == 2
    assert out.stderr.startswith("dpcore: error: no backend named 'nope'")
    assert len(out.stderr.strip().splitlines()) == 1
