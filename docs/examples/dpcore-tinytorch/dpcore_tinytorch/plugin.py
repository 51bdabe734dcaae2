"""The entry-point module: it registers the backend and imports no torch itself."""

from dpcore.hookspecs import hookimpl


def _make_backend():
    from dpcore_tinytorch.backend import TinyTorchBackend

    return TinyTorchBackend()


@hookimpl
def dpcore_register_backends(register):
    register("tinytorch", _make_backend, requires=("torch",))
