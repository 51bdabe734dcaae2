"""BatchNorm trained privately: the batch's statistics are a private release of the step.

In training mode a BatchNorm normalises each example with the mean and variance of the batch,
so each example's output, and its "per-example" gradient, depends on every other record. With
``make_private(..., batch_norm=BatchNormStatistics(clip, noise_multiplier))`` each
BatchNorm layer instead releases its statistics as a Gaussian sum query of the step's Poisson
sample, at the step's first training forward pass:

* each record i gives, per channel c, the mean m_ic and the mean square s_ic of its values
  over the other axes (positions); the vector (m_i, s_i) is clipped to ``clip`` and the
  clipped vectors summed, N(0, (z_bn clip)^2) noise added and the sums divided by the public
  q n: E[x] and E[x^2] estimated privately, var = max(E[x^2] - E[x]^2, 0);
* the layer normalises with these released values, which are constants of the step (no
  gradient flows through them). Given them, example i's output depends on example i alone, so
  its gradient is its own and clipping bounds it: the step is an adaptive composition of the
  statistics' queries and the gradient's, on one sample, which the ledger records as sum
  queries of that step and the accountants price together (Eq. (1));
* the running statistics are moved towards the released values (post-processing), and eval
  mode uses them as usual.

Every later pass of the step (the independence check's reruns, a per-example replay) reuses
the step's release; a second training forward pass in one step is refused (a second batch
would be priced as the step's one sample). The noise multiplier of ``make_private`` is the
step's total: with k BatchNorm layers the gradient's is z_g = (1/z^2 - k/z_bn^2)^(-1/2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dpcore import Group, Mechanism, noise_multiplier_left
from dpcore import _validation as check

from .fallback import replaying
from .independence import rerunning
from .instrumentation import instrumentation
from .layers import Rule, _dtype, _record, cast_to


@dataclass(frozen=True)
class BatchNormStatistics:
    """How BatchNorm layers release their statistics: each record's per-channel (mean, mean
    square) clipped to ``clip`` (a bound on the layer's inputs' scale: for C channels of
    unit scale ||(m_i, s_i)|| is about sqrt(C), or sqrt(2 C) with unit means too), noise of
    std ``noise_multiplier * clip`` on the sums. The statistics are C-dimensional averages
    over the q n expected records, so a large multiplier costs the gradient little: each
    layer adds 1 / z_bn^2 to the step's 1 / z^2."""

    clip: float
    noise_multiplier: float

    def __post_init__(self):
        check.positive("BatchNorm statistics clip", self.clip)
        check.positive("BatchNorm statistics noise_multiplier", self.noise_multiplier)

    def gradient_noise_multiplier(self, total: float, layers: int) -> float:
        """z_g with 1/z_g^2 + layers/z_bn^2 = 1/total^2 (Eq. (1))."""
        return noise_multiplier_left(
            total, [self.noise_multiplier] * layers,
            f"the {layers} BatchNorm layer(s)' statistics at noise_multiplier="
            f"{self.noise_multiplier}",
            f"raise the statistics' noise_multiplier above {total * math.sqrt(layers):.4g}")


