"""Entry point of the PyTorch backend (``[project.entry-points.dpcore] torch = "dpcore_torch.plugin"``).

This module imports no torch: the factory imports :mod:`dpcore_torch.backend` only when the
backend is first asked for, and ``requires=("torch",)`` lists the backend as unavailable (rather
than failing) where torch is not installed.
"""

from __future__ import annotations

from dpcore.hookspecs import hookimpl


def _make_backend():
    from .backend import TorchBackend

    return TorchBackend()


@hookimpl
def dpcore_register_backends(register):
    register("torch", _make_backend, requires=("torch",))
