"""The noise of one release, drawn leaf by leaf, for backends that add their clipped sums into it.

A backend that forms clipped sums itself (book-keeping) need not allocate them: it asks the
aggregator for the step's noise (:meth:`dpcore.PrivateAggregator.noise_draws`), a mapping whose
``draws[j]`` is a writeable array ``alpha_j sigma~_g N(0, I)`` shaped like leaf j, adds
``sum_i c_i v_ij`` into it in place (``out.addmm_(g.T, c x)``), and hands the mapping back
(:meth:`~dpcore.PrivateAggregator.release_noisy_sums`), which divides by q n and releases.
Against "sums, then noise" this saves the sum arrays, their concatenation and the pass adding
them (measured in docs/benchmarks-history.md, seventh session).

Leaves are drawn on first access, in the backend's order, so memory follows the order in which
the backend forms sums (a large leaf's buffer appears when its sum would have). Leaves of fewer
than :data:`SHARED_DRAW` values share draws per (dtype, device, std), each of at most
:data:`SHARED_TOTAL` values and cut into disjoint pieces: one generator call instead of one per
leaf, large enough for a backend to draw it on several threads (PyTorch on the CPU). The first
access to a shared leaf draws its whole group, so memory runs ahead of the sums by at most
:data:`SHARED_TOTAL` values. Leaves never accessed are drawn at release: every leaf gets its
noise, used or not.

``noise=False`` gives zeros in place of the draws (the generator does not advance): the sums
of one process of several whose sums are added together, the noise being drawn once, by one
of them (distributed training).
"""

from __future__ import annotations

import math
from typing import Iterator, Mapping

from array_api_compat import device, is_writeable_array

from .aggregation import all_finite, leaf_noise_stds, pieces
from .queries import Mechanism

SHARED_DRAW = 2 ** 17  # leaves below this many values share draws ...
SHARED_TOTAL = 2 ** 19  # ... of at most this many values each


class NoiseDraws(Mapping):
    """``alpha_j sigma~_g N(0, I)`` for every leaf j of ``mechanism``, shaped, typed and placed
    like ``like[j]``, drawn from ``aggregator``'s generator on first access (the aggregator's
    ``rng`` advances with every draw); zeros with ``noise=False``. Made by
    :meth:`PrivateAggregator.noise_draws`."""

    def __init__(self, aggregator, step: int, mechanism: Mechanism, like: Mapping[str, object],
                 *, noise: bool = True):
        self.aggregator, self.step, self.mechanism = aggregator, step, mechanism
        self.noise = noise
        self.released = False
        self._like = like
        self._stds = leaf_noise_stds(mechanism)
        self._buffers: dict = {}
        self._bases: list = []  # the draws (each divided once at release)
        self._sizes: dict[str, int] = {}
        self._shared: dict[str, list] = {}  # small leaf -> the leaves sharing its draw
        kinds: dict[tuple, tuple] = {}  # (dtype, device, std) -> (group being filled, size)
        for leaf in mechanism.leaves:
            t = like[leaf]
            size = self._sizes[leaf] = math.prod(t.shape)
            if size < SHARED_DRAW:  # NumPy < 2 arrays have no .device (all on the CPU)
                kind = (t.dtype, getattr(t, "device", None), self._stds[leaf])
                group, total = kinds.get(kind, (None, 0))
                if group is None or total + size > SHARED_TOTAL:
                    group, total = [], 0
                group.append(leaf)
                kinds[kind] = group, total + size
                self._shared[leaf] = group

    def __getitem__(self, leaf: str):
        buffer = self._buffers.get(leaf)
        if buffer is None:
            if leaf not in self._stds:
                raise KeyError(leaf)
            self._draw(leaf)
            buffer = self._buffers[leaf]
        return buffer

    def __setitem__(self, leaf: str, value) -> None:
        """Only for ``draws[j] += s`` (in place, the same array): replacing a draw would drop
        its noise."""
        if value is not self._buffers.get(leaf):
            raise TypeError(f"add into draws[{leaf!r}] in place (draws[j] += s); assigning "
                            f"another array would drop its noise")

    def __iter__(self) -> Iterator[str]:
        return iter(self.mechanism.leaves)

    def __len__(self) -> int:
        return len(self.mechanism.leaves)

    def _draw(self, leaf: str) -> None:
        leaves = self._shared.get(leaf, [leaf])
        sizes = [self._sizes[j] for j in leaves]
        like, std = self._like[leaf], self._stds[leaf]
        xp = self.aggregator.backend.namespace()
        flat_shape = (sum(sizes),) if leaf in self._shared else tuple(like.shape)
        if std == 0 or not self.noise:  # no draw; the dtype the backend's generator gives
            dtype = like.dtype if xp.isdtype(like.dtype, "real floating") else None
            base = xp.zeros(flat_shape, dtype=dtype, device=device(like))
        else:
            agg = self.aggregator
            agg.rng, base = agg.standard_normal(agg.rng, flat_shape, like)
            if not is_writeable_array(base):
                raise TypeError(f"backend {agg.backend.name!r} draws read-only arrays; adding "
                                f"sums into the noise needs writeable ones: use release_sums")
            base *= std
        self._bases.append(base)
        if leaf not in self._shared:
            self._buffers[leaf] = base
            return
        for j, piece in zip(leaves, pieces(base, sizes)):
            shape = self._like[j].shape
            self._buffers[j] = piece if len(shape) == 1 else xp.reshape(piece, tuple(shape))

    def finite(self) -> bool:
        """Whether every draw (with the sums added into it) is finite."""
        xp = self.aggregator.backend.namespace()
        return all(all_finite(base, xp) for base in self._bases)

    def finish(self, divisor: float) -> dict:
        """Draw the leaves not yet drawn, divide every draw by ``divisor`` in place and return
        ``{leaf: array}``; the draws cannot be handed out again."""
        for leaf in self.mechanism.leaves:
            if leaf not in self._buffers:
                self._draw(leaf)
        for base in self._bases:
            base /= divisor
        self.released = True
        return {leaf: self._buffers[leaf] for leaf in self.mechanism.leaves}