class PrivateStatistics:
    """The statistics of the model's BatchNorm layers, released once per step by
    ``release(per_record, mechanism)`` (the aggregator's) after ``begin()`` (the optimizer's:
    begins the step if it has not begun, and returns its number)."""

    def __init__(self, settings: BatchNormStatistics, module: nn.Module):
        self.settings = settings
        self.layers = {name: sub for name, sub in module.named_modules()
                       if isinstance(sub, nn.modules.batchnorm._BatchNorm)}
        for name, layer in self.layers.items():
            if type(layer) not in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d):
                raise TypeError(f"{type(layer).__name__} {name!r}: private statistics serve "
                                f"nn.BatchNorm1d/2d/3d")
            if not layer.track_running_stats:
                raise ValueError(f"BatchNorm {name!r} keeps no running statistics "
                                 f"(track_running_stats=False), so in eval mode it would "
                                 f"normalise with the batch's: construct it with "
                                 f"track_running_stats=True")
        self.begin: Callable[[], int] | None = None
        self.release: Callable | None = None
        self._step, self._released = None, {}

    @property
    def released(self) -> dict:
        """{layer name: (mean, var)} released for the step last begun (for logging)."""
        return dict(self._released)

    def mechanism(self, name: str) -> Mechanism:
        """One group per layer: the record's (mean, mean square) vector, clipped jointly."""
        clip, z = self.settings.clip, self.settings.noise_multiplier
        return Mechanism((Group(f"{name}.statistics", (f"{name}.mean", f"{name}.square"),
                                clip, z * clip),))

    def mechanisms(self) -> tuple[Mechanism, ...]:
        """Every layer's, in the model's order: what each step releases besides the
        gradient (the aggregator's ``extra``, which a budget prices)."""
        return tuple(self.mechanism(name) for name in self.layers)

    def instrument(self) -> None:
        """Give every BatchNorm layer the private forward and its statistics (instance
        attributes that copies of the model leave out; the engine's ``detach`` removes
        them). A layer with a rule unit runs the rule's forward, which reads the same
        statistics, while the engine records."""
        for name, layer in self.layers.items():
            # the release runs on the host, outside any graph a compiled model traces
            statistics = torch.compiler.disable(partial(self._statistics, name, layer))
            layer.forward = self._forward(layer, statistics)
            layer._dpcore_statistics = statistics
            instrumentation(layer).added.update(("forward", "_dpcore_statistics"))

    def remove(self) -> None:
        for layer in self.layers.values():
            layer.__dict__.pop("forward", None)
            layer.__dict__.pop("_dpcore_statistics", None)

    @staticmethod
    def _forward(layer, statistics):
        original = layer.forward

        def forward(x):
            if not layer.training:
                return original(x)
            mean, var = statistics(x)
            return F.batch_norm(x, mean, var, layer.weight, layer.bias, False, 0.0, layer.eps)

        return forward

    def _statistics(self, name: str, layer, x):
        """(mean, var) of the step: released at its first training pass, reused after."""
        if replaying() or rerunning():
            if name not in self._released:
                raise RuntimeError(f"BatchNorm {name!r} has released no statistics this step")
            mean, var = self._released[name]
        else:
            if not torch.is_grad_enabled():
                raise RuntimeError(
                    f"BatchNorm {name!r} ran in training mode without gradients: its batch "
                    f"statistics would be released for a batch no step trains on. Call "
                    f"model.eval() to evaluate (the running statistics are used)")
            if self.begin is None:
                raise RuntimeError("BatchNorm's private statistics are not bound to a private "
                                   "optimizer (make_private(..., batch_norm=...) binds them)")
            step = self.begin()
            if step != self._step:
                self._step, self._released = step, {}
            if name in self._released:
                raise RuntimeError(
                    f"BatchNorm {name!r} ran twice in training mode in one step (a second "
                    f"forward pass, a layer called twice, or activation checkpointing): its "
                    f"statistics are released once per step, from the step's one Poisson "
                    f"sample. Call optimizer.step() before the next batch's forward pass")
            layer._check_input_dim(x)
            with torch._C.DisableTorchFunction():  # a fallback's recording does not see
                mean, var = self._release(name, x)  # the release's noise and sums
            self._released[name] = (mean, var)
        with torch.no_grad():
            self._track(layer, mean, var)
        return mean, var

    @torch.no_grad()
    def _release(self, name: str, x):
        """The released mean and variance per channel, in the layer's parameters' dtype."""
        rows = _channels(x.detach())
        rows = rows.to(torch.promote_types(rows.dtype, torch.float32))
        squares = torch.linalg.vector_norm(rows, dim=2).square_().div_(rows.shape[2])
        released = self.release({f"{name}.mean": rows.mean(2), f"{name}.square": squares},
                                mechanism=self.mechanism(name))
        mean, square = released[f"{name}.mean"], released[f"{name}.square"]
        var = (square - mean.square()).clamp_(min=0)
        dtype = self.layers[name].running_mean.dtype
        return mean.to(dtype), var.to(dtype)

    @staticmethod
    def _track(layer, mean, var) -> None:
        """Move the running statistics towards the released ones (PyTorch's momentum; a
        cumulative average when it is None)."""
        layer.num_batches_tracked.add_(1)
        rate = (1.0 / float(layer.num_batches_tracked) if layer.momentum is None
                else layer.momentum)
        layer.running_mean.mul_(1 - rate).add_(mean, alpha=rate)
        layer.running_var.mul_(1 - rate).add_(var, alpha=rate)


def _channels(t):
    """(B, C, *) -> (B, C, L); (B, C) -> (B, C, 1)."""
    return t.flatten(2) if t.dim() > 2 else t[:, :, None]


@dataclass(frozen=True)
class _Constants:
    """A call's per-channel mean and 1 / sqrt(var + eps): not per-example rows (a Use's
    tuple aux is, and is zeroed row by row for dropped records)."""

    mean: torch.Tensor
    rstd: torch.Tensor


class _Normalised(torch.autograd.Function):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` per channel (axis 1), mean and var
    constants; the backward keeps the backprop g in the Use (x and (mean, rstd) are kept by
    the forward) and returns the input's gradient only."""

    @staticmethod
    def forward(ctx, use, x, weight, bias, mean, var, eps):
        rstd = torch.rsqrt(var + eps)
        use.aux = _Constants(mean, rstd)
        ctx.use, ctx.dtype = use, use.x.dtype
        ctx.scale = (rstd if weight is None else rstd * weight).view(
            (1, -1) + (1,) * (x.dim() - 2))
        return F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)

    @staticmethod
    def backward(ctx, g):
        ctx.use.arrive(cast_to(g, ctx.dtype))
        gx = g * ctx.scale if ctx.needs_input_grad[1] else None
        return None, gx, None, None, None, None, None


class BatchNormRule(Rule):
    """A BatchNorm layer normalising with constants: its step's released statistics in
    training mode (:class:`PrivateStatistics`), its running statistics in eval mode. Then
    y_i = xh_i * w + b per channel with xh_i = (x_i - mean) / sqrt(var + eps) of example i
    alone, and its per-example gradients are sum over positions of g_i xh_i (weight) and of
    g_i (bias)."""

    def forward(self, module, use_list, args, kwargs):
        (x,) = args
        if module.training:  # (the engine refuses a training BatchNorm without them)
            mean, var = module._dpcore_statistics(x)
        else:
            module._check_input_dim(x)
            mean, var = module.running_mean, module.running_var
        return _Normalised.apply(_record(use_list, x, _dtype(module)), x, module.weight,
                                 module.bias, mean, var, module.eps)

    def grad(self, module, use, name):
        g = _channels(use.g)
        if name == "bias":
            return g.sum(-1)
        centred = torch.sub(_channels(use.x), use.aux.mean[:, None])
        return centred.mul_(g).sum(-1).mul_(use.aux.rstd)


#: BatchNorm classes with the rule (eval mode, or training with private statistics).
BATCH_NORM_RULES = {cls: BatchNormRule()
                    for cls in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)}
