"""pytest plugin of the conformance suite: ``--dpcore-backend NAME``, the ``backend`` fixture,
a report header naming the backend, and capability-based skips.

Checks that need a capability carry ``@pytest.mark.requires_capability("per_example_grads")``;
they are skipped, with that reason, for backends that do not declare it.
"""

from __future__ import annotations

import warnings

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
    """Moves float64 reference data to the backend (as ``dtype``, float32 by default, which
    every backend supports) and back (as float64)."""

    def __init__(self, backend, dtype: str = "float32"):
        self.backend = backend
        self.dtype = dtype

    def __call__(self, data):
        if isinstance(data, dict):
            return {k: self(v) for k, v in data.items()}
        if isinstance(data, tuple):
            return tuple(self(v) for v in data)
        return self.backend.asarray(np.asarray(data, dtype=self.dtype), dtype=self.dtype)

    def numpy(self, data):
        if isinstance(data, dict):
            return {k: self.numpy(v) for k, v in data.items()}
        return np.asarray(self.backend.to_numpy(data), dtype=np.float64)


def converter(backend, dtype: str) -> Converter:
    """A :class:`Converter` to ``dtype``; skips the calling test when the backend's arrays of
    that dtype come back as another (JAX without x64 makes float64 arrays float32)."""
    convert = Converter(backend, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # JAX warns that float64 is not available
        got = np.asarray(backend.to_numpy(convert(np.zeros(2)))).dtype
    if got != np.dtype(dtype):
        pytest.skip(f"backend {backend.name!r} makes {dtype} arrays {got}")
    return convert


@pytest.fixture(scope="session")
def convert(backend):
    return Converter(backend)
