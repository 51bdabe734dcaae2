"""The NumPy backend: for records that already are vectors (users' model updates, metrics,
statistics). Registered through the ``dpcore`` entry points like any other backend."""

from __future__ import annotations

import array_api_compat.numpy as xp
import numpy as np

from .backend import Backend
from .hookspecs import hookimpl


class NumpyBackend(Backend):
    name = "numpy"
    version = np.__version__
    capabilities = frozenset()

    def namespace(self):
        return xp

    def asarray(self, x, dtype=None):
        return np.asarray(x, dtype=dtype)

    def to_numpy(self, x):
        return np.array(x, copy=True)

    def rng(self, seed=None):
        return np.random.default_rng(seed)

    def standard_normal(self, rng, shape, like):
        """Drawn in float64 or float32 (NumPy's generator has no other), then cast."""
        dtype = like.dtype if np.issubdtype(like.dtype, np.floating) else np.float64
        drawn = np.float32 if np.finfo(dtype).bits < 32 else dtype
        return rng, rng.standard_normal(shape, dtype=drawn).astype(dtype, copy=False)


@hookimpl
def dpcore_register_backends(register):
    register("numpy", NumpyBackend)
