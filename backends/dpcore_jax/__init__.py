"""dpcore's JAX backend: private gradients compiled with ``jit``, an optax transformation and
a training loop, with every step in the dpcore privacy ledger.

Importing this package imports no jax (so the ``dpcore`` entry point stays cheap); the names
below are loaded from their modules on first use.
"""

from __future__ import annotations

from dpcore.plugins import lazy_exports

_HOME = {
    "Buckets": "batching",
    "PoissonBatches": "batching",
    "JaxBackend": "backend",
    "ClippedSums": "clipping",
    "clipped_sums": "clipping",
    "noisy_mean": "clipping",
    "PrivateGrad": "grad",
    "private_grad": "grad",
    "PrivateStep": "training",
    "train": "training",
    "private_aggregate": "transform",
    "private_optimizer": "transform",
    "drop_parts": "transform",
    "make_key": "backend",
    "leaf_names": "names",
    "leaf_sizes": "names",
    "named_leaves": "names",
    "unflatten_like": "names",
}

__all__ = sorted(_HOME)
__getattr__, __dir__ = lazy_exports(__name__, _HOME)
