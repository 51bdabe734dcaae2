"""Deliberately broken backends, each a small change to the example third-party backend, for
testing that the conformance suite catches them. Loaded with ``-p broken_backends``, it registers
every one of them under its name in ``BROKEN``."""

import copy
import dataclasses
import inspect
import types
import weakref

import numpy as np
import torch
from dpcore_tinytorch.backend import TinyTorchBackend

from dpcore import aggregation, plugins
from dpcore.hookspecs import hookimpl
from dpcore.ledger import SumQueryEvent
from dpcore.sampling import PoissonSampler, poisson_sample


class NoiseTooSmall(TinyTorchBackend):
    def standard_normal(self, rng, shape, like):
        rng, noise = super().standard_normal(rng, shape, like)
        return rng, 0.9 * noise


def _real_rows(grads, mask):
    """Per-example gradients with the rows ``mask`` marks as padding zeroed (NaN ones too)."""
    if mask is None:
        return grads
    return {leaf: torch.where(mask.reshape(-1, *[1] * (g.ndim - 1)), g, 0)
            for leaf, g in grads.items()}


class ClippingSkipped(TinyTorchBackend):
    def private_gradient(self, loss_fn, params, batch, aggregator, *, mask=None):
        grads = _real_rows(self.per_example_grads(loss_fn, params, batch), mask)
        return aggregator.release_sums({leaf: g.sum(dim=0) for leaf, g in grads.items()})


class NoiseReused(TinyTorchBackend):
    def standard_normal(self, rng, shape, like):
        fixed = torch.Generator().manual_seed(0)  # a new generator at every draw
        return rng, torch.randn(shape, generator=fixed, dtype=like.dtype)


