"""The functional private step: from one backward pass to the private average gradient.

Given the engine's per-example squared norms (B, L) and the aggregator's mechanism:

1. factors c_ig = min(1, S_g / ||grad_i restricted to group g||)   (core, dpcore.aggregation)
2. the aggregator draws the noise N(0, (alpha_j sigma~_g)^2) on the parameters' device, leaf
   by leaf as the engine asks for it, and the engine adds the clipped sums
   sum_i c_{i, g(j)} grad_ij into it in place, by book-keeping from the kept activations and
   backprops (no sum arrays: :mod:`dpcore.noise`)
3. the aggregator writes the step's sum queries to the ledger and divides by the public
   expected batch size q n.

The step's sampling event must be in the ledger first (``aggregator.sample()`` or
``aggregator.begin_step()``); :func:`private_grads` records it when ``begin_step=True``.
A Poisson sample too large for memory is split into micro-batches: :func:`clip_into` after
each one's backward pass adds its clipped sums into the same draws, released once.
"""

from __future__ import annotations

import torch

from dpcore import PrivateAggregator

from .engine import PerExampleEngine
from .layers import autocast_off


def private_grads(engine: PerExampleEngine, aggregator: PrivateAggregator, loss=None, *,
                  begin_step: bool = False) -> dict[str, torch.Tensor]:
    """The private average gradient {parameter name: tensor} of the current step.

    ``loss``, if given, is back-propagated first (``loss.backward()``); otherwise the caller
    has already run the backward pass. An empty batch (no layer saw an example, or B = 0) gives
    pure noise, as the privacy analysis requires. The engine is cleared afterwards.
    """
    if loss is not None:
        loss.backward()
    if begin_step:  # first: the step's mechanism (its clips may move) is fixed from here on
        aggregator.begin_step()
    noisy_sums = aggregator.noise_draws(engine.params)
    factors = clip_into(engine, aggregator, noisy_sums)
    return aggregator.release_noisy_sums(noisy_sums, factors=factors)


@torch.no_grad()
@autocast_off()  # a caller's autocast would round the norms and sums
def clip_into(engine: PerExampleEngine, aggregator: PrivateAggregator, noisy_sums):
    """Add the clipped sums of the examples of the backward pass just run into ``noisy_sums``
    (the step's :meth:`~dpcore.PrivateAggregator.noise_draws`) and return their clip factors
    (B, G); the engine is cleared. Called once per micro-batch, it accumulates one Poisson
    sample's sums over several backward passes; the release follows once."""
    mechanism = aggregator.mechanism
    mechanism.check_leaves(engine.params)
    try:
        sq_norms = engine.sq_norms(mechanism.leaves)
        factors = aggregator.clip_factors(sq_norms)
        if aggregator.on_nonfinite == "drop":  # dropped records: factor 0, and zeroed values
            finite = torch.isfinite(sq_norms).all(1)
            if not bool(finite.all()):
                engine.keep_records(finite)
        engine.add_clipped_sums(factors, mechanism.group_index, noisy_sums)
    finally:
        engine.clear()  # free the kept activations and backprops
    return factors
