"""pytest plugin of the conformance suite: ``--dpcore-backend NAME``, the ``backend`` fixture,
a report header naming the backend, and capability-based skips.

Checks that need a capability carry ``@pytest.mark.requires_capability("per_example_grads")``;
they are skipped, with that reason, for backends that do not declare it.
"""

from __future__ import annotations

import numpy as np
import pytest

import dpcore


def pytest_addoption(parser):
    group = parser.getgroup("dpcore", "dpcore conformance")
    group.addoption("--dpcore-backend", metavar="NAME",
                    help="name of the registered dpcore backend to check")


def pytest_configure(config):
    config.addinivalue_line("markers", "requires_capability(name): skip unless the backend "
                            "declares capability `name`")


def _backend_name(config) -> str:
    name = config.getoption("dpcore_backend")
    if not name:
        raise pytest.UsageError("the conformance suite needs --dpcore-backend NAME; available: "
                                + ", ".join(dpcore.available_backends()))
    return name


def pytest_report_header(config):
    name = config.getoption("dpcore_backend")
    if not name:
        return None
    try:
        backend = dpcore.get_backend(name)
    except LookupError as exc:
        return f"dpcore backend: {name} (not available: {exc})"
    return (f"dpcore backend: {backend.name} {backend.version}; capabilities: "
            f"{', '.join(sorted(backend.capabilities)) or 'none'}")


@pytest.fixture(scope="session")
def backend(pytestconfig):
    name = _backend_name(pytestconfig)
    try:
        return dpcore.get_backend(name)
    except LookupError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_runtest_setup(item):
    needed = [m.args[0] for m in item.iter_markers("requires_capability")]
    if not needed:
        return
    backend = dpcore.get_backend(_backend_name(item.config))
    for capability in needed:
        if capability not in backend.capabilities:
            pytest.skip(f"backend {backend.name!r} does not declare capability {capability!r}")


class Converter:
    """Moves float64 reference data to the backend (as float32, which every backend supports)
    and back."""

    def __init__(self, backend):
        self.backend = backend

    def __call__(self, data):
        if isinstance(data, dict):
            return {k: self(v) for k, v in data.items()}
        if isinstance(data, tuple):
            return tuple(self(v) for v in data)
        return self.backend.asarray(np.asarray(data, dtype=np.float32), dtype="float32")

    def numpy(self, data):
        if isinstance(data, dict):
            return {k: self.numpy(v) for k, v in data.items()}
        return np.asarray(self.backend.to_numpy(data), dtype=np.float64)


@pytest.fixture(scope="session")
def convert(backend):
    return Converter(backend)
