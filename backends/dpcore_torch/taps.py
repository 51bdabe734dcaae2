"""Per-example gradients of a fallback module's own parameters used only by broadcasting
operations, from those operations' output backprops, without the replay.

A parameter p of a module without a rule (a ViT's class token and position embedding, a
LayerScale's gains, a learned bias) usually enters its module's forward pass as

    o = x + alpha p,   o = x - alpha p,   o = x * p   or   o = p.expand(B, ...),

with p broadcast over the batch axis of o (of size 1 there, or without it). Example i's part
of the loss then reaches p only through row i of o, so with g = dL/do

    grad_i = sum over p's broadcast axes of  alpha g_i   (add, sub: -alpha, expand: 1)
                                         or  g_i x_i     (mul),

summed over the parameter's uses. While a unit's call is recorded (the mode of
:mod:`dpcore_torch.draws`), every operation taking one of its parameters is sorted: one whose
result carries no gradient (a shape, a detached copy) is no use; one of the forms above keeps
its operand and the backprop of its result; any other use (a matmul, an index, a
concatenation of p itself, an in-place change, a use without gradient such as one inside an
autograd Function's forward) leaves the call to the replay. Row i of a backprop is example
i's only if the forward pass keeps each example in its row after the operation: the call's
rows are followed (:mod:`dpcore_torch.rows`), and a call that loses track of them (a
transpose of axis 0, a sort of the batch) goes to the replay too. So does a call whose
per-example gradients, summed over the batch, differ from the gradient the parameter
received (a use dpcore could not see): a missed use makes a step slower, never wrong.
"""

from __future__ import annotations

import math

import torch

from .independence import probing
from .layers import tracing

# (function, the operands' roles): the forms above, as the torch function mode sees them
_ADD = {torch.Tensor.add, torch.add, torch.Tensor.__add__, torch.Tensor.__radd__}
_SUB = {torch.Tensor.sub, torch.sub, torch.Tensor.__sub__}
_MUL = {torch.Tensor.mul, torch.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__}
_EXPAND = {torch.Tensor.expand, torch.Tensor.expand_as}
_NO_USE = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.detach,
           torch.Tensor.is_floating_point, torch.Tensor.__len__, torch.Tensor.stride,
           torch.Tensor.element_size, torch.Tensor.is_contiguous}


class Kept(torch.autograd.Function):
    """A copy of a tensor whose backprop goes to ``keep``: unlike a hook on a view, it is
    not lost when the view, or its base, is changed in place afterwards."""

    @staticmethod
    def forward(ctx, t, keep):
        ctx.keep = keep
        return t.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.keep(g)
        return g, None


def _no_use(func) -> bool:
    """Whether ``func`` reads no values of its argument (its shape, dtype, a detached
    alias)."""
    if type(func).__name__ == "method-wrapper":  # a property
        return getattr(func.__self__, "__name__", "") not in {"T", "H", "mT", "mH", "real",
                                                               "imag"}
    return func in _NO_USE


def _requires_grad(out) -> bool:
    if isinstance(out, torch.Tensor):
        return out.requires_grad
    if isinstance(out, (tuple, list)):
        return any(_requires_grad(o) for o in out)
    return False


class _Use:
    """One tapped use: coefficient, the other operand of a product (or None), and the
    backprop of its result."""

    __slots__ = ("coefficient", "factor", "g")

    def __init__(self, coefficient, factor):
        self.coefficient, self.factor, self.g = coefficient, factor, None

    def keep(self, g):
        if not probing():
            self.g = g if self.g is None else self.g + g


def _per_example(t, shape):
    """Rows of t (B, ...) summed down to ``shape`` over the axes where a tensor of that shape
    was broadcast (right-aligned, batch axis of size 1 or absent): (B, *shape)."""
    padded = (1,) * (t.dim() - len(shape)) + tuple(shape)
    axes = [d for d in range(1, t.dim()) if padded[d] == 1 and t.shape[d] != 1]
    if axes:
        t = t.sum(dim=axes, keepdim=True)
    return t.reshape(t.shape[0], *shape)


