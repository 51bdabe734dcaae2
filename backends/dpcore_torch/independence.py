"""A check, on the model's first training forward pass, that it keeps the examples of the
batch apart.

The engine forms example i's gradient from the input x_i and the backprop g_i that reach row
i of each instrumented layer. That is example i's own gradient only if neither depends on
another example: x_i on example i's data alone, and g_i = sum_j d l_j / d out_i on example
i's loss alone. A statistic of the batch (``h - h.mean(0)``, detached or not, a BatchNorm
written by hand, inputs normalised by the batch), a reordering of the batch, a hook or custom
autograd Function that moves gradient rows or scales them by a batch statistic, a
straight-through term ``h + (m - m.detach())``, or a layer applied to B rows that are not the
examples, breaks this: each example's "gradient" would carry other records' data, and
clipping would not bound any one record's influence.

The check looks at rows K = {0, B // 2} of the batch ({0} when B = 2: no shift or reversal
of the batch maps K onto itself), in two parts:

1. *Backward*, at the end of the pass: a random cotangent v in rows K of the model's outputs
   is sent back through the retained graph; the gradient J^T v reaching every layer's output
   must be zero outside rows K (up to 1e-6 of its largest entry).
2. *Rerun*, when the engine is next cleared (the private optimizer and
   :func:`dpcore_torch.step.private_grads` clear it once the step's sums are formed, before
   anything is released; the pass's graph and the step's kept tensors are freed by then,
   so the rerun's graph is the only one held): the pass runs again (same parameters,
   random state, buffers, training modes and autocast, inputs as passed) with every other
   example's input replaced by example 0's, and v is sent back again. In rows K, every
   layer's output, the model's outputs and J^T v must be unchanged (up to 1e-4 of their
   largest entry, 8 ulps for 16-bit floats).

Gradients are read by hooks on the layers' outputs, row K slices kept, so the check holds no
more than a backward pass does. The engine's book-keeping ignores its backward passes
(:func:`probing`) and drops the rerun's layer calls; the recording of a fallback call around
the first part does not see it (:mod:`dpcore_torch.draws`); its random numbers come from a
generator of its own, so the user's random streams are unchanged. Not seen: mixing inside the
loss (the model's outputs are probed; the loss is the user's), and mixing that only later
batches trigger.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch.utils._pytree import tree_flatten, tree_map

from .draws import unobserved

BACKWARD_TOLERANCE = 1e-6
RERUN_TOLERANCE = 1e-4
_AUTOCAST_DEVICES = ("cpu", "cuda")
_active = False


class NotPerExampleError(ValueError):
    """The model contains a layer whose output for one example depends on other examples."""


def probing() -> bool:
    """Whether the backward pass running is the check's (book-keeping must ignore it)."""
    return _active


@contextlib.contextmanager
def _probing():
    global _active
    previous, _active = _active, True
    try:
        yield
    finally:
        _active = previous


def _batch_tensors(out, b: int) -> list[torch.Tensor]:
    """The floating-point tensors of ``out`` with gradients and the b examples on axis 0."""
    return [t for t in tree_flatten(out)[0]
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
            and t.dim() > 0 and t.shape[0] == b]


def _batch_outputs(unit, out):
    """The outputs of a unit's call with the examples on axis 0 (a recurrent layer's hidden
    states have them on axis 1)."""
    rule = getattr(unit, "rule", None)
    return out if rule is None else rule.batch_outputs(unit.module, out)


