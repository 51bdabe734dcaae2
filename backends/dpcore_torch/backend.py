"""The PyTorch implementation of the dpcore backend contract (DESIGN.md section 4).

Noise comes from ``torch.Generator`` objects, one per device, created on first use and seeded
from one root seed (OS entropy when the seed is None), so N(0, 1) draws are made directly on the
device of the arrays they are added to. Per-example gradients of a functional loss use
``torch.func``: for ``loss_fn(params, batch) -> (B,)`` and example i,

    grad_i = d loss_fn(params, batch_i)[0] / d params,

computed for all i at once by ``vmap(grad(.))`` over the leading axis of every batch tensor.
The module-level engine (:mod:`dpcore_torch.engine`) adds ghost norms and book-keeping on top.
"""

from __future__ import annotations

import secrets
import zlib
from typing import Callable, Mapping

import array_api_compat.torch as xp
import numpy as np
import torch
from torch.utils._pytree import tree_flatten, tree_map

from dpcore.backend import GHOST_NORMS, PER_EXAMPLE_GRADS, Backend


class DeviceGenerators:
    """One ``torch.Generator`` per device, each seeded from ``seed`` and the device's name, so
    a seeded run draws the same noise on every rerun and no two devices share a stream."""

    def __init__(self, seed: int | None = None):
        self.seed = secrets.randbits(63) if seed is None else int(seed)
        self._generators: dict[torch.device, torch.Generator] = {}

    def on(self, device: torch.device) -> torch.Generator:
        device = torch.device(device)
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            offset = 0 if device.type == "cpu" else zlib.crc32(str(device).encode()) + 1
            gen.manual_seed((self.seed + offset) % (2 ** 63))
            self._generators[device] = gen
        return gen


class TorchBackend(Backend):
    """dpcore backend for PyTorch tensors (any device)."""

    name = "torch"
    version = torch.__version__
    capabilities = frozenset({PER_EXAMPLE_GRADS, GHOST_NORMS})

    def namespace(self):
        return xp

    def asarray(self, x, dtype=None):
        return torch.as_tensor(np.asarray(x), dtype=None if dtype is None else getattr(torch, dtype))

    def to_numpy(self, x):
        return x.detach().cpu().numpy().copy()

    def rng(self, seed=None):
        return DeviceGenerators(seed)

    def standard_normal(self, rng, shape, like):
        dtype = like.dtype if like.is_floating_point() else torch.get_default_dtype()
        noise = torch.randn(tuple(shape), generator=rng.on(like.device), dtype=dtype,
                            device=like.device)
        return rng, noise

    def per_example_grads(self, loss_fn: Callable, params: Mapping[str, torch.Tensor], batch) -> dict:
        """``{name: (B, *shape)}``: gradient of each example's loss ``loss_fn(params, batch)[i]``.

        Every tensor in ``batch`` (any pytree) has the examples on axis 0. The loss of example i
        is evaluated on a batch of one (``batch_i`` with a leading axis of 1), so modules that
        expect a batch axis work unchanged.
        """
        params = dict(params)
        leaves, _ = tree_flatten(batch)
        sizes = {t.shape[0] for t in leaves if isinstance(t, torch.Tensor)}
        if len(sizes) != 1:
            raise ValueError(f"every tensor of the batch needs the same leading (example) size, "
                             f"got sizes {sorted(sizes)}")
        size = sizes.pop()
        if size == 0:
            return {k: torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
                    for k, p in params.items()}

        def one(p, example):
            example = tree_map(lambda t: t.unsqueeze(0) if isinstance(t, torch.Tensor) else t,
                               example)
            losses = loss_fn(p, example)
            if losses.shape != (1,):
                raise ValueError(f"loss_fn must return one loss per example, shape (B,); on a "
                                 f"batch of one it returned shape {tuple(losses.shape)}")
            return losses[0]

        in_dims = tree_map(lambda t: 0 if isinstance(t, torch.Tensor) else None, batch)
        grads = torch.func.vmap(torch.func.grad(one), in_dims=(None, in_dims))(params, batch)
        return dict(grads)
