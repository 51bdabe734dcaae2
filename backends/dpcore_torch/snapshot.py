"""A forward pass's starting point, kept so that the pass can be run again: its inputs (copied,
so that changes the pass makes to them in place do not reach the copy), and the state it read
(random state, buffers, generators held by modules, training modes, autocast). The
independence check (:mod:`dpcore_torch.independence`) runs the pass again from it, with the
inputs of some examples replaced.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping

import torch

AUTOCAST_DEVICES = ("cpu", "cuda")  # the devices whose autocast dpcore keeps or turns off


def autocast_state() -> tuple:
    """((device, dtype, enabled), ...) of the autocast in force on AUTOCAST_DEVICES."""
    return tuple((d, torch.get_autocast_dtype(d), torch.is_autocast_enabled(d))
                 for d in AUTOCAST_DEVICES)


def _kept(t):
    """An input as passed, safe from changes the forward pass makes to it in place."""
    if not isinstance(t, torch.Tensor):
        return t
    return t.detach().clone().requires_grad_(t.requires_grad)


def _per_example_list(obj, b) -> bool:
    """Whether ``obj`` is a list of b rows (texts, sequences) rather than a container."""
    return (b is not None and isinstance(obj, list) and len(obj) == b
            and not any(isinstance(o, (list, tuple, Mapping)) or dataclasses.is_dataclass(o)
                        for o in obj))


def _rebuilt(obj, fn, b=None):
    """``obj`` with ``fn`` applied to each tensor (and each list of b rows), through tuples,
    lists, mappings and dataclasses; a mapping its class cannot rebuild is left as it is."""
    if isinstance(obj, torch.Tensor) or _per_example_list(obj, b):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _rebuilt(getattr(obj, f.name), fn, b)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(_rebuilt(o, fn, b) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_rebuilt(o, fn, b) for o in obj)
    if isinstance(obj, Mapping):
        try:
            return type(obj)({k: _rebuilt(v, fn, b) for k, v in obj.items()})
        except TypeError:
            return obj
    return obj


def _nearest(b: int, kept) -> torch.Tensor:
    """(b,) for each row, itself if kept, else the nearest kept row before it (the first
    kept row for the rows before it)."""
    chosen = set(kept)
    source, last = torch.arange(b), min(chosen)
    for i in range(b):
        if i in chosen:
            last = i
        source[i] = last
    return source


def _same(a, c) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(c, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(c, torch.Tensor)
                and a.shape == c.shape and bool(torch.equal(a, c)))
    return a is c or a == c


class Snapshot:
    """What a forward pass of ``module`` started from: its inputs (copies), the trainable
    parameters (copies, until the pass has shown which it changes in place) and the frozen
    ones' versions, random state, buffers, the modules' own generators, training modes and
    autocast."""

    def __init__(self, module, args, kwargs):
        self.inputs = _rebuilt((args, kwargs), _kept)
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.buffers = buffers(module, copy=True)
        self.generators = _generators(module)
        self.parameters = [(p, p._version, p.detach().clone() if p.requires_grad else None)
                           for p in module.parameters()]
        self.ended: list = []  # every parameter's version at the end of the pass
        self.training = [m.training for m in module.modules()]
        self.autocast = autocast_state()

    def keep_changed_parameters(self) -> None:
        """At the end of the pass: drop the copies of the parameters it did not change in
        place (most passes change none; one may clamp a weight, or initialise one from the
        batch, which a rerun must do again from where the pass began). A change through
        ``.data``, which no version counter sees, is found by comparing values."""
        self.ended = [(p, p._version) for p, _, _ in self.parameters]
        self.parameters = [(p, v, t) for p, v, t in self.parameters if p._version != v or (
            t is not None and not torch.equal(p.detach(), t))]

    def unrestorable(self) -> str | None:
        """Why the pass cannot be run again from where it began, if it cannot: a frozen
        parameter it changed (not copied), or parameters changed since it ended (an
        optimizer step before the engine's ``clear()``)."""
        if any(t is None for _, _, t in self.parameters):
            return "the pass changes a frozen parameter in place"
        if any(p._version != v for p, v in self.ended):
            return ("its parameters changed after the pass (an optimizer step before the "
                    "engine's clear(); clear it first, as make_private's optimizer does)")
        return None

    def replaced(self, b: int, kept, factor: float = 1.0):
        """((args, kwargs) with every row outside ``kept`` of every input of b rows (a tensor
        with b rows, a list of b texts or sequences) given the values of the nearest row of
        ``kept`` before it (after it, for rows before the first; so inputs sorted by length
        stay sorted), times ``factor`` in floating tensors; or None if that changes nothing;
        whether there is such an input). A square (b, b) floating or bool matrix is left as it
        is: with as many examples as positions it may be a mask the examples share."""
        changed = found = False
        source = _nearest(b, kept)
        moved = source != torch.arange(b)

        def replace(t):
            nonlocal changed, found
            found = found or isinstance(t, list) or (t.dim() > 0 and t.shape[0] == b)
            if isinstance(t, list):
                new = [t[j] for j in source.tolist()]
                changed = changed or not all(_same(a, c) for a, c in zip(new, t))
                return new
            if t.dim() == 0 or t.shape[0] != b or (
                    t.shape == (b, b) and (t.is_floating_point() or t.dtype == torch.bool)):
                return t
            with torch.no_grad():
                new = t.detach()[source.to(t.device)].clone()
                if factor != 1 and t.is_floating_point():
                    new[moved.to(t.device)] *= factor
            changed = changed or not torch.equal(new, t)
            return new.requires_grad_(t.requires_grad)

        args, kwargs = self.inputs  # args a tuple: never taken for a list of rows itself
        inputs = _rebuilt(args, replace, b), _rebuilt(kwargs, replace, b)
        return (inputs if changed else None), found

    def copied(self):
        """(args, kwargs) as the pass was given them: fresh copies, which a pass may change."""
        return _rebuilt(self.inputs, _kept)

    @contextlib.contextmanager
    def restored(self, module, start: dict | None = None):
        """The pass's random state, generators, training modes and autocast, the values of
        the parameters it changed, and copies of its buffers (or of ``start``'s, from
        :func:`buffers`) in place of the buffers, all put back on exit."""
        after, after_generators = buffers(module), _generators(module)
        modes = [m.training for m in module.modules()]
        devices = list(range(len(self.cuda))) if self.cuda is not None else []
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=devices))
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state_all(self.cuda)
            for device, dtype, enabled in self.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            stack.enter_context(torch.enable_grad())
            changed = [(p, began, p.detach().clone()) for p, _, began in self.parameters]
            try:
                with torch.no_grad():
                    for p, began, _ in changed:
                        p.copy_(began)
                _set_buffers(module, copies(self.buffers if start is None else start))
                for generator, state in self.generators:
                    generator.set_state(state)
                for m, training in zip(module.modules(), self.training):
                    m.training = training
                yield
            finally:
                with torch.no_grad():
                    for p, _, end in changed:
                        p.copy_(end)
                _set_buffers(module, after)
                for generator, state in after_generators:
                    generator.set_state(state)
                for m, training in zip(module.modules(), modes):
                    m.training = training


def buffers(module, copy: bool = False) -> dict:
    """{(module, name): buffer} of every module (copies if ``copy``)."""
    found = {(id(m), name): t for m in module.modules() for name, t in m._buffers.items()}
    return copies(found) if copy else found


def copies(values: dict) -> dict:
    """``values`` with each tensor copied, once: a buffer registered in two modules stays one
    tensor."""
    made: dict = {}
    for t in values.values():
        if t is not None and id(t) not in made:
            made[id(t)] = t.detach().clone()
    return {key: None if t is None else made[id(t)] for key, t in values.items()}


def _set_buffers(module, values: dict) -> None:
    """Set every buffer to its value in ``values`` (one not there is dropped: it was
    registered since)."""
    for m in module.modules():
        for name in list(m._buffers):
            if (id(m), name) in values:
                m._buffers[name] = values[(id(m), name)]
            else:
                del m._buffers[name]


def _generators(module) -> list:
    """(generator, state) of the ``torch.Generator``s the modules hold as attributes."""
    return [(g, g.get_state()) for m in module.modules() for g in vars(m).values()
            if isinstance(g, torch.Generator)]