class Taps:
    """The uses of one fallback call's parameters, for a batch of ``batch`` examples whose
    rows ``rows`` (:class:`dpcore_torch.rows.Rows`) follows."""

    def __init__(self, batch: int, rows):
        self.batch, self.rows = batch, rows
        self.keys, self.shapes, self.uses, self.received = {}, {}, {}, {}
        self.device = None
        self.complete = True  # every use seen is tapped

    def hold(self, key, held: torch.Tensor) -> None:
        """Watch ``held``, the tensor the module holds for its parameter ``key`` in the
        call."""
        self.keys[id(held)], self.shapes[key], self.device = key, tuple(held.shape), held.device
        self.uses[key], self.received[key] = [], None

    def receive(self, key, g) -> None:
        """The gradient that reached the held parameter ``key`` (through every use)."""
        if probing():
            return
        self.received[key] = g if self.received[key] is None else self.received[key] + g

    def observe(self, func, args, kwargs, out):
        """Sort a call of ``func`` that ran in the unit's forward; returns ``out``, or the
        copy that keeps its backprop."""
        if not self.complete:
            return out
        positions = [i for i, a in enumerate(args) if id(a) in self.keys]
        nested = any(id(v) in self.keys for v in kwargs.values()) or any(
            isinstance(a, (list, tuple)) and any(id(t) in self.keys for t in a)
            for a in (*args, *kwargs.values()))
        if not (positions or nested) or _no_use(func):
            return out
        use = None if nested or len(positions) != 1 or not _requires_grad(out) else \
            self._form(func, args, kwargs, out, positions[0])
        if use is None:  # any other use, a use without gradient (inside an autograd
            self.complete = False  # Function's forward), or one in place
            return out
        key, use = use
        self.uses[key].append(use)
        if out._is_view():  # an expansion of the parameter: hooked through a copy
            out = Kept.apply(out, use.keep)
        else:
            out.register_hook(use.keep)
        self.rows.mark(out)  # its rows are credited to the examples: followed from here
        return out

    def _form(self, func, args, kwargs, out, position):
        """(key, _Use) if the call is one of the broadcasting forms, else None."""
        if not isinstance(out, torch.Tensor):
            return None
        key = self.keys[id(args[position])]
        shape = self.shapes[key]
        if (out.dim() == 0 or out.shape[0] != self.batch or len(shape) > out.dim()
                or (len(shape) == out.dim() and shape[0] != 1)):
            return None  # not broadcast over the batch axis
        if func in _EXPAND:
            return (key, _Use(1.0, None)) if position == 0 else None
        if len(args) != 2 or not isinstance(args[1 - position], torch.Tensor):
            return None
        alpha = kwargs.get("alpha", 1)
        if set(kwargs) - {"alpha"} or not isinstance(alpha, (int, float)):
            return None
        if func in _ADD:
            return key, _Use(alpha if position == 1 else 1.0, None)
        if func in _SUB:
            return key, _Use(-alpha if position == 1 else 1.0, None)
        if func in _MUL and not kwargs:
            return key, _Use(1.0, args[1 - position].detach())
        return None

    def grads(self, dtype):
        """{key: (B, *shape)} per-example gradients in ``dtype``, or None where the taps do
        not account for the gradient every parameter received, or the rows of the call
        were not followed to the end (:class:`dpcore_torch.rows.Rows`), and in a traced step
        (:func:`.layers.tracing`), where the check that they account for it cannot steer the
        program: the replay forms them there."""
        if not self.complete or self.rows.lost is not None or tracing():
            return None
        out = {}
        for key, uses in self.uses.items():
            shape = self.shapes[key]
            total = torch.zeros((self.batch, *shape), dtype=dtype, device=self.device)
            if self.batch == 0:
                out[key] = total
                continue
            magnitude, terms, eps = torch.zeros_like(total[0]), 0, torch.finfo(dtype).eps
            for use in uses:
                if use.g is not None:
                    t = use.g.to(dtype) * use.coefficient
                    if use.factor is not None:
                        t = t * use.factor.to(dtype)
                    total = total + _per_example(t, shape)
                    magnitude = magnitude + _per_example(t.abs(), shape).sum(0)
                    terms += t.numel() // max(1, total[0].numel())
                    eps = max(eps, torch.finfo(use.g.dtype).eps)
            bound = 8 * math.sqrt(terms + len(uses)) * eps * magnitude
            if not _agrees(total, self.received[key], bound):
                return None
            out[key] = total
        return out


def _agrees(total, received, bound) -> bool:
    """Whether the per-example gradients ``total`` (B, ...) are finite and sum to the
    gradient the parameter ``received`` within ``bound`` (elementwise: 8 sqrt(n) eps
    sum |terms| for sums of n terms, the rounding of sums in any order with room, not a
    worst case; a disagreement only sends the call to the replay)."""
    if not bool(torch.isfinite(total).all()):
        return False
    summed = total.sum(0)
    if received is None:
        return not bool(summed.any())
    return bool(((summed - received.to(summed.dtype)).abs() <= bound).all())
