"""What dpcore sets on a module instance, and copies of the module without it.

dpcore instruments a model in place: a layer with a rule gets an instance ``forward``, a
fallback module an instance ``_call_impl``, a BatchNorm a pre-hook refusing training mode, the
model a marker. ``copy.deepcopy``, ``pickle`` and ``torch.save`` copy a module's ``__dict__``,
so a copy would carry them bound to the *original*: a copy's layers would run the original's
weights, its fallback modules record into the original's engine, and closures would not
pickle. So every instrumented module has an instance ``__getstate__`` (which ``copy`` and
``pickle`` look up on the instance) that returns the state its class gives (nn.Module's drops
a compiled call, an RNN's its weak references, a user's class what it chooses) without
them: a copy, a pickle or a ``torch.save`` of the model is the plain model with the weights
of the moment (an EMA copy, a snapshot, a checkpoint), and can be made private on its own.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import partial

from torch import nn

_RECORD = "_dpcore_instrumentation"
_OURS = (_RECORD, "__getstate__", "__deepcopy__")


class Instrumentation:
    """What dpcore changed on one module: instance attributes it ``added`` (or replaced) and
    hooks it registered (their handles)."""

    def __init__(self):
        self.added: set[str] = set()
        self.hooks: list = []

    def _hook_ids(self, module: nn.Module) -> dict[str, set]:
        """{attribute of ``module`` holding a hook dictionary: ids of our hooks in it}."""
        ours: dict[int, set] = {}
        for handle in self.hooks:
            for ref in (handle.hooks_dict_ref, *handle.extra_dict_ref):
                hooks = ref()
                if hooks is not None:
                    ours.setdefault(id(hooks), set()).add(handle.id)
        return {k: ours[id(v)] for k, v in module.__dict__.items() if id(v) in ours}

    def _without_ours(self, state: dict, hook_ids: dict[str, set]) -> dict:
        state = {k: v for k, v in state.items() if k not in self.added and k not in _OURS}
        for key, ids in hook_ids.items():
            if key in state:
                state[key] = OrderedDict((i, h) for i, h in state[key].items() if i not in ids)
        return state

    def plain_state(self, module: nn.Module):
        """The state the module's class gives (its ``__dict__``, unless the class defines
        ``__getstate__``) as it would be without dpcore."""
        state = type(module).__getstate__(module)
        if not isinstance(state, dict):  # a class's own form of state: left as it is
            return state
        return self._without_ours(state, self._hook_ids(module))

    def deepcopy(self, module: nn.Module, memo: dict) -> nn.Module:
        """For a class with its own ``__deepcopy__``, which copies the ``__dict__`` itself (a
        parametrized layer's): that copy, with dpcore's entries taken out again."""
        twin = type(module).__deepcopy__(module, memo)
        plain = self._without_ours(dict(twin.__dict__), self._hook_ids(module))
        twin.__dict__.clear()
        twin.__dict__.update(plain)
        return twin


def instrumentation(module: nn.Module) -> Instrumentation:
    """The record of what dpcore changed on ``module`` (created on first use, with the
    instance ``__getstate__``, and ``__deepcopy__`` if the class has one, that leave it out
    of copies)."""
    record = module.__dict__.get(_RECORD)
    if record is None:
        record = module.__dict__[_RECORD] = Instrumentation()
        module.__dict__["__getstate__"] = partial(record.plain_state, module)
        if getattr(type(module), "__deepcopy__", None) is not None:
            module.__dict__["__deepcopy__"] = partial(record.deepcopy, module)
    return record


def set_by_dpcore(module: nn.Module, attr: str) -> bool:
    """Whether instance attribute ``attr`` of ``module`` was set by dpcore."""
    record = module.__dict__.get(_RECORD)
    return record is not None and attr in record.added


def forget(module: nn.Module) -> None:
    """Drop the record (once what it lists has been undone)."""
    for key in _OURS:
        module.__dict__.pop(key, None)
