"""Deliberately broken backends, each a small change to the example third-party backend, for
testing that the conformance suite catches them. Loaded with ``-p broken_backends``, it registers
every one of them under its name in ``BROKEN``."""

import numpy as np
import torch
from dpcore_tinytorch.backend import TinyTorchBackend

from dpcore import aggregation, plugins
from dpcore.hookspecs import hookimpl
from dpcore.ledger import SumQueryEvent
from dpcore.sampling import PoissonSampler


class NoiseTooSmall(TinyTorchBackend):
    def standard_normal(self, rng, shape, like):
        rng, noise = super().standard_normal(rng, shape, like)
        return rng, 0.9 * noise


class ClippingSkipped(TinyTorchBackend):
    def private_gradient(self, loss_fn, params, batch, aggregator, *, mask=None):
        grads = self.per_example_grads(loss_fn, params, batch)
        return aggregator.release_sums({leaf: g.sum(dim=0) for leaf, g in grads.items()})


class NoiseReused(TinyTorchBackend):
    def standard_normal(self, rng, shape, like):
        fixed = torch.Generator().manual_seed(0)  # a new generator at every draw
        return rng, torch.randn(shape, generator=fixed, dtype=like.dtype)


class LedgerDisagrees(TinyTorchBackend):
    def private_gradient(self, loss_fn, params, batch, aggregator, *, mask=None):
        grads = self.per_example_grads(loss_fn, params, batch)
        leaves = aggregator.mechanism.leaves
        factors = aggregator.clip_factors(aggregation.per_leaf_sq_norms(grads, leaves))
        sums = aggregation.clipped_sum(grads, factors, aggregator.mechanism, leaves)
        aggregator.ledger.record_sum_queries([SumQueryEvent(g.name, g.clip, 1.25 * g.noise_std)
                                              for g in aggregator.mechanism.groups])
        aggregator.rng, released = aggregation.noisy_average(
            sums, aggregator.mechanism, aggregator.rng, self.standard_normal,
            aggregator.expected_size)
        return released


class BatchMeanGradients(TinyTorchBackend):
    def per_example_grads(self, loss_fn, params, batch):
        grads = super().per_example_grads(loss_fn, params, batch)
        return {k: g.mean(dim=0, keepdim=True).expand_as(g) for k, g in grads.items()}


class FixedSizeSampler(PoissonSampler):
    def sample(self):
        size = round(self.expected_size)
        return np.sort(self._rng.choice(self.n, size=size, replace=False))


class FixedSizeBatches(TinyTorchBackend):
    def poisson_sampler(self, n, q, *, seed=None):
        return FixedSizeSampler(n, q, seed=seed)


BROKEN = {
    "noise_too_small": NoiseTooSmall,
    "clipping_skipped": ClippingSkipped,
    "noise_reused": NoiseReused,
    "ledger_disagrees": LedgerDisagrees,
    "batch_mean_gradients": BatchMeanGradients,
    "fixed_size_batches": FixedSizeBatches,
}


class _Plugin:
    @hookimpl
    def dpcore_register_backends(self, register):
        for name, cls in BROKEN.items():
            register(name, cls)


def pytest_configure(config):
    plugins.register_plugin(_Plugin())
