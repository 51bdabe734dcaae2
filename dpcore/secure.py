"""Sampling and noise from the operating system's cryptographically secure generator.

The default generators (NumPy's PCG64 for sampling, the framework's for noise: PyTorch's
Mersenne Twister, JAX's Threefry, TensorFlow's Philox) are statistically sound but not
cryptographically secure: who learns their state can predict the noise, and with it take the
noise off a released gradient. ``PrivateAggregator(..., secure=True)`` draws both from
:func:`os.urandom` instead (``getrandom``: ChaCha20 on Linux), as Opacus's ``secure_mode``
draws from a CSPRNG:

* Poisson sampling: record i is in the sample iff u_i < q, for u_i uniform on the 2^53 points
  k 2^-53 (53 random bits each): P(u_i < q) = ceil(q 2^53) 2^-53, within 2^-53 of q;
* noise: N(0, 1) as Phi^-1(u) for u = (k + 1/2) 2^-53 (``scipy.special.ndtri``, in float64),
  rounded to the parameters' dtype and scaled by each leaf's standard deviation.

Such a generator cannot be seeded (a seed would make it predictable again). What it does not
address: a Gaussian sampled in floating point is not exactly Gaussian, and its rounding can
leak a little (Mironov 2012 for the Laplace mechanism; Jin et al. 2022 for Gaussian
samplers); an exact discrete Gaussian on a grid would. It costs about 8 bytes of the
system's generator and one ``ndtri`` per value (measured in docs/aggregation.md).
"""

from __future__ import annotations

import os

import numpy as np
from scipy.special import ndtri

from .sampling import PoissonSampler

_BITS = 53
_SCALE = 2.0 ** -_BITS


def _uniform(size: int) -> np.ndarray:
    """``size`` float64 values k 2^-53, k uniform in [0, 2^53), from the system's CSPRNG."""
    words = np.frombuffer(os.urandom(8 * size), dtype=np.uint64)
    return (words >> np.uint64(64 - _BITS)).astype(np.float64) * _SCALE


class SecureGenerator:
    """A handle on the system's CSPRNG: no state of its own, nothing to seed or copy."""

    def uniform(self, size: int) -> np.ndarray:
        """Uniform on the grid k 2^-53 of [0, 1)."""
        return _uniform(size)

    def standard_normal(self, size: int) -> np.ndarray:
        """``size`` float64 N(0, 1) values: Phi^-1 at the midpoints (k + 1/2) 2^-53, which
        are never 0 or 1."""
        return ndtri(_uniform(size) + _SCALE / 2)

    def __repr__(self) -> str:
        return "SecureGenerator(os.urandom)"


class SecurePoissonSampler(PoissonSampler):
    """:class:`~dpcore.sampling.PoissonSampler` drawing from the system's CSPRNG: record i is
    in the sample iff its uniform u_i < q (n uniforms a sample)."""

    def __init__(self, n: int, q: float, *, steps: int | None = None):
        super().__init__(n, q, steps=steps)
        self._rng = SecureGenerator()

    def sample(self) -> np.ndarray:
        return np.flatnonzero(self._rng.uniform(self.n) < self.q)


def secure_standard_normal(backend):
    """A ``standard_normal(rng, shape, like)`` for ``backend`` (the contract's signature) that
    draws from the system's CSPRNG (``rng`` a :class:`SecureGenerator`) and returns a new
    backend array with ``like``'s dtype and device."""
    from array_api_compat import device, to_device

    def standard_normal(rng, shape, like):
        xp = backend.namespace()
        size = int(np.prod(shape, dtype=np.int64))
        noise = rng.standard_normal(size).reshape(tuple(shape))
        dtype = like.dtype if xp.isdtype(like.dtype, "real floating") else xp.float32
        out = xp.astype(backend.asarray(noise), dtype)
        return rng, to_device(out, device(like))

    return standard_normal
