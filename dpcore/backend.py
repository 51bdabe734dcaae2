"""The backend contract: what a framework gives the core.

The core computes on arrays through the Python Array API; a backend supplies what that API
lacks: the namespace of its arrays, conversion to and from NumPy, a random generator
(seedable for tests, OS entropy by default) with standard-normal noise on the arrays' device,
and, where it can, per-example gradients of a per-example loss. Capabilities it declares tell
the core and the conformance suite what it can do.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Mapping

from .aggregation import per_leaf_sq_norms
from .sampling import PoissonSampler

#: Capabilities a backend may declare.
PER_EXAMPLE_GRADS = "per_example_grads"  # per_example_grads() of a loss_fn
GHOST_NORMS = "ghost_norms"              # norms without materialising per-example gradients
JIT = "jit"                              # kernels run under a compiler (no host reads inside)
DISTRIBUTED = "distributed"


class UnsupportedCapabilityError(NotImplementedError):
    """The backend does not declare the capability an operation needs."""


class Backend(abc.ABC):
    """Base class of backends. Subclasses set ``name``, ``version`` and ``capabilities``."""

    name: str
    version: str
    capabilities: frozenset[str] = frozenset()

    @abc.abstractmethod
    def namespace(self) -> Any:
        """The Array API namespace of this backend's arrays."""

    @abc.abstractmethod
    def asarray(self, x, dtype: str | None = None):
        """A backend array from NumPy data; ``dtype`` is a name such as ``"float32"``."""

    @abc.abstractmethod
    def to_numpy(self, x):
        """A NumPy copy of a backend array."""

    @abc.abstractmethod
    def rng(self, seed: int | None = None):
        """A new random generator: seeded, or from OS entropy when ``seed`` is None."""

    @abc.abstractmethod
    def standard_normal(self, rng, shape: tuple[int, ...], like) -> tuple[Any, Any]:
        """``(rng, noise)``: N(0, 1) draws of ``shape`` with ``like``'s dtype and device, and the
        generator state to use next (stateful generators are returned as they are). ``noise``
        is a new array the caller owns: it may be updated in place."""

    def is_traced(self, x) -> bool:
        """Whether ``x`` is an abstract value of a compiler's trace (``jax.jit``,
        ``tf.function``) rather than data: host values computed from it would be baked into
        the traced program."""
        return False

    def settle(self) -> None:
        """Wait until the programs dispatched before have written their ledger events.
        :meth:`~dpcore.PrivateAggregator.begin_step` calls it before a new sample's event:
        a compiled release that records from a host callback may run it after the call
        returned, and would then record under the next sample. Nothing to wait for by
        default."""

    def poisson_sampler(self, n: int, q: float, *, seed=None) -> PoissonSampler:
        """The sampler this backend's data pipeline draws batches with: Poisson sampling of
        rate ``q`` over ``n`` records (``sample()`` gives sorted indices, possibly none).
        Backends whose loaders sample differently must still sample this way. ``seed`` is an
        int, a NumPy ``SeedSequence`` (what the aggregator passes) or None (OS entropy)."""
        return PoissonSampler(n, q, seed=seed)

    def per_example_grads(self, loss_fn: Callable, params: Mapping[str, Any], batch) -> dict:
        """Gradients of ``loss_fn(params, batch) -> (B,)``: leaf name -> (B, *leaf shape)."""
        raise UnsupportedCapabilityError(
            f"backend {self.name!r} does not compute per-example gradients "
            f"(it declares {sorted(self.capabilities)})")

    def per_example_sq_norms(self, loss_fn: Callable, params: Mapping[str, Any], batch):
        """Squared per-example gradient norms (B, L), leaves in ``params`` order. Backends with
        ghost norms override this to avoid materialising the gradients."""
        grads = self.per_example_grads(loss_fn, params, batch)
        return per_leaf_sq_norms(grads, list(params))

    def private_gradient(self, loss_fn: Callable, params: Mapping[str, Any], batch, aggregator,
                         *, mask=None) -> dict:
        """One step's private average gradient: per-example gradients of ``loss_fn``, clipped
        by ``aggregator.mechanism``, summed, noised and divided by q n, with the step's sum
        queries in ``aggregator.ledger``. The step's sampling event must already be recorded
        (``aggregator.sample()`` or ``begin_step()``). Backends with faster paths (ghost
        clipping, fused compiled steps) override this; the conformance suite checks it."""
        return aggregator.release(self.per_example_grads(loss_fn, params, batch), mask=mask)

    def __repr__(self) -> str:
        return f"<dpcore backend {self.name!r} {self.version}>"
