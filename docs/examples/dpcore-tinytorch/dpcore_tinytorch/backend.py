"""A minimal dpcore backend on torch.func: per-example gradients by vmap(grad), noise from a
torch.Generator. Everything else (clipping, sums, the ledger) comes from the dpcore core."""

from __future__ import annotations

import array_api_compat.torch as xp
import numpy as np
import torch
from torch.func import grad, vmap

from dpcore.backend import PER_EXAMPLE_GRADS, Backend


class TinyTorchBackend(Backend):
    name = "tinytorch"
    version = torch.__version__
    capabilities = frozenset({PER_EXAMPLE_GRADS})

    def namespace(self):
        return xp

    def asarray(self, x, dtype=None):
        return torch.as_tensor(np.asarray(x), dtype=None if dtype is None else getattr(torch, dtype))

    def to_numpy(self, x):
        return x.detach().cpu().numpy().copy()

    def rng(self, seed=None):
        generator = torch.Generator()
        if seed is None:
            generator.seed()  # OS entropy
        else:
            generator.manual_seed(seed)
        return generator

    def standard_normal(self, rng, shape, like):
        return rng, torch.randn(shape, generator=rng, dtype=like.dtype, device=like.device)

    def per_example_grads(self, loss_fn, params, batch):
        params = dict(params)
        size = batch[0].shape[0]
        if size == 0:  # vmap cannot map over an empty dimension
            return {k: torch.zeros((0, *p.shape), dtype=p.dtype) for k, p in params.items()}

        def example_loss(p, *example):
            return loss_fn(p, tuple(e.unsqueeze(0) for e in example))[0]

        per_example = vmap(grad(example_loss), in_dims=(None,) + (0,) * len(batch))
        return per_example(params, *batch)
