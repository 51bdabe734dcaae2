"""The backend declares what it implements: the core calls ``per_example_grads``,
``per_example_sq_norms`` and ``private_gradient`` whatever the capabilities say, while the
suite checks them only under ``per_example_grads``; a backend overriding one without declaring
it would pass with those checks skipped."""

from dpcore.backend import PER_EXAMPLE_GRADS, Backend

METHODS = ("per_example_grads", "per_example_sq_norms", "private_gradient")


def test_overridden_methods_are_declared(backend):
    overridden = [m for m in METHODS if getattr(type(backend), m) is not getattr(Backend, m)]
    assert not overridden or PER_EXAMPLE_GRADS in backend.capabilities, (
        f"backend {backend.name!r} overrides {overridden} but does not declare capability "
        f"{PER_EXAMPLE_GRADS!r}, so the suite skips the checks of those methods")
