"""Entry point of the TensorFlow backend
(``[project.entry-points.dpcore] tensorflow = "dpcore_tensorflow.plugin"``).

This module imports no TensorFlow: the factory imports :mod:`dpcore_tensorflow.backend` only
when the backend is first asked for, and ``requires=("tensorflow",)`` lists the backend as
unavailable (instead of failing) where TensorFlow is not installed.
"""

from __future__ import annotations

from dpcore.hookspecs import hookimpl


def _make_backend():
    from .backend import TensorFlowBackend

    return TensorFlowBackend()


@hookimpl
def dpcore_register_backends(register):
    register("tensorflow", _make_backend, requires=("tensorflow",))
