"""Sampling and noise from the operating system's cryptographically secure generator.

The default generators (NumPy's PCG64 for sampling, the framework's for noise: PyTorch's
Mersenne Twister, JAX's Threefry, TensorFlow's Philox) are statistically sound but not
cryptographically secure: who learns their state can predict the noise, and with it take the
noise off a released gradient. ``PrivateAggregator(..., secure=True)`` draws both from
:func:`os.urandom` instead (``getrandom``: ChaCha20 on Linux), as Opacus's ``secure_mode``
draws from a CSPRNG; with the ``secure`` extra (`cryptography`), a draw of 4,096 words or
more is the AES-256-CTR keystream under a key and counter block taken from ``os.urandom`` for
that draw alone (a standard construction, as Opacus's AES-128-CTR generator; computationally
indistinguishable from ``os.urandom``'s words):

* Poisson sampling: the gaps between the records drawn are geometric, G = floor(ln V /
  ln(1 - q)) with V uniform on the 2^53 points k 2^-53 of (0, 1], so that P(G >= g) =
  (1 - q)^g to within 2^-53 and a sample costs O(q n) draws (for q >= 1/4, record i is drawn
  iff its own uniform u_i < q);
* noise: N(0, 1) as s Phi^-1(u) for a random sign s and u = (2k + 1) 2^-54, k uniform in
  [0, 2^52) (``scipy.special.ndtri``, float64: every such u is exact, so both halves of the
  distribution are alike and no value is infinite; |z| <= 8.3), rounded to the parameters'
  dtype and scaled by each leaf's standard deviation.

Such a generator cannot be seeded (a seed would make it predictable again). What it does not
address: a Gaussian sampled in floating point is not exactly Gaussian, and its rounding can
leak a little (Mironov 2012 for the Laplace mechanism; Jin et al. 2022 for Gaussian
samplers); an exact discrete Gaussian on a grid would. It costs 8 bytes of keystream and
one ``ndtri`` per value, on two threads for large draws (``benchmarks/secure_noise.py``). The
aggregator refuses to release values of a compiler's trace (``jax.jit``), secure or not: the
noise drawn at tracing would be baked into the program and reused at every call.
"""

from __future__ import annotations

import os
import threading

import numpy as np
from array_api_compat import device, to_device
from scipy.special import ndtri

from .sampling import PoissonSampler

try:  # the `secure` extra: AES in hardware, for large draws
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
except ImportError:
    Cipher = None

_SCALE = 2.0 ** -53
STREAM_WORDS = 1 << 12  # from this many words on, an AES-256-CTR keystream (with `cryptography`)
PARALLEL_NORMALS = 1 << 17  # from this many normals on, Phi^-1 on two threads (if two cores)


def _words(size: int) -> np.ndarray:
    """``size`` uniform 64-bit words: the system's CSPRNG's, or, from :data:`STREAM_WORDS` on
    with `cryptography` installed, the AES-256-CTR keystream under a key and initial counter
    block drawn from it for this call alone (4-6x faster than ``os.urandom`` here; nothing is
    kept between calls)."""
    if Cipher is None or size < STREAM_WORDS:
        return np.frombuffer(os.urandom(8 * size), dtype=np.uint64)
    stream = Cipher(algorithms.AES(os.urandom(32)), modes.CTR(os.urandom(16))).encryptor()
    out = np.empty(8 * size + 15, np.uint8)  # update_into's room for a block
    stream.update_into(np.zeros(8 * size, np.uint8), out)  # the keystream itself
    return out[:8 * size].view(np.uint64)


def _cores() -> int:
    """The CPUs this process may run on."""
    affinity = getattr(os, "sched_getaffinity", None)  # Linux
    return len(affinity(0)) if affinity else (os.cpu_count() or 1)


def _ndtri(u: np.ndarray) -> np.ndarray:
    """Phi^-1(u), halves on two threads for large arrays (the ufunc releases the GIL)."""
    if len(u) < PARALLEL_NORMALS or _cores() < 2:
        return ndtri(u)
    out, half, failed = np.empty_like(u), len(u) // 2, []

    def first_half():
        try:
            ndtri(u[:half], out=out[:half])
        except BaseException as error:  # re-raised below: never return unwritten memory
            failed.append(error)

    other = threading.Thread(target=first_half)
    other.start()
    ndtri(u[half:], out=out[half:])
    other.join()
    if failed:
        raise failed[0]
    return out


def _uniform(size: int) -> np.ndarray:
    """``size`` float64 values k 2^-53, k uniform in [0, 2^53)."""
    return (_words(size) >> np.uint64(11)).astype(np.float64) * _SCALE


class SecureGenerator:
    """A handle on the system's CSPRNG: no state of its own, nothing to seed or copy."""

    def uniform(self, size: int) -> np.ndarray:
        """Uniform on the grid k 2^-53 of [0, 1)."""
        return _uniform(size)

    def standard_normal(self, size: int) -> np.ndarray:
        """``size`` float64 N(0, 1) values: s Phi^-1((2k + 1) 2^-54), the sign s from a word's
        top bit and k from its next 52 (every midpoint of the lower half, exactly)."""
        words = _words(size)
        u = ((words >> np.uint64(11)) & np.uint64((1 << 52) - 1)).astype(np.float64)
        u *= 2.0  # in place: u = (2k + 1) 2^-54, exactly
        u += 1.0
        u *= _SCALE / 2
        z = _ndtri(u)  # < 0: the sign bit set
        z.view(np.uint64)[...] ^= words & np.uint64(1 << 63)  # cleared by a top bit: -z
        return z

    def __repr__(self) -> str:
        return "SecureGenerator(os.urandom)"


class SecurePoissonSampler(PoissonSampler):
    """:class:`~dpcore.sampling.PoissonSampler` drawing from the system's CSPRNG: geometric
    gaps between the records drawn (about q n uniforms a sample), or, for q >= 1/4, record i
    drawn iff its own uniform u_i < q."""

    def __init__(self, n: int, q: float, *, steps: int | None = None):
        super().__init__(n, q, steps=steps)
        self._rng = SecureGenerator()

    def sample(self) -> np.ndarray:
        n, q = self.n, self.q
        if q >= 0.25:
            return np.flatnonzero(self._rng.uniform(n) < q)
        log_miss, drawn, last = np.log1p(-q), [], -1
        while True:  # geometric gaps, in batches sized for the records left
            v = self._rng.uniform(int(1.1 * q * (n - last)) + 16) + _SCALE  # (0, 1]
            found = last + np.cumsum(np.floor(np.log(v) / log_miss) + 1)
            drawn.append(found[found < n].astype(np.int64))
            if found[-1] >= n:
                return np.concatenate(drawn)
            last = int(found[-1])


class SecureStandardNormal:
    """``standard_normal(rng, shape, like)`` of the backend contract for ``backend``, drawing
    from the system's CSPRNG (``rng`` a :class:`SecureGenerator`): a new backend array of
    ``like``'s floating dtype (float64 for other dtypes) on ``like``'s device."""

    def __init__(self, backend):
        self.backend = backend

    def __call__(self, rng, shape, like):
        size = int(np.prod(shape, dtype=np.int64))
        noise = rng.standard_normal(size).reshape(tuple(shape))
        name = getattr(like.dtype, "name", None) or str(like.dtype).rsplit(".", 1)[-1]
        out = self.backend.asarray(noise, name if "float" in name else None)  # torch.float16
        where = device(like)
        if device(out) != where:
            try:
                out = to_device(out, where)
            except AttributeError:  # TensorFlow's tensors: its operations copy them
                pass
        return rng, out
