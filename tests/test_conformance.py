"""The conformance suite is tested too: it passes every installed backend and fails each
deliberately broken one, for the right reason."""

import numpy as np
import pytest

import dpcore
from dpcore import aggregation, plugins
from dpcore.hookspecs import hookimpl
from dpcore.ledger import SumQueryEvent
from dpcore.sampling import PoissonSampler

tinytorch = pytest.importorskip(
    "dpcore_tinytorch.backend", reason="the example third-party backend (docs/examples/dpcore-tinytorch) "
    "is the base of the broken backends; pip install -e docs/examples/dpcore-tinytorch")
torch = pytest.importorskip("torch")


def run_suite(pytester, name):
    """Run the conformance suite against backend ``name``; the names of the failed checks."""
    recorder = pytester.inline_run("-p", "dpcore_conformance.plugin", "--pyargs",
                                   "dpcore_conformance", "--dpcore-backend", name,
                                   "-p", "no:cacheprovider")
    passed, skipped, failed = recorder.listoutcomes()
    assert passed or failed, "the suite ran no check"
    return {report.nodeid.rsplit("/", 1)[-1].split("[")[0] for report in failed}


@pytest.mark.parametrize("name", [n for n in ("numpy", "tinytorch", "torch", "jax", "tensorflow")
                                  if n in dpcore.available_backends()])
def test_suite_passes_every_installed_backend(pytester, name):
    assert run_suite(pytester, name) == set()


class NoiseTooSmall(tinytorch.TinyTorchBackend):
    def standard_normal(self, rng, shape, like):
        rng, noise = super().standard_normal(rng, shape, like)
        return rng, 0.9 * noise


class ClippingSkipped(tinytorch.TinyTorchBackend):
    def private_gradient(self, loss_fn, params, batch, aggregator, *, mask=None):
        grads = self.per_example_grads(loss_fn, params, batch)
        return aggregator.release_sums({leaf: g.sum(dim=0) for leaf, g in grads.items()})


class NoiseReused(tinytorch.TinyTorchBackend):
    def standard_normal(self, rng, shape, like):
        fixed = torch.Generator().manual_seed(0)  # a new generator at every draw
        return rng, torch.randn(shape, generator=fixed, dtype=like.dtype)


class LedgerDisagrees(tinytorch.TinyTorchBackend):
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


class BatchMeanGradients(tinytorch.TinyTorchBackend):
    def per_example_grads(self, loss_fn, params, batch):
        grads = super().per_example_grads(loss_fn, params, batch)
        return {k: g.mean(dim=0, keepdim=True).expand_as(g) for k, g in grads.items()}


class FixedSizeSampler(PoissonSampler):
    def sample(self):
        size = round(self.expected_size)
        return np.sort(self._rng.choice(self.n, size=size, replace=False))


class FixedSizeBatches(tinytorch.TinyTorchBackend):
    def poisson_sampler(self, n, q, *, seed=None):
        return FixedSizeSampler(n, q, seed=seed)


BROKEN = {
    "noise_too_small": (NoiseTooSmall, {
        "test_noise.py::test_noise_has_unit_standard_deviation_and_zero_mean",
        "test_noise.py::test_noise_is_normal",
        "test_step.py::test_step_noise_has_the_standard_deviation_the_ledger_records"}),
    "clipping_skipped": (ClippingSkipped, {
        "test_step.py::test_noise_free_step_is_the_exact_clipped_mean",
        "test_step.py::test_one_record_contributes_at_most_the_clip_bound"}),
    "noise_reused": (NoiseReused, {
        # repeated noise also spoils the variance estimate: 60 copies of 200 draws are not
        # 12,000 independent ones
        "test_step.py::test_step_noise_has_the_standard_deviation_the_ledger_records",
        "test_noise.py::test_fresh_noise_at_every_draw",
        "test_noise.py::test_seeds_reproduce_and_differ",
        "test_noise.py::test_unseeded_generators_differ",
        "test_step.py::test_fresh_noise_at_every_step_and_on_every_leaf",
        "test_step.py::test_seeded_steps_reproduce_and_differ"}),
    "ledger_disagrees": (LedgerDisagrees, {
        "test_step.py::test_step_noise_has_the_standard_deviation_the_ledger_records",
        "test_step.py::test_ledger_has_one_sampling_and_one_query_per_group_per_step"}),
    "batch_mean_gradients": (BatchMeanGradients, {
        "test_gradients.py::test_per_example_gradients",
        "test_gradients.py::test_per_example_squared_norms",
        "test_step.py::test_noise_free_step_is_the_exact_clipped_mean"}),
    "fixed_size_batches": (FixedSizeBatches, {
        "test_sampling.py::test_batch_sizes_follow_the_binomial_law"}),
}


class Plugin:
    def __init__(self, name, cls):
        self.name, self.cls = name, cls

    @hookimpl
    def dpcore_register_backends(self, register):
        register(self.name, self.cls)


@pytest.mark.parametrize("name", BROKEN)
def test_suite_fails_each_broken_backend_for_the_right_reason(pytester, name):
    cls, expected = BROKEN[name]
    plugin = Plugin(name, cls)
    plugins.register_plugin(plugin)
    try:
        failed = run_suite(pytester, name)
    finally:
        plugins.unregister_plugin(plugin)
    assert failed == expected
