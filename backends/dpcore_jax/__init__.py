"""dpcore's JAX backend: private gradients compiled with ``jit``, an optax transformation and
a training loop, with every step in the dpcore privacy ledger.

Importing this package imports no jax (so the ``dpcore`` entry point stays cheap); the names
below are loaded from their modules on first use.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Buckets": "batching",
    "PoissonBatches": "batching",
    "JaxBackend": "backend",
    "clipped_sums": "clipping",
    "noisy_mean": "clipping",
    "PrivateGrad": "grad",
    "private_grad": "grad",
    "PrivateStep": "training",
    "train": "training",
    "private_aggregate": "transform",
    "private_optimizer": "transform",
    "make_key": "backend",
    "leaf_names": "names",
    "leaf_sizes": "names",
    "named_leaves": "names",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
