"""Backend registry on pluggy: entry points of group ``dpcore`` are loaded lazily, on the first
:func:`get_backend` or :func:`available_backends` call, never at ``import dpcore``.

``DPCORE_DISABLE_PLUGINS`` controls loading: unset or empty loads every entry point; ``1``,
``all`` or ``*`` loads none; otherwise it is a comma-separated list of entry-point names to
skip. Plugins can also be registered in code with :func:`register_plugin`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import pluggy
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from . import hookspecs

ENTRY_POINT_GROUP = "dpcore"
DISABLE_ENV = "DPCORE_DISABLE_PLUGINS"


class BackendError(LookupError):
    """A backend cannot be provided: unknown, unavailable, or registered twice."""


class UnknownBackendError(BackendError):
    pass


class BackendUnavailableError(BackendError):
    pass


class DuplicateBackendError(BackendError):
    pass


class PluginLoadWarning(UserWarning):
    """An entry-point plugin failed to import; its backends are missing."""


@dataclass
class _Entry:
    name: str
    factory: Callable[[], object]
    source: str
    missing: list[str] = field(default_factory=list)
    instance: object = None


class _Registry:
    def __init__(self):
        self.manager: pluggy.PluginManager | None = None
        self.entries: dict[str, _Entry] | None = None
        self.failures: dict[str, str] = {}

    def plugin_manager(self) -> pluggy.PluginManager:
        if self.manager is None:
            manager = pluggy.PluginManager(ENTRY_POINT_GROUP)
            manager.add_hookspecs(hookspecs)
            self._load_entry_points(manager)
            self.manager = manager
        return self.manager

    def _load_entry_points(self, manager: pluggy.PluginManager) -> None:
        setting = os.environ.get(DISABLE_ENV, "").strip()
        if setting.lower() in ("1", "all", "*", "true", "yes"):
            return
        skipped = {s.strip() for s in setting.split(",") if s.strip()}
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in skipped or manager.has_plugin(ep.name):
                continue
            try:
                manager.register(ep.load(), name=ep.name)
            except Exception as exc:  # a broken plugin must not take down the others
                self.failures[ep.name] = f"{type(exc).__name__}: {exc}"
                warnings.warn(f"dpcore plugin {ep.name!r} ({ep.value}) failed to load: "
                              f"{type(exc).__name__}: {exc}", PluginLoadWarning, stacklevel=4)

    def table(self) -> dict[str, _Entry]:
        if self.entries is None:
            entries: dict[str, _Entry] = {}

            def register(name: str, factory: Callable[[], object], *,
                         requires: Sequence[str] = ()) -> None:
                if not isinstance(name, str) or not name:
                    raise BackendError(f"backend name must be a non-empty string, got {name!r}")
                source = getattr(factory, "__module__", None) or repr(factory)
                if name in entries:
                    raise DuplicateBackendError(
                        f"backend {name!r} is registered twice, by {entries[name].source} and "
                        f"by {source}; uninstall one or disable it with {DISABLE_ENV}")
                missing = [m for m in requires if importlib.util.find_spec(m) is None]
                entries[name] = _Entry(name, factory, source, missing)

            self.plugin_manager().hook.dpcore_register_backends(register=register)
            self.entries = entries
        return self.entries


_registry = _Registry()


def register_plugin(plugin: object, name: str | None = None) -> None:
    """Register a plugin object (a module or instance with a ``dpcore_register_backends``
    hook implementation) in code, e.g. a backend under test."""
    _registry.plugin_manager().register(plugin, name=name)
    _registry.entries = None


def unregister_plugin(plugin: object) -> None:
    _registry.plugin_manager().unregister(plugin)
    _registry.entries = None


def available_backends() -> tuple[str, ...]:
    """Names of the registered backends whose frameworks are installed, sorted."""
    return tuple(sorted(n for n, e in _registry.table().items() if not e.missing))


def get_backend(name: str):
    """The backend registered as ``name`` (built once, then cached)."""
    table = _registry.table()
    entry = table.get(name)
    if entry is None:
        known = ", ".join(sorted(table)) or "none"
        hint = "".join(f"; plugin {p!r} failed to load ({why})"
                       for p, why in _registry.failures.items())
        raise UnknownBackendError(f"no backend named {name!r}; registered backends: {known}{hint}")
    if entry.missing:
        raise BackendUnavailableError(
            f"backend {name!r} needs {', '.join(entry.missing)}, which is not installed; "
            f"{_install_hint(name, entry)}")
    if entry.instance is None:
        try:
            entry.instance = entry.factory()
        except Exception as exc:
            raise BackendUnavailableError(
                f"backend {name!r} failed to start: {type(exc).__name__}: {exc}") from exc
    return entry.instance


def _distribution_of(module: str) -> str | None:
    """The installed distribution that ships the top-level package of ``module`` (the one
    whose plugin registered a backend), or None (a plugin registered in code)."""
    top = module.partition(".")[0]
    try:
        found = importlib.metadata.packages_distributions().get(top, [])
    except Exception:  # a broken installation's metadata: no hint rather than an error
        return None
    return found[0] if found else None


def _install_hint(name: str, entry: _Entry) -> str:
    """What to install for a backend whose modules ``entry.missing`` are not installed: the
    extra of dpcore for its own backends; for another distribution's, that distribution's
    requirement naming the module, or the module and the distribution that needs it (the
    package to install for a module need not bear its name)."""
    modules = ", ".join(entry.missing)
    dist = _distribution_of(entry.source)
    if dist is None:
        return f"install the package that provides {modules}"
    try:
        metadata = importlib.metadata.metadata(dist)
        requires = importlib.metadata.requires(dist) or []
    except importlib.metadata.PackageNotFoundError:
        return f"install the package that provides {modules}"
    if canonicalize_name(dist) == "dpcore":
        if name in (metadata.get_all("Provides-Extra") or ()):
            return f"install it with pip install 'dpcore[{name}]'"
        return f"install the package that provides {modules}"
    wanted = {canonicalize_name(m) for m in entry.missing}
    found = []
    for text in requires:
        try:
            requirement = Requirement(text)
        except InvalidRequirement:  # a malformed requirement of another's: not a hint
            continue
        if canonicalize_name(requirement.name) in wanted:
            requirement.marker = None  # the extra or platform it is under: not pip's argument
            found.append(str(requirement))
    if found:
        return (f"backend {name!r} comes from {dist}, which requires "
                f"{', '.join(found)}: pip install {' '.join(repr(r) for r in found)}")
    return (f"backend {name!r} comes from {dist}: install the package that provides "
            f"{modules} (see {dist}'s documentation)")


def lazy_exports(package: str, homes: Mapping[str, str]):
    """``(__getattr__, __dir__)`` for a backend package whose public names live in submodules
    (``homes``: name -> submodule) and are imported on first use, so that loading the package's
    entry-point module, which dpcore does to list backends, imports no framework::

        __getattr__, __dir__ = lazy_exports(__name__, {"MyBackend": "backend"})
    """
    def __getattr__(name: str):
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{homes[name]}", package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__():
        return sorted(homes)

    return __getattr__, __dir__
