"""The plugin hook through which every backend, in-tree or third-party, is registered.

A plugin is a module named by an entry point of group ``dpcore``::

    [project.entry-points.dpcore]
    mybackend = "my_package.dpcore_plugin"

whose hook implementation calls ``register`` for each backend it offers.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import pluggy

hookspec = pluggy.HookspecMarker("dpcore")
hookimpl = pluggy.HookimplMarker("dpcore")


class Register(Protocol):
    def __call__(self, name: str, factory: Callable[[], object], *,
                 requires: Sequence[str] = ()) -> None: ...


@hookspec
def dpcore_register_backends(register: Register) -> None:
    """Register backends by calling ``register(name, factory, requires=(...))``.

    ``factory()`` builds the backend object (see :class:`dpcore.backend.Backend`); it is called
    only when the backend is first asked for, so the plugin module itself should import no
    framework. ``requires`` names the modules the backend needs (``("torch",)``); when one is
    not installed the backend is listed as unavailable with that reason instead of failing.
    """
