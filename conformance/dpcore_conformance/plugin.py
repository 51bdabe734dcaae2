"""pytest plugin of the conformance suite: ``--dpcore-backend NAME`` (repeat it to check
several backends in one run: every check then runs once per backend, its id naming the
backend), the ``backend`` fixture, a report header naming the backends, and capability-based
skips.

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
    group.addoption("--dpcore-backend", metavar="NAME", action="append",
                    help="name of a registered dpcore backend to check (repeatable)")


def pytest_configure(config):
    config.addinivalue_line("markers", "requires_capability(name): skip unless the backend "
                            "declares capability `name`")


def pytest_sessionstart(session):
    """A missing ``--dpcore-backend``, or a backend that cannot be had, is one usage error
    before anything is collected (raised in the ``backend`` fixture, it was an error of every
    check). Here rather than in ``pytest_configure``, which ``--help`` runs too."""
    for name in _backend_names(session.config):
        try:
            dpcore.get_backend(name)
        except LookupError as exc:
            raise pytest.UsageError(f"--dpcore-backend {name}: {exc}") from None


def _backend_names(config) -> list[str]:
    names = config.getoption("dpcore_backend")
    if not names:
        raise pytest.UsageError("the conformance suite needs --dpcore-backend NAME; available: "
                                + ", ".join(dpcore.available_backends()))
    return list(dict.fromkeys(names))


def pytest_report_header(config):
    lines = []
    for name in dict.fromkeys(config.getoption("dpcore_backend") or ()):
        try:
            backend = dpcore.get_backend(name)
        except LookupError as exc:
            lines.append(f"dpcore backend: {name} (not available: {exc})")
            continue
        lines.append(f"dpcore backend: {backend.name} {backend.version}; capabilities: "
                     f"{', '.join(sorted(backend.capabilities)) or 'none'}")
    return lines or None


def pytest_generate_tests(metafunc):
    """Several backends: every check that uses one runs for each."""
    names = metafunc.config.getoption("dpcore_backend") or ()
    if len(set(names)) > 1 and "backend" in metafunc.fixturenames:
        names = _backend_names(metafunc.config)
        metafunc.parametrize("backend", names, indirect=True, scope="session", ids=names)


@pytest.fixture(scope="session")
def backend(request):
    name = getattr(request, "param", None) or _backend_names(request.config)[0]
    return dpcore.get_backend(name)  # pytest_sessionstart got it once already


def pytest_runtest_setup(item):
    needed = [m.args[0] for m in item.iter_markers("requires_capability")]
    if not needed:
        return
    callspec = getattr(item, "callspec", None)
    name = callspec.params["backend"] if callspec and "backend" in callspec.params else \
        _backend_names(item.config)[0]
    backend = dpcore.get_backend(name)
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
