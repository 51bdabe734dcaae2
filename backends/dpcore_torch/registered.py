"""Layer classes of other libraries registered as Linear layers, so that they take the Linear
rule (ghost norms, book-keeping sums) instead of the ``torch.func`` replay.

Hugging Face's GPT-2 family computes its projections with ``transformers.pytorch_utils.Conv1D``:
``x @ weight + bias`` with ``weight`` of shape (in, out), the transpose of ``nn.Linear``'s, on
the flattened positions. dpcore cannot know that from the class, so it would replay the layer
per example (materialising B x in x out gradients). After

    dpcore_torch.register_linear(Conv1D, transposed=True)

instances run ``F.linear(x, weight^T, bias)`` through the Linear rule, on the batch as it
comes (B, ..., in). Per-example gradients of ``weight`` are the Linear rule's, transposed;
norms are unchanged by the transpose. Each registered layer's first recorded call also runs
the class's own forward on the same input and raises if the two differ, so a class that does
more than a linear map (an activation, a scaling) is refused rather than changed.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .layers import RULES, LinearRule, add_contraction


class RegisteredLinearRule(LinearRule):
    """:class:`LinearRule` for a registered class, with its weight stored (in, out) when
    ``transposed``, checked against the class's forward at each layer's first call."""

    def __init__(self, cls: type, transposed: bool):
        self.cls, self.transposed = cls, transposed
        self._checked = weakref.WeakSet()

    def forward(self, module, use_list, args, kwargs):
        weight = module.weight.t() if self.transposed else module.weight
        out = self._linear(module, weight, use_list, args, kwargs)
        if module not in self._checked:
            self._check(module, args, kwargs, out)
            self._checked.add(module)
        return out

    def _linear(self, module, weight, use_list, args, kwargs):
        """The Linear rule's forward with ``weight`` (out, in)."""
        if kwargs or len(args) != 1:
            raise TypeError(f"{self.cls.__name__} was registered with register_linear, which "
                            f"takes one input tensor; it was called with {len(args)} "
                            f"positional and {sorted(kwargs)} keyword arguments")
        held = _Weight(module, weight)
        return super().forward(held, use_list, args, {})

    def _check(self, module, args, kwargs, out) -> None:
        with torch.no_grad():
            expected = self.cls.forward(module, *args, **kwargs)
        if isinstance(expected, torch.Tensor) and expected.shape == out.shape:
            # the same map in two orders of summation, in the output's precision (autocast)
            tol = max(1e-4, 16 * torch.finfo(out.dtype).eps) if out.is_floating_point() else 0
            scale = float(expected.abs().max()) if expected.numel() else 0.0
            same = torch.allclose(out.detach().double(), expected.double(), rtol=tol,
                                  atol=tol * scale + 1e-30)
        else:
            same = False
        if not same:
            raise ValueError(
                f"{self.cls.__name__}.forward does not compute "
                f"{'x @ weight + bias' if self.transposed else 'F.linear(x, weight, bias)'} "
                f"(register_linear(..., transposed={self.transposed})): dpcore would run "
                f"another function than the model's. Register only classes whose forward is "
                f"that linear map, or let dpcore replay the class (do not register it)")

    def grad(self, module, use, name):
        g = super().grad(module, use, name)
        return g.transpose(-1, -2) if name == "weight" and self.transposed else g

    def add_weighted_sum(self, module, use, name, c, out) -> None:
        if not (self.transposed and name == "weight"):
            return super().add_weighted_sum(module, use, name, c, out)
        if name in use.cache:
            return add_contraction(out, c, use.cache[name])
        super().add_weighted_sum(module, use, name, c, out.t())  # an (out, in) view


class _Weight:
    """A module as the Linear rule sees it: ``weight`` (out, in) and ``bias``."""

    def __init__(self, module, weight):
        self.weight, self.bias = weight, module.bias


def register_linear(cls: type, *, transposed: bool = False) -> None:
    """Run instances of ``cls`` (exactly that class) through the Linear rule: their forward
    must be ``F.linear(x, weight, bias)``, or with ``transposed`` ``x @ weight + bias`` with
    ``weight`` of shape (in, out) (GPT-2's ``Conv1D``); ``bias`` may be None. Checked at each
    layer's first recorded call."""
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise TypeError(f"register_linear takes an nn.Module subclass, got {cls!r}")
    if cls in RULES and not isinstance(RULES[cls], RegisteredLinearRule):
        raise ValueError(f"{cls.__name__} has a rule of dpcore's own already")
    RULES[cls] = RegisteredLinearRule(cls, transposed)
