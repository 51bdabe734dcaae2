"""The buffers a fallback module's forward pass changes, kept as they were before each call
and as it left them: the per-example replay of the call (:mod:`dpcore_torch.fallback`) runs
from the first, in copies (the module's buffers stay as the forward pass left them), and must
leave the second (a buffer that depends on the batch, a running mean of the inputs, would
carry its records to later steps).

A forward pass may change buffers that depend on the weights only: ``spectral_norm``'s power
iteration updates its vectors u and v at every training call, a layer may count its calls.
Replayed from the buffers the call left, such a module computes another function than the
call did (the replay then sees outputs that differ and blames mixing of the examples), and a
replay that updated them again would move the model's state twice per step. A module's
first call keeps every buffer; later calls keep those that some call changed (in place, found
by its version counter, or replaced), so a module whose buffers never change costs nothing.
"""

from __future__ import annotations

import torch

from .snapshot import buffers, copies


class CallBuffers:
    """Per module: which of its buffers its calls change, and their values before a call."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.changing: set | None = None  # None until the first call has shown them

    def before(self):
        """Before a call: (versions of every buffer, copies of those a call may change)."""
        now = buffers(self.module)
        versions = {key: (t, t._version) for key, t in now.items() if t is not None}
        keep = now if self.changing is None else {k: now[k] for k in self.changing if k in now}
        return versions, copies({key: t for key, t in keep.items() if t is not None})

    def after(self, versions, kept) -> tuple[dict, set, dict]:
        """After the call: (the values before it of the buffers it changed, to replay it
        from; the keys of those with no copy from before, whose values are then the call's;
        copies of the values the call left them, which the replay of each example must
        leave too)."""
        now = buffers(self.module)
        changed = {key for key, t in now.items() if t is not None and (
            key not in versions or versions[key][0] is not t or versions[key][1] != t._version)}
        self.changing = changed if self.changing is None else self.changing | changed
        end = copies({key: now[key] for key in changed})
        return ({key: kept.get(key, end[key]) for key in changed}, changed - kept.keys(),
                end)

    def _names(self) -> dict:
        return {id(m): prefix for prefix, m in self.module.named_modules()}

    def names(self, keys) -> list[str]:
        """The buffers ``keys`` by their names in the module."""
        names = self._names()
        return sorted(f"{names[m]}.{name}" if names.get(m) else name for m, name in keys)

    def holders(self) -> dict:
        """{id(module): module} of the module and its descendants."""
        return {id(m): m for m in self.module.modules()}

    def by_name(self, values: dict) -> dict:
        """Copies of ``values`` (keys of :func:`buffers`) by their names in the module, for
        ``torch.func.functional_call`` (which a replay may then change in place)."""
        names = self._names()
        return {f"{names[m]}.{name}" if names.get(m) else name: t
                for (m, name), t in copies(values).items() if m in names}
