"""The PyTorch implementation of the dpcore backend contract (DESIGN.md section 4).

Noise comes from ``torch.Generator`` objects, one per device (and on the CPU one per piece of
a large draw, drawn in parallel), created on first use and seeded from one root seed (OS
entropy when the seed is None), so N(0, 1) draws are made directly on the device of the arrays
they are added to. Per-example gradients of a functional loss use
``torch.func``: for ``loss_fn(params, batch) -> (B,)`` and example i,

    grad_i = d loss_fn(params, batch_i)[0] / d params,

computed for all i at once by ``vmap(grad(.))`` over the leading axis of every batch tensor.
The module-level engine (:mod:`dpcore_torch.engine`) adds ghost norms and book-keeping on top.
"""

from __future__ import annotations

import functools
import math
import secrets
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Mapping

import array_api_compat.torch as xp
import numpy as np
import torch
from torch.utils._pytree import tree_flatten, tree_map

from dpcore.backend import GHOST_NORMS, PER_EXAMPLE_GRADS, Backend

from .layers import full_precision


# A CPU draw above this many values is cut into pieces of it, each from its own generator
# (stream), drawn on torch's intra-op threads at once: torch.randn is one thread on the CPU
# (1.7 million float32 normals: 12 ms on one thread, 6.4 ms on two).
STREAM_CHUNK = 1 << 18
_GOLDEN = 0x9E3779B97F4A7C15  # odd; spreads the streams' seeds over 64 bits


_MT_WORDS = 624  # the Mersenne Twister's state: 624 32-bit words


def _seed_mersenne_twister(gen: torch.Generator, seed: int) -> None:
    """Fill the CPU generator's Mersenne Twister state with 624 words from ``seed`` (numpy's
    ``SeedSequence``, all of its bits): ``manual_seed`` keeps only a seed's low 32 bits, and
    2^32 seeds are searched in hours, after which every release's noise could be subtracted.
    The words lie, one per uint64, at an offset of the state's bytes found from a seed whose
    words numpy's legacy ``RandomState`` (the same initialisation) computes."""
    state = gen.manual_seed(_LAYOUT_SEED).get_state().numpy().copy()
    start = _mt_words_offset()
    words = np.random.SeedSequence(seed).generate_state(_MT_WORDS, np.uint32)
    state[start:start + 8 * _MT_WORDS] = words.astype(np.uint64).view(np.uint8)
    gen.set_state(torch.from_numpy(state))


_LAYOUT_SEED = 5489


@functools.cache
def _mt_words_offset() -> int:
    """Where a CPU generator's state bytes hold its Mersenne Twister words."""
    state = torch.Generator().manual_seed(_LAYOUT_SEED).get_state().numpy()
    words = np.random.RandomState(_LAYOUT_SEED).get_state()[1].astype(np.uint64)
    start = state.tobytes().find(words.view(np.uint8).tobytes())
    if start < 0:
        raise RuntimeError(f"torch {torch.__version__}: the CPU generator's state does not "
                           f"hold its Mersenne Twister words as dpcore expects, so it cannot "
                           f"be seeded with more than 32 bits; please report this")
    return start


class DeviceGenerators:
    """``torch.Generator`` objects per device and stream, each seeded from ``seed``, the
    device's name and the stream number, so a seeded run draws the same noise on every rerun
    (whatever the number of threads) and no two devices or streams share a seed."""

    def __init__(self, seed: int | None = None):
        self.seed = secrets.randbits(63) if seed is None else int(seed)
        self._generators: dict[tuple[torch.device, int], torch.Generator] = {}
        self._pool: ThreadPoolExecutor | None = None

    def on(self, device: torch.device, stream: int = 0) -> torch.Generator:
        device = torch.device(device)
        gen = self._generators.get((device, stream))
        if gen is None:
            gen = torch.Generator(device=device)
            offset = 0 if device.type == "cpu" else zlib.crc32(str(device).encode()) + 1
            seed = (self.seed + offset + stream * _GOLDEN) % (2 ** 63)
            if device.type == "cpu":
                _seed_mersenne_twister(gen, seed)
            else:  # Philox: the whole 64-bit seed is its key
                gen.manual_seed(seed)
            self._generators[(device, stream)] = gen
        return gen

    def standard_normal(self, shape, dtype, device) -> torch.Tensor:
        """N(0, 1) of ``shape``: one draw of stream 0, or on the CPU above
        :data:`STREAM_CHUNK` values, piece k of the flat draw from stream k."""
        device = torch.device(device)
        size = math.prod(shape)
        if device.type != "cpu" or size <= STREAM_CHUNK:
            return torch.randn(tuple(shape), generator=self.on(device), dtype=dtype,
                               device=device)
        out = torch.empty(size, dtype=dtype)
        pieces = list(enumerate(out.split(STREAM_CHUNK)))

        def draw(piece):
            k, part = piece
            torch.randn(part.shape, generator=self.on(device, k), dtype=dtype, out=part)

        if torch.get_num_threads() == 1:
            list(map(draw, pieces))
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(torch.get_num_threads(),
                                                thread_name_prefix="dpcore-noise")
            list(self._pool.map(draw, pieces))
        return out.reshape(tuple(shape))


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
        return rng, rng.standard_normal(shape, dtype, like.device)

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

    def private_gradient(self, loss_fn, params, batch, aggregator, *, mask=None) -> dict:
        """The core's step on :meth:`per_example_grads` with every product at full precision
        (:func:`.layers.full_precision`): the clipped sums are a matrix product, which
        ``torch.set_float32_matmul_precision("high" | "medium")`` would let round."""
        with full_precision():
            return super().private_gradient(loss_fn, params, batch, aggregator, mask=mask)