def _has_reentrant_checkpoint(roots) -> bool:
    """Whether the graph holds a reentrant ``torch.utils.checkpoint`` (which refuses
    ``torch.autograd.grad``)."""
    seen, stack = set(), [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CheckpointFunctionBackward":
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


def _kept(t):
    """An input as passed, safe from changes the forward pass makes to it in place."""
    if not isinstance(t, torch.Tensor):
        return t
    return t.detach().clone().requires_grad_(t.requires_grad)


class _Before:
    """What the rerun starts from: the pass's inputs, parameters' versions, random state,
    buffers, training modes and autocast."""

    def __init__(self, module, args, kwargs):
        self.inputs = tree_map(_kept, (args, kwargs))
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.buffers = {id(t): t.detach().clone() for t in module.buffers()}
        self.versions = {id(p): p._version for p in module.parameters()}
        self.training = [m.training for m in module.modules()]
        self.autocast = [(d, torch.get_autocast_dtype(d), torch.is_autocast_enabled(d))
                         for d in _AUTOCAST_DEVICES]

    def parameters_changed(self, module) -> bool:
        """Whether a parameter changed in place since the pass began (the pass clamped it,
        say): the rerun could not start from the same parameters."""
        return any(p._version != self.versions.get(id(p)) for p in module.parameters())

    def others_as_first(self, b: int, rows: list[int]):
        """(args, kwargs) with every row outside ``rows`` of every input of b rows replaced
        by row ``rows[0]``; None if that changes nothing."""
        changed = False

        def replace(t):
            nonlocal changed
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != b:
                return t
            with torch.no_grad():
                new = t.detach().clone()
                new[:] = t[rows[0]]
                new[rows] = t[rows]
            changed = changed or not torch.equal(new, t)
            return new.requires_grad_(t.requires_grad)

        inputs = tree_map(replace, self.inputs)
        return inputs if changed else None

    @contextlib.contextmanager
    def restored(self, module):
        """The pass's random state, training modes and autocast, and copies of its buffers
        in place of the buffers, all put back on exit."""
        held = [(m, name, t) for m in module.modules() for name, t in m._buffers.items()
                if t is not None]
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
            try:
                for m, name, t in held:
                    m._buffers[name] = self.buffers[id(t)].clone()
                for m, training in zip(module.modules(), self.training):
                    m.training = training
                yield
            finally:
                for m, name, t in held:
                    m._buffers[name] = t
                for m, training in zip(module.modules(), modes):
                    m.training = training


class _Pass:
    """What a pass gave in rows K: its course (which units gave outputs of which shapes), the
    layers' and the model's outputs, and the gradients J^T v at the layers' outputs."""

    def __init__(self, roots, layers, grads, rows):
        self.course = _course(roots, layers)
        self.roots = [t.detach()[rows].clone() for t in roots]
        self.layers = [(unit, t.detach()[rows].clone()) for unit, t in layers]
        self.grads = grads


def _course(roots, layers):
    return [(id(unit), t.shape) for unit, t in layers], [t.shape for t in roots]


def _tolerance(t: torch.Tensor) -> float:
    return max(RERUN_TOLERANCE, 8 * torch.finfo(t.dtype).eps)


class Probe:
    """Waits on the engine's model for a forward pass with gradients and a batch of at least
    two examples, and checks that one (see the module docstring). ``units`` and ``leaves``
    (the trainable parameters) are the engine's; ``names`` maps a unit's module to its name
    in the model; ``recording()`` tells whether the engine records the calls made now (not in
    a replay, gradients on)."""

    def __init__(self, units, leaves, names: dict[int, str], recording):
        self.units, self.leaves, self.names, self.recording = units, leaves, names, recording
        # waiting -> capturing -> waiting, pending (a rerun to make) or done; rerun within
        self.state = "waiting"
        self._captured: list = []  # (unit, output) in call order
        self._hooks: list = []
        self._counts: dict[int, int] = {}
        self._before: _Before | None = None
        self._first: _Pass | None = None
        self._batch, self._rows = 0, []
        self._cotangents: list = []
        self._rerun_output = None
        self._rng = torch.Generator().manual_seed(0)

    # ------------------------------------------------------------------ capture
    def start(self, module, args, kwargs) -> None:
        """Root forward pre-hook: keep the pass's inputs and state, capture every unit call's
        outputs."""
        if self.state == "capturing":  # a pass that raised (or a nested call): start again
            self._remove()
            self.state = "waiting"
        if self.state != "waiting" or not self.recording():
            return
        with torch._C.DisableTorchFunction():  # unseen by a recording fallback call around it
            self._before = _Before(module, args, kwargs)
        self._capture_calls(module)
        self.state = "capturing"

    def _capture_calls(self, root) -> None:
        """Capture the outputs of every unit's calls but the model's own (its outputs)."""
        self._captured = []
        self._counts = {id(unit): len(unit.calls) for unit in self.units}
        for unit in self.units:
            if unit.module is not root:
                self._hooks.append(unit.module.register_forward_hook(self._capture(unit)))

    def _capture(self, unit):
        @torch.compiler.disable  # not traced into a compiled module's call
        def capture(module, args, out):
            self._captured.append((unit, out))
        return capture

    def _remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _outputs(self, module, output, b: int):
        """(the model's outputs, [(unit, a layer's output)]) with the b examples on axis 0."""
        captured, self._captured = self._captured, []
        root = next((unit for unit in self.units if unit.module is module), None)
        roots = _batch_tensors(output if root is None else _batch_outputs(root, output), b)
        return roots, [(unit, t) for unit, out in captured
                       for t in _batch_tensors(_batch_outputs(unit, out), b)]

    def finish(self, module, args, kwargs, output) -> None:
        """Root forward hook: check this pass if it can be, else wait for the next. In the
        rerun, keep its output as the hooks before this one left it, as in the pass."""
        if self.state == "rerun":
            self._rerun_output = output
        if self.state != "capturing":
            return
        self._remove()
        self.state = "waiting"
        # unseen by a recording fallback call around it (the model's own, say)
        with torch._C.DisableTorchFunction(), unobserved():
            sizes = {call.batch_size for unit in self.units
                     for call in unit.calls[self._counts[id(unit)]:]}
            if len(sizes) != 1 or next(iter(sizes)) < 2:
                self._captured = []
                return  # no layer call, batches of several sizes (the engine refuses), B < 2
            self.state = "done"
            self._check_backward(module, output, sizes.pop())

    # ------------------------------------------------------------------ part 1
    def _check_backward(self, module, output, b: int) -> None:
        roots, layers = self._outputs(module, output, b)
        if not roots:
            warnings.warn(
                f"dpcore could not check that {type(module).__name__} keeps the examples of a "
                f"batch apart: none of its outputs has the batch's {b} examples on axis 0 "
                f"(a model that returns only its loss, say). The check is skipped; make sure "
                f"nothing in the model mixes examples (statistics of the batch)", stacklevel=3)
            return
        if _has_reentrant_checkpoint(roots):
            return
        self._batch, rows = b, [0, b // 2] if b > 2 else [0]
        self._rows = rows
        self._cotangents = []
        for t in roots:
            v = torch.zeros_like(t)
            noise = torch.randn((len(rows), *t.shape[1:]), generator=self._rng, dtype=t.dtype)
            v[rows] = noise.to(t.device)
            self._cotangents.append(v)
        grads, outside = self._backprops(roots, layers, retain=True)
        mixed = None
        for (unit, _), g, out in zip(layers, grads, outside):  # the last: nearest the mixing
            inside = 0.0 if g is None else float(g.abs().max())
            if out > BACKWARD_TOLERANCE * inside:
                mixed = unit, out, inside
        if mixed is not None:
            unit, out, inside = mixed
            raise self._error(
                f"the gradient from the outputs of examples {rows} of {b} reached other "
                f"examples' rows of the output of {self._name(unit)} (largest {out:.3g}, "
                f"against {inside:.3g} in those examples' rows): something after that layer "
                f"moves gradient between examples")
        if self._before.others_as_first(b, rows) is not None:
            self._first, self.state = _Pass(roots, layers, grads, rows), "pending"
        else:
            self._before, self._cotangents = None, []

    def _backprops(self, roots, layers, *, retain: bool):
        """(J^T v in rows K, its largest entry outside rows K) at each layer output, read by
        hooks (None, 0 where the outputs do not depend on it)."""
        rows, grads, outside = self._rows, [None] * len(layers), [0.0] * len(layers)

        def reader(k):
            def read(g):
                g = g.detach()
                grads[k] = g[rows].clone()
                others = torch.ones(g.shape[0], dtype=torch.bool, device=g.device)
                others[rows] = False
                outside[k] = float(g[others].abs().max()) if g[0].numel() else 0.0
            return read

        leaves = [p for p in self.leaves if p.requires_grad]  # (some frozen since)
        if not leaves:
            return grads, outside
        handles = [t.register_hook(reader(k)) for k, (_, t) in enumerate(layers)]
        try:
            with _probing():  # through every unit to its parameters; nothing is returned
                torch.autograd.grad(roots, leaves, self._cotangents, retain_graph=retain,
                                    allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        return grads, outside

    # ------------------------------------------------------------------ part 2
    def rerun_if_pending(self, module) -> None:
        """Make the pending rerun (the engine's ``clear``). Nothing it records stays."""
        if self.state != "pending":
            return
        before, first, self._before, self._first = self._before, self._first, None, None
        self.state = "done"
        b, rows = self._batch, self._rows
        if before.parameters_changed(module):
            return
        args, kwargs = before.others_as_first(b, rows)
        self.state = "rerun"
        self._capture_calls(module)
        try:
            with before.restored(module):
                try:
                    module(*args, **kwargs)
                finally:
                    self._remove()
                output, self._rerun_output = self._rerun_output, None
                roots, layers = self._outputs(module, output, b)
                if first.course != _course(roots, layers):
                    raise self._error(
                        f"the forward pass took another course (other layer calls or shapes) "
                        f"when the examples other than {rows} of {b} were replaced by example "
                        f"{rows[0]}")
                self._compare(first.layers, [(u, t.detach()[rows]) for u, t in layers],
                              "the output of", " (the first layer output to change)")
                self._compare([(None, t) for t in first.roots],
                              [(None, t.detach()[rows]) for t in roots], "the model's output")
                grads, _ = self._backprops(roots, layers, retain=False)
                units = [unit for unit, _ in layers]
                self._compare(list(zip(units, first.grads)), list(zip(units, grads)),
                              "the gradient reaching the output of", " (the last to change)",
                              last=True)
        finally:
            self.state, self._cotangents = "done", []
            for unit in self.units:  # the rerun's calls: not part of any step
                new, unit.calls[self._counts[id(unit)]:] = unit.calls[self._counts[id(unit)]:], []
                for call in new:
                    call.release()

    def _compare(self, first, second, what: str, which: str = "", *,
                 last: bool = False) -> None:
        """Raise if a tensor of ``second`` (rows K) differs from ``first``'s (a NaN where the
        other has none is a difference), naming the first one that does (the ``last``)."""
        changed = None
        for (unit, a), (_, c) in zip(first, second):
            if a is None or c is None or not a.numel():
                continue
            equal = (a == c) | (a.isnan() & c.isnan())
            deviation = float(torch.where(equal, 0, (a - c).abs()).max())
            scale = float(torch.where(a.isfinite(), a.abs(), 0).max())
            if not deviation <= _tolerance(a) * scale:
                changed = unit, deviation, scale
                if not last:
                    break
        if changed is not None:
            unit, deviation, scale = changed
            where = what if unit is None else f"{what} {self._name(unit)}{which}"
            raise self._error(
                f"{where} changed in the rows of examples {self._rows} of {self._batch} by "
                f"{deviation:.3g} (against {scale:.3g}) when the other examples were replaced "
                f"by example {self._rows[0]}")

    def _name(self, unit) -> str:
        return f"{type(unit.module).__name__} {self.names.get(id(unit.module), '?')!r}"

    @staticmethod
    def _error(finding: str) -> NotPerExampleError:
        return NotPerExampleError(
            f"the model mixes the examples of a batch: {finding}. The cause may be a "
            f"statistic of the batch (h - h.mean(0), detached or not, inputs normalised by the "
            f"batch), a reordering, a hook or autograd Function that moves or rescales "
            f"gradient rows, or a layer applied to a tensor whose rows are not the examples. "
            f"Each example's gradient would depend on the others, and clipping would not bound "
            f"it. Remove the mixing; if the model's inputs or outputs have B rows that are not "
            f"the examples, pass check_independence=False")
