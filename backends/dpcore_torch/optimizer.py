"""A wrapper that makes any torch optimizer private.

``step()`` replaces every trainable parameter's ``.grad`` by the private average gradient of the
step (:func:`dpcore_torch.step.clip_into`, then the release), records the step's sampling event
and sum queries in the ledger, then runs the wrapped optimizer's own ``step()``: the update is
post-processing of the private release, so momentum, Adam or weight decay cost no privacy.
``accumulate()`` clips a micro-batch of the step's Poisson sample into it without releasing.
"""

from __future__ import annotations

import torch

from dpcore import PrivateAggregator

from .engine import PerExampleEngine
from .step import clip_into


class PrivateOptimizer(torch.optim.Optimizer):
    """``optimizer`` with private gradients. It shares ``param_groups`` and ``state`` with the
    wrapped optimizer, so learning-rate schedulers and checkpoints work on either."""

    def __init__(self, optimizer: torch.optim.Optimizer, engine: PerExampleEngine,
                 aggregator: PrivateAggregator):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {optimizer!r}")
        ours = {id(p) for p in engine.params.values()}
        names = {id(p): n for n, p in engine.module.named_parameters()}
        stray = [names.get(id(p), f"<tensor of shape {tuple(p.shape)}>")
                 for group in optimizer.param_groups for p in group["params"]
                 if p.requires_grad and id(p) not in ours]
        if stray:
            raise ValueError(f"the optimizer updates tensors the private model does not own: "
                             f"{stray}; their gradients would be released without privacy")
        super().__init__([torch.zeros(0)], {})
        self.original_optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.defaults = optimizer.defaults
        self.engine, self.aggregator = engine, aggregator
        self._pending = None  # (noise draws, clip factors) of a step being accumulated

    @property
    def ledger(self):
        return self.aggregator.ledger

    @property
    def noise_multiplier(self) -> float:
        """z of Eq. (1) for the whole mechanism."""
        return self.aggregator.mechanism.noise_multiplier

    def next_step_fits(self) -> bool:
        """Whether the privacy budget (if any) affords one more step."""
        return self.aggregator.next_step_fits()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original_optimizer.zero_grad(set_to_none)
        self.engine.clear()

    def accumulate(self) -> None:
        """Clip the examples of the backward pass just run into the current step without
        releasing it: for a Poisson sample split into micro-batches that fit in memory, call
        this after each micro-batch's backward pass and :meth:`step` once at the end. The
        sample's sampling event is written at its first micro-batch; the noise is drawn once
        and the sums added into it. If a micro-batch raises (a NaN record), the step is
        abandoned: nothing is released."""
        with torch.no_grad():
            self._accumulate()

    def _accumulate(self) -> None:
        if self._pending is None:
            self.aggregator.begin_step()
            self._pending = (self.aggregator.noise_draws(self.engine.params), [])
        draws, factors = self._pending
        try:
            factors.append(clip_into(self.engine, self.aggregator, draws))
        except BaseException:
            self._pending = None
            raise

    @torch.no_grad()
    def step(self, closure=None):
        """One private step (one Poisson sample): clip, sum, noise, ledger, then update; the
        examples of the last backward pass join any :meth:`accumulate`-d micro-batches."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._accumulate()
        (draws, factors), self._pending = self._pending, None
        factors = factors[0] if len(factors) == 1 else torch.cat(factors)
        grads = self.aggregator.release_noisy_sums(draws, factors=factors)
        for name, p in self.engine.params.items():
            p.grad = grads[name]
        self.original_optimizer.step()
        return loss

    def state_dict(self):
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.original_optimizer.load_state_dict(state_dict)

    def epsilon(self, delta: float, **kwargs) -> float:
        """epsilon at ``delta`` of every step in the ledger so far."""
        from dpcore import accounting

        return accounting.epsilon(self.aggregator.ledger, delta, **kwargs)

    def __repr__(self) -> str:
        return f"PrivateOptimizer({self.original_optimizer!r}, {self.aggregator.mechanism})"
