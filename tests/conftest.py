"""Shared fixtures: the Array API namespaces the core kernels are tested on, the examples,
scripts run in a process of their own, and a secure generator's draws."""

import importlib
import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest


def _namespaces():
    found = [("numpy", lambda: importlib.import_module("array_api_compat.numpy"), 1e-12)]
    if importlib.util.find_spec("array_api_strict"):
        found.append(("array_api_strict", lambda: importlib.import_module("array_api_strict"), 1e-12))
    if importlib.util.find_spec("torch"):
        found.append(("torch", lambda: importlib.import_module("array_api_compat.torch"), 1e-12))
    if importlib.util.find_spec("jax"):
        # JAX computes in float32 unless x64 is enabled globally; test it as users run it.
        found.append(("jax", lambda: importlib.import_module("jax.numpy"), 2e-5))
    return found


@pytest.fixture(params=_namespaces(), ids=lambda p: p[0])
def namespace(request):
    """(xp, rtol): an array namespace and the relative tolerance of its default float dtype."""
    name, load, rtol = request.param
    return load(), rtol


EXAMPLES = pathlib.Path(__file__).parents[1] / "examples"


@pytest.fixture(scope="session")
def load_example():
    """``load_example("digits")`` imports ``examples/digits.py`` as a module."""
    def load(name):
        spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture(scope="session")
def run_script():
    """``run_script(path, *args)``: run a test script in a Python process of its own (for a
    device setup that must come before the framework starts) and return the JSON object its
    last line of output holds."""
    def run(script: pathlib.Path, *args: str, timeout: float = 900) -> dict:
        done = subprocess.run([sys.executable, str(script), *args], capture_output=True,
                              text=True, timeout=timeout)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    return run


@pytest.fixture
def record_normals():
    """``record_normals(aggregator)``: the list a secure aggregator's generator appends each
    draw of normals to as it hands it out (the conformance suite's probe)."""
    from dpcore_conformance.checks import record_secure_draws
    return record_secure_draws
