"""Entry point of the JAX backend (``[project.entry-points.dpcore] jax = "dpcore_jax.plugin"``).

This module imports no jax: the factory imports :mod:`dpcore_jax.backend` only when the backend
is first asked for, and ``requires=("jax",)`` lists the backend as unavailable (rather than
failing) where jax is not installed.
"""

from __future__ import annotations

from dpcore.hookspecs import hookimpl


def _make_backend():
    from .backend import JaxBackend

    return JaxBackend()


@hookimpl
def dpcore_register_backends(register):
    register("jax", _make_backend, requires=("jax",))