class LedgerDisagrees(TinyTorchBackend):
    def private_gradient(self, loss_fn, params, batch, aggregator, *, mask=None):
        grads = self.per_example_grads(loss_fn, params, batch)
        leaves = aggregator.mechanism.leaves
        factors = aggregator.clip_factors(aggregation.per_leaf_sq_norms(grads, leaves),
                                          mask=mask)
        sums = aggregation.clipped_sum(grads, factors, aggregator.mechanism, leaves,
                                       zero_rows=None if mask is None else ~mask)
        aggregator.ledger.record_sum_queries([SumQueryEvent(g.name, g.clip, 1.25 * g.noise_std)
                                              for g in aggregator.mechanism.groups])
        aggregator.rng, released = aggregation.noisy_average(
            sums, aggregator.mechanism, aggregator.rng, aggregator.standard_normal,
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


class UndeclaredCapabilities(ClippingSkipped):
    """Per-example gradients and a step the core calls, but no capability declared: the
    suite's checks of them would be skipped."""
    capabilities = frozenset()


class FusedStep(TinyTorchBackend):
    """A fused step: the core's clipped sums, then noise drawn here leaf by leaf (correct;
    the base of broken variants of its ``noise``). It releases the gradient only, so it
    refuses adaptive clipping (whose counts are released beside it) before recording
    anything, as the PyTorch compiled step does."""
    def private_gradient(self, loss_fn, params, batch, aggregator, *, mask=None):
        if aggregator.count_groups:
            raise ValueError("this fused step releases the gradient only, not adaptive "
                             "clipping's counts")
        grads = self.per_example_grads(loss_fn, params, batch)
        mech = self.clipping(aggregator)
        norms = aggregation.group_norms(aggregation.per_leaf_sq_norms(grads, mech.leaves),
                                        mech, mech.leaves)
        factors = aggregation.clip_factors(norms, aggregation.clips_of(mech), mask=mask,
                                           on_nonfinite=aggregator.on_nonfinite)
        sums = aggregation.clipped_sum(grads, factors, mech, mech.leaves,
                                       zero_rows=None if mask is None else ~mask)
        aggregator.record_release()
        noise = self.noise(aggregator, sums, batch[0].shape[0])
        stds = aggregation.leaf_noise_stds(self.noising(aggregator))
        return {leaf: (sums[leaf] + stds[leaf] * noise[leaf]) / aggregator.expected_size
                for leaf in mech.leaves}

    def clipping(self, aggregator):
        """The mechanism whose clips the step applies."""
        return aggregator.mechanism

    def noising(self, aggregator):
        """The mechanism whose noise the step adds."""
        return aggregator.mechanism

    def noise(self, aggregator, sums, records):
        """N(0, 1) draws shaped like each leaf's sum."""
        out = {}
        for leaf, total in sums.items():
            aggregator.rng, out[leaf] = aggregator.standard_normal(aggregator.rng,
                                                                   tuple(total.shape), total)
        return out


class NoiseTooSmallOnRecords(FusedStep):
    def noise(self, aggregator, sums, records):
        noise = super().noise(aggregator, sums, records)
        return {leaf: 0.9 * z for leaf, z in noise.items()} if records else noise


class SmallLeavesUnnoised(FusedStep):
    def noise(self, aggregator, sums, records):
        return {leaf: z if z.numel() > 1 else 0 * z
                for leaf, z in super().noise(aggregator, sums, records).items()}


class GroupsShareNoise(FusedStep):
    """Each group's noise from a generator seeded anew with the step's seed."""
    def noise(self, aggregator, sums, records):
        if aggregator.secure:
            return super().noise(aggregator, sums, records)
        seed = int(torch.randint(0, 2 ** 62, (1,), generator=aggregator.rng))
        out = {}
        for group in aggregator.mechanism.groups:
            generator = torch.Generator().manual_seed(seed)
            for leaf in group.leaves:
                out[leaf] = torch.randn(tuple(sums[leaf].shape), generator=generator,
                                        dtype=sums[leaf].dtype)
        return out


class LaplaceNoise(FusedStep):
    """Laplace noise of unit standard deviation in the step."""
    def noise(self, aggregator, sums, records):
        out = {}
        for leaf, z in super().noise(aggregator, sums, records).items():
            u = torch.special.ndtr(z.double()) - 0.5  # the Laplace quantile of z's probability
            out[leaf] = (-torch.sign(u) * torch.log1p(-2 * u.abs()) / 2 ** 0.5).to(z.dtype)
        return out


class OneValueLeavesShort(FusedStep):
    """One-value leaves (scalar biases) get 0.9x their noise."""
    def noise(self, aggregator, sums, records):
        return {leaf: z if z.numel() > 1 else 0.9 * z
                for leaf, z in super().noise(aggregator, sums, records).items()}


class TiledLeafNoise(FusedStep):
    """A leaf's noise is one draw of at most 8,192 values, tiled over the leaf (a key reused
    for each chunk of a large leaf)."""
    def noise(self, aggregator, sums, records):
        out = {}
        for leaf, total in sums.items():
            aggregator.rng, block = aggregator.standard_normal(
                aggregator.rng, (min(total.numel(), 8192),), total)
            out[leaf] = block.repeat(-(-total.numel() // 8192))[:total.numel()].reshape(
                total.shape)
        return out


class SecureIgnored(FusedStep):
    """A secure aggregator's noise from a generator of its own, seeded once (the CSPRNG's
    draws are never taken)."""
    fallback = None

    def noise(self, aggregator, sums, records):
        if not aggregator.secure:
            return super().noise(aggregator, sums, records)
        if self.fallback is None:
            self.fallback = torch.Generator().manual_seed(7)
        return {leaf: torch.randn(tuple(total.shape), generator=self.fallback,
                                  dtype=total.dtype) for leaf, total in sums.items()}


class NoiseRing(TinyTorchBackend):
    """Five draws per generator and shape, handed out in turn and never refilled."""
    def __init__(self):
        self._pools = weakref.WeakKeyDictionary()

    def standard_normal(self, rng, shape, like):
        pool = self._pools.setdefault(rng, {}).setdefault((tuple(shape), like.dtype), [])
        if len(pool) < 5:
            pool.append(super().standard_normal(rng, shape, like)[1])
        pool.append(pool.pop(0))
        return rng, pool[-1].clone()


class SharedNoiseBuffer(TinyTorchBackend):
    """Fresh values, written into the same array at every draw of a shape."""
    def __init__(self):
        self._buffers = {}

    def standard_normal(self, rng, shape, like):
        rng, noise = super().standard_normal(rng, shape, like)
        buffer = self._buffers.setdefault((tuple(shape), noise.dtype), torch.empty_like(noise))
        return rng, buffer.copy_(noise)


class TruncatedNoise(TinyTorchBackend):
    """N(0, 1) redrawn beyond 4 standard deviations (its std is 0.9989)."""
    def standard_normal(self, rng, shape, like):
        rng, noise = super().standard_normal(rng, shape, like)
        while (far := noise.abs() > 4).any():
            noise[far] = super().standard_normal(rng, (int(far.sum()),), like)[1]
        return rng, noise


class CyclingNoise(TinyTorchBackend):
    """Draws that repeat with period 65,536 (a chunked generator reusing its key)."""
    def standard_normal(self, rng, shape, like):
        size = int(np.prod(shape))
        rng, block = super().standard_normal(rng, (min(size, 1 << 16),), like)
        return rng, block.repeat(-(-size // (1 << 16)))[:size].reshape(shape)


class Float64NoiseTooSmall(TinyTorchBackend):
    def standard_normal(self, rng, shape, like):
        rng, noise = super().standard_normal(rng, shape, like)
        return rng, 0.9 * noise if noise.dtype == torch.float64 else noise


class MaskIgnored(TinyTorchBackend):
    def private_gradient(self, loss_fn, params, batch, aggregator, *, mask=None):
        return super().private_gradient(loss_fn, params, batch, aggregator)


class EpochSampler(PoissonSampler):
    """Binomial batch sizes cut from a shuffled permutation of the records (a new one when the
    rest is too short): every record at most once per epoch."""
    _order, _next = np.arange(0), 0

    def sample(self):
        size = int(self._rng.binomial(self.n, self.q))
        if self._next + size > self._order.size:
            self._order, self._next = self._rng.permutation(self.n), 0
        self._next += size
        return np.sort(self._order[self._next - size:self._next])


class RoundedRateSampler(PoissonSampler):
    """Poisson sampling at rate 1 / round(1 / q), exact at q = 0.1 only."""
    def sample(self):
        return poisson_sample(self.n, 1 / round(1 / self.q), self._rng)


class PercentRateSampler(PoissonSampler):
    """Poisson sampling at q rounded to a whole percentage (exact at 0.1, 0.3, 0.37)."""
    def sample(self):
        return poisson_sample(self.n, round(self.q, 2), self._rng)


class WindowSampler(PoissonSampler):
    """Binomial(n, q) records, but a contiguous (circular) run of them from a random start."""
    def sample(self):
        size, start = int(self._rng.binomial(self.n, self.q)), int(self._rng.integers(self.n))
        return np.sort((start + np.arange(size)) % self.n)


class IntSeededSampler(PoissonSampler):
    """Seeded only by an int: a SeedSequence (the aggregator's) or None gives seed 0."""
    def __init__(self, n, q, *, seed=None):
        super().__init__(n, q, seed=seed if isinstance(seed, int) else 0)


class MirroredNoise(TinyTorchBackend):
    """The second half of every draw is minus the first (antithetic variates)."""
    def standard_normal(self, rng, shape, like):
        size = int(np.prod(shape))
        rng, half = super().standard_normal(rng, ((size + 1) // 2,), like)
        return rng, torch.cat([half, -half])[:size].reshape(shape)


class RowRepeatedNoise(TinyTorchBackend):
    """Shaped draws repeat their first row."""
    def standard_normal(self, rng, shape, like):
        if len(shape) < 2:
            return super().standard_normal(rng, shape, like)
        rng, row = super().standard_normal(rng, tuple(shape[1:]), like)
        return rng, row.expand(shape).clone()


class Float32InFloat64Noise(TinyTorchBackend):
    """float64 noise drawn in float32 and converted."""
    def standard_normal(self, rng, shape, like):
        if like.dtype != torch.float64:
            return super().standard_normal(rng, shape, like)
        return rng, torch.randn(shape, generator=rng, dtype=torch.float32).double()


class GlobalGenerator(TinyTorchBackend):
    """Every generator is torch's global one, seeded when made."""
    def rng(self, seed=None):
        torch.seed() if seed is None else torch.manual_seed(seed)
        return None

    def standard_normal(self, rng, shape, like):
        return rng, torch.randn(shape, dtype=like.dtype)


class ChunkMeanGradients(TinyTorchBackend):
    """Rows in chunks of 16, each given its chunk's mean gradient (exact up to 16 rows)."""
    def per_example_grads(self, loss_fn, params, batch):
        grads = super().per_example_grads(loss_fn, params, batch)
        if batch[0].shape[0] <= 16:
            return grads
        return {k: torch.cat([c.mean(dim=0, keepdim=True).expand_as(c) for c in g.split(16)])
                for k, g in grads.items()}


def _pooled(pool: list, draw):
    """The next of a pool of 64 draws: ``draw()`` while the pool fills, then its draws in
    turn, as copies."""
    pool.append(draw() if len(pool) < 64 else pool.pop(0))
    return pool[-1].clone()


class NoisePool(TinyTorchBackend):
    """A pool of 64 draws per generator and shape, filled by the first 64 draws, then handed
    out in turn."""
    def __init__(self):
        self._pools = weakref.WeakKeyDictionary()

    def standard_normal(self, rng, shape, like):
        pool = self._pools.setdefault(rng, {}).setdefault((tuple(shape), like.dtype), [])
        return rng, _pooled(pool, lambda: super(NoisePool, self).standard_normal(
            rng, shape, like)[1])


class FusedNoisePool(FusedStep):
    """A fused step whose noise for each leaf comes from a pool of 64 of its draws for the
    leaf, handed out in turn (the generator itself is correct)."""
    def __init__(self):
        self._pools = weakref.WeakKeyDictionary()

    def noise(self, aggregator, sums, records):
        pools = self._pools.setdefault(aggregator, {})
        return {leaf: _pooled(pools.setdefault(leaf, []), lambda z=z: z)
                for leaf, z in super().noise(aggregator, sums, records).items()}


class MaskedNoiseHalf(FusedStep):
    """Padded (masked) steps get half the noise."""
    _masked = False

    def private_gradient(self, loss_fn, params, batch, aggregator, *, mask=None):
        self._masked = mask is not None
        return super().private_gradient(loss_fn, params, batch, aggregator, mask=mask)

    def noising(self, aggregator):
        mech = aggregator.mechanism
        if not self._masked:
            return mech
        return type(mech)(tuple(dataclasses.replace(g, noise_std=g.noise_std / 2)
                                for g in mech.groups), mech.record, mech.microbatch_size)


class MaskShifted(TinyTorchBackend):
    """The mask applied one row late (an off-by-one)."""
    def private_gradient(self, loss_fn, params, batch, aggregator, *, mask=None):
        return super().private_gradient(loss_fn, params, batch, aggregator,
                                        mask=None if mask is None else torch.roll(mask, 1))


class StaleClips(FusedStep):
    """Clips at the mechanism of an aggregator's first step (a program built for it, kept);
    the ledger and the noise follow the aggregator."""
    def __init__(self):
        self._first = weakref.WeakKeyDictionary()

    def clipping(self, aggregator):
        return self._first.setdefault(aggregator, aggregator.mechanism)


class StaleNoise(FusedStep):
    """Noise at the mechanism of an aggregator's first step; the clips and the ledger follow
    the aggregator."""
    def __init__(self):
        self._first = weakref.WeakKeyDictionary()

    def noising(self, aggregator):
        return self._first.setdefault(aggregator, aggregator.mechanism)


class AdaptiveCountsPadding(TinyTorchBackend):
    """Adaptive clipping's counts taken without the mask: padded rows count as clipped
    records."""
    def private_gradient(self, loss_fn, params, batch, aggregator, *, mask=None):
        grads = self.per_example_grads(loss_fn, params, batch)
        mech = aggregator.mechanism
        factors = aggregator.clip_factors(aggregation.per_leaf_sq_norms(grads, mech.leaves),
                                          mask=mask)
        sums = aggregation.clipped_sum(grads, factors, mech, mech.leaves,
                                       zero_rows=None if mask is None else ~mask)
        return aggregator.release_sums(sums, factors=factors)


class ChunkShiftGradients(TinyTorchBackend):
    """Per-example gradients in chunks of 512 rows, every chunk after the first starting
    one row early: rows 512 on get the gradient of the row before."""
    def per_example_grads(self, loss_fn, params, batch):
        size = batch[0].shape[0]
        if size <= 512:
            return super().per_example_grads(loss_fn, params, batch)
        parts = []
        for start in range(0, size, 512):
            rows = slice(start - 1 if start else 0, (start - 1 if start else 0)
                         + min(512, size - start))
            parts.append(super().per_example_grads(loss_fn, params,
                                                   tuple(b[rows] for b in batch)))
        return {k: torch.cat([part[k] for part in parts]) for k in parts[0]}


class IntegerBatchSampler(PoissonSampler):
    """Poisson sampling at rate round(q n) / n: a whole expected batch (exact whenever q n is
    a whole number)."""
    def sample(self):
        return poisson_sample(self.n, round(self.q * self.n) / self.n, self._rng)


def _as_traced(kept, loss_fn):
    """The loss an equal one first was, as a tracing backend keeps the program it traced by
    the loss's equality: a bound method with its object's attributes as they were then."""
    if not inspect.ismethod(loss_fn):
        return loss_fn
    return kept.setdefault(loss_fn, types.MethodType(loss_fn.__func__,
                                                     copy.copy(loss_fn.__self__)))


class LossKeptByEquality(TinyTorchBackend):
    def __init__(self):
        self._kept = {}

    def per_example_grads(self, loss_fn, params, batch):
        return super().per_example_grads(_as_traced(self._kept, loss_fn), params, batch)


class StepKeepsItsLoss(FusedStep):
    """Per-example gradients read the loss now; the fused step keeps the first equal one."""
    def __init__(self):
        self._kept = {}

    def private_gradient(self, loss_fn, params, batch, aggregator, *, mask=None):
        return super().private_gradient(_as_traced(self._kept, loss_fn), params, batch,
                                        aggregator, mask=mask)


def _sampling(sampler):
    class Sampling(TinyTorchBackend):
        def poisson_sampler(self, n, q, *, seed=None):
            return sampler(n, q, seed=seed)
    return Sampling

BROKEN = {
    "noise_too_small": NoiseTooSmall,
    "clipping_skipped": ClippingSkipped,
    "noise_reused": NoiseReused,
    "ledger_disagrees": LedgerDisagrees,
    "batch_mean_gradients": BatchMeanGradients,
    "fixed_size_batches": FixedSizeBatches,
    "undeclared_capabilities": UndeclaredCapabilities,
    "noise_too_small_on_records": NoiseTooSmallOnRecords,
    "small_leaves_unnoised": SmallLeavesUnnoised,
    "groups_share_noise": GroupsShareNoise,
    "laplace_noise": LaplaceNoise,
    "one_value_leaves_short": OneValueLeavesShort,
    "tiled_leaf_noise": TiledLeafNoise,
    "secure_ignored": SecureIgnored,
    "noise_ring": NoiseRing,
    "shared_noise_buffer": SharedNoiseBuffer,
    "truncated_noise": TruncatedNoise,
    "cycling_noise": CyclingNoise,
    "float64_noise_too_small": Float64NoiseTooSmall,
    "mask_ignored": MaskIgnored,
    "epoch_sampler": _sampling(EpochSampler),
    "rounded_rate_sampler": _sampling(RoundedRateSampler),
    "percent_rate_sampler": _sampling(PercentRateSampler),
    "window_sampler": _sampling(WindowSampler),
    "int_seeded_sampler": _sampling(IntSeededSampler),
    "mirrored_noise": MirroredNoise,
    "row_repeated_noise": RowRepeatedNoise,
    "float32_in_float64_noise": Float32InFloat64Noise,
    "global_generator": GlobalGenerator,
    "chunk_mean_gradients": ChunkMeanGradients,
    "loss_kept_by_equality": LossKeptByEquality,
    "step_keeps_its_loss": StepKeepsItsLoss,
    "noise_pool": NoisePool,
    "fused_noise_pool": FusedNoisePool,
    "masked_noise_half": MaskedNoiseHalf,
    "mask_shifted": MaskShifted,
    "stale_clips": StaleClips,
    "stale_noise": StaleNoise,
    "adaptive_counts_padding": AdaptiveCountsPadding,
    "chunk_shift_gradients": ChunkShiftGradients,
    "integer_batch_sampler": _sampling(IntegerBatchSampler),
}


class _Plugin:
    @hookimpl
    def dpcore_register_backends(self, register):
        for name, cls in BROKEN.items():
            register(name, cls)


def pytest_configure(config):
    plugins.register_plugin(_Plugin())
