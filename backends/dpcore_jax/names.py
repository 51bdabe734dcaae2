"""Stable string names for the leaves of a pytree.

Groups of a :class:`dpcore.Mechanism` name the leaves they clip, so every array of a parameter
pytree needs a name that does not change between runs: its key path with the keys joined by
``/``. ``{"dense": {"w": W, "b": b}}`` has leaves ``dense/w`` and ``dense/b``; a list or tuple
contributes the index (``layers/0/w``); a dataclass or Flax struct its attribute name. A flat
mapping ``{"w": W}`` (the backend contract's ``params``) is its own naming.
"""

from __future__ import annotations

import jax

SEPARATOR = "/"


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def leaf_names(tree) -> list[str]:
    """Names of the leaves of ``tree``, in ``jax.tree_util`` flattening order."""
    paths, _ = jax.tree_util.tree_flatten_with_path(tree)
    names = [SEPARATOR.join(_key_name(k) for k in path) for path, _ in paths]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"pytree leaves {repeated} have the same name; keys containing "
                         f"{SEPARATOR!r} can collide: rename them")
    if any(not n for n in names):
        raise ValueError("a bare array has no leaf name: wrap it, e.g. {'w': array}")
    return names


def named_leaves(tree) -> dict[str, jax.Array]:
    """``{name: leaf}`` of ``tree``, in flattening order."""
    return dict(zip(leaf_names(tree), jax.tree_util.tree_leaves(tree)))


def unflatten_like(tree, named: dict):
    """A pytree shaped like ``tree`` with the leaves of ``named`` (by name)."""
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree),
                                        [named[name] for name in leaf_names(tree)])


def leaf_sizes(tree) -> dict[str, int]:
    """``{name: number of entries}``, e.g. for :func:`dpcore.grouped` allocations."""
    return {name: int(leaf.size) for name, leaf in named_leaves(tree).items()}
