r"""Privacy loss distributions (PLD) for Poisson-subsampled Gaussian steps.

A pair of distributions (P, Q) is summarised by its *privacy profile* (hockey-stick
divergence) delta(eps) = E_P[(1 - e^{eps - L})_+], where L = log(P/Q) is the privacy loss.
Under add-or-remove-one neighbouring one step with sampling rate q and noise multiplier z is
dominated by one of two pairs, with mu_0 = N(0, z^2), mu_1 = N(1, z^2), mu_q = (1-q) mu_0 + q mu_1:

* *remove*: (mu_q, mu_0), delta_R(eps) = q * delta_G(log(1 + (e^eps - 1)/q)) for
  eps > log(1-q), and 1 - e^eps below;
* *add*: (mu_0, mu_q), delta_A(eps) = (1 - e^eps (1-q)) * delta_G(-log(1 + (e^{-eps} - 1)/q))
  for eps < -log(1-q), and 0 above;

where delta_G(eps) = Phi(-eps z + 1/(2z)) - e^eps Phi(-eps z - 1/(2z)) is the profile of the
Gaussian mechanism. A sequence of steps is dominated by composing the remove pairs and,
separately, the add pairs (the direction is the same for every step of one pair of
neighbouring datasets); the guarantee is the larger of the two profiles.

**Discretisation (pessimistic: the reported epsilon is an upper bound).** Each step's pair is
replaced by a discrete pair on the loss grid {i h} by *connecting the dots* (Doroshenko et
al. 2022): its profile, as a function of x = e^eps, is the piecewise linear interpolation of
the exact profile at the grid points, joined to (x=0, delta=1) on the left and constant
beyond the last point. Because the exact profile is convex in x, the interpolation lies above
it everywhere, so the discrete pair dominates the exact one; the mass on grid point i is x_i
times the jump in slope there, and the profile value at the last point is mass at +inf. The
grid covers the losses of all but ``tail_mass / (number of steps)`` of P's mass (rounded down
to a power of two, so that a step's grid stays the same while its ledger grows: a budget's
search reuses it, :func:`reusing_step_plds`); the tail mass above is exactly the +inf mass,
the mass below is moved up to the first point (more loss: pessimistic), and masses below
1e-200 are moved to +inf too (so no subnormal numbers slow the FFTs down).

**Composition.** The finite parts of the discrete PLDs are convolved by FFT on a window of N
grid points, each step group's transform raised to its count (fast self-composition of
identical steps), groups multiplied. The window is chosen by Chernoff bounds on the
composed distribution so that the mass outside it is below ``tail_mass`` on each side.
Cyclic aliasing can only add mass inside the window (never remove it), and the Chernoff
bounds on the mass above and below the window are *added to delta*, so no truncated tail
is lost. Infinite-loss masses compose as 1 - prod (1 - m_inf)^count. Steps with q = 1 are
Gaussian mechanisms and compose exactly: T steps with noise multipliers z_t are one Gaussian
mechanism with z = (sum_t z_t^-2)^(-1/2); a ledger of only such steps is priced in closed
form, without discretisation.

**Rounding.** Raising a transform to the power ``count`` multiplies its rounding error by
``count``: in float64, 1e5 steps left errors of 1e-12 to 1e-11 in the composed masses, enough
to put epsilon at delta <= 1e-9 below its true value. The composition is therefore computed
in long double (x86: unit roundoff 2^-64, 2048 times float64's), and its remaining rounding
is estimated a posteriori and *added to delta*: the composition is also computed in
float64, whose error is (up to long double's) the distance between the two, and rounding
error scales with the unit roundoff, so long double's L1 error is estimated as u_long / u_64
times that distance, added with a margin of ``_ROUNDING_MARGIN``. This estimate, not a
proof, is the one place where the result is not provably pessimistic. Negative noise is
clipped to zero.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass

import numpy as np
from scipy import fft, optimize, signal, special

from .. import _validation as check
from .rdp import DEFAULT_MAX_GROUPS, DEFAULT_NOISE_RESOLUTION, RDPAccountant
from .steps import Group, Source, check_step, group_steps

DEFAULT_VALUE_DISCRETIZATION = 1e-4
SMALL_GRID = 1 << 14  # fewer grid points than this at the default h: the grid is refined
FINE_GRID = 1 << 18  # towards this many
DEFAULT_TAIL_MASS = 1e-15
MAX_FFT_SIZE = 1 << 20
_SQRT2 = math.sqrt(2.0)
# Fourier coefficients of modulus below e^-92 (1e-40) are dropped: they change no bin by
# more than 1e-40 * 2 / N, far below float64 rounding, and they would otherwise run on as
# subnormal numbers, which are slow.
_LOG_UNDERFLOW = -92.0
# the largest privacy loss whose e^loss float64 holds with room (e^709.8 overflows)
_MAX_LOSS = 700.0
#: a noise multiplier whose losses 1 / (2 z^2) stay within _MAX_LOSS, just above the smallest
MIN_NOISE_MULTIPLIER = 1.000001 * (2 * _MAX_LOSS) ** -0.5
# masses below this are moved to +inf (pessimistic) rather than carried as subnormals
_TINY_MASS = 1e-200
_FFT_BATCH = 16  # groups transformed together (one batched, multithreaded FFT)
# the precision of the composition, and the margin on its estimated rounding error
_LONG = np.longdouble
_ROUNDING_MARGIN = 10.0


# --------------------------------------------------------------------------- profiles

def gaussian_delta(eps, z: float) -> np.ndarray:
    """Privacy profile of the Gaussian mechanism with sensitivity 1 and noise std ``z``:
    Phi(-eps z + 1/(2z)) - e^eps Phi(-eps z - 1/(2z)), without cancellation for large eps."""
    eps = np.asarray(eps, dtype=float)
    u = eps * z - 0.5 / z
    v = eps * z + 0.5 / z
    out = np.empty(np.broadcast(eps, u).shape)
    tail = u >= 0
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        # u >= 0: Phi(-u) - e^eps Phi(-v) = e^{-u^2/2} (erfcx(u/sqrt2) - erfcx(v/sqrt2)) / 2,
        # since e^eps e^{-v^2/2} = e^{-u^2/2}
        ut, vt = u[tail], v[tail]
        out[tail] = 0.5 * np.exp(-0.5 * ut * ut) * (special.erfcx(ut / _SQRT2)
                                                    - special.erfcx(vt / _SQRT2))
        bulk = ~tail
        out[bulk] = special.ndtr(-u[bulk]) - np.exp(eps[bulk] + special.log_ndtr(-v[bulk]))
    out = np.where(np.isneginf(eps), 1.0, out)
    return np.clip(out, 0.0, 1.0)


def subsampled_gaussian_delta(eps, q: float, z: float, direction: str) -> np.ndarray:
    """Privacy profile of one Poisson-subsampled Gaussian step, ``direction`` 'remove'
    (mu_q vs mu_0) or 'add' (mu_0 vs mu_q); see the module docstring."""
    eps = np.asarray(eps, dtype=float)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        if direction == "remove":
            floor = math.log1p(-q) if q < 1 else -math.inf
            inner = np.log1p(np.expm1(eps) / q)
            out = np.where(eps > floor, q * gaussian_delta(inner, z), -np.expm1(eps))
        elif direction == "add":
            ceiling = -math.log1p(-q) if q < 1 else math.inf
            inner = np.log1p(np.expm1(-eps) / q)
            factor = -np.expm1(eps + math.log1p(-q)) if q < 1 else 1.0
            out = np.where(eps < ceiling, factor * gaussian_delta(-inner, z), 0.0)
        else:
            raise ValueError(f"direction must be 'remove' or 'add', got {direction!r}")
    return np.clip(out, 0.0, 1.0)


def _loss(x, q: float, z: float) -> float:
    """Privacy loss log(mu_q(x) / mu_0(x)) = log(1 - q + q e^{(2x - 1)/(2 z^2)})."""
    a = (2 * x - 1) / (2 * z * z)
    return float(np.logaddexp(math.log1p(-q) if q < 1 else -math.inf, math.log(q) + a))


# --------------------------------------------------------------------------- discrete PLDs

@dataclass(frozen=True)
class DiscretePLD:
    """A dominating discrete PLD: P-mass ``masses[i]`` at loss ``(offset + i) * h`` and
    ``infinity_mass`` at loss +inf."""

    offset: int
    masses: np.ndarray
    infinity_mass: float
    h: float

    @property
    def losses(self) -> np.ndarray:
        return (self.offset + np.arange(self.masses.size)) * self.h


def connect_the_dots(profile, reverse_profile, lo: float, hi: float, h: float) -> DiscretePLD:
    """The discrete PLD on grid {i h : lo <= i h <= hi} (outward-rounded) whose profile in
    x = e^eps interpolates ``profile`` at the grid points, starts at (0, 1) and is constant
    after the last point. Dominates the exact PLD when ``profile`` is a privacy profile.

    The mass at an interior point is x_i times the jump in slope there, a second difference.
    For eps < 0 it is taken of g(eps) = delta(eps) - (1 - e^eps) = e^eps delta_rev(-eps)
    (``reverse_profile`` is the profile of the pair swapped) instead: the two differ by a
    linear function of x, which has no slope jumps, and g is small where delta is near 1,
    so the masses keep their precision there.
    """
    i0, i1 = math.floor(lo / h), max(math.ceil(hi / h), 1)  # the grid ends at a loss > 0
    if i1 - i0 + 1 > MAX_FFT_SIZE:  # (tiny z: huge losses) the caller coarsens h first
        raise _GridTooFine(i1 - i0 + 1)
    grid = np.arange(i0, i1 + 1) * h
    n = grid.size
    em1 = math.expm1(h)
    ratio = math.exp(h) / em1
    neg = int(np.searchsorted(grid, 0.0))  # grid[:neg] < 0 <= grid[neg:]
    masses = np.empty(n)
    # eps >= 0 (neg < n): second differences of delta itself
    first = max(neg - 1, 0)
    d = profile(grid[first:])
    dd = np.diff(d)
    right = np.append(dd / em1, 0.0)  # x_i times the slope right of point i
    left = np.empty_like(d)           # x_i times the slope left of point i
    left[0] = d[0] - 1.0              # the chord from (0, 1)
    left[1:] = dd * ratio
    masses[neg:] = (right - left)[neg - first:]
    last_delta = float(d[-1])
    if neg > 0:  # eps < 0: second differences of g
        m = min(neg + 1, n)
        g = np.exp(grid[:m]) * reverse_profile(-grid[:m])
        dg = np.diff(g)
        right = np.append(dg / em1, 0.0)
        left = np.empty(m)
        left[0] = g[0]
        left[1:] = dg * ratio
        masses[:neg] = (right - left)[:neg]
    masses = np.maximum(masses, 0.0)
    tiny = masses < _TINY_MASS
    last_delta += float(masses[tiny].sum())
    masses[tiny] = 0.0
    return DiscretePLD(i0, masses, min(last_delta, 1.0), h)


def _losses_fit(z: float) -> bool:
    """Whether a step of noise multiplier z has losses float64 profiles can represent: the
    loss of x = 1 is about 1 / (2 z^2) + log q, which must stay within ``_MAX_LOSS``."""
    return 2 * z * z * _MAX_LOSS >= 1


def subsampled_gaussian_pld(q: float, z: float, direction: str, h: float,
                            tail_mass: float) -> DiscretePLD:
    """Dominating discrete PLD of one step; the grid covers all but ``tail_mass`` of P."""
    if not _losses_fit(z):
        raise ValueError(
            f"noise multiplier z={z} is too small for the PLD accountant: its privacy losses "
            f"reach 1 / (2 z^2) = {0.5 / max(z * z, 1e-300):.4g}, beyond the {_MAX_LOSS:g} its "
            f"float64 profiles can represent (e^loss overflows); use accountant='rdp'")
    s = float(special.ndtri(1 - tail_mass)) if tail_mass > 1e-16 else \
        float(-special.ndtri(tail_mass))
    if direction == "remove":  # P = mu_q: losses increase with x
        lo = max(math.log1p(-q) if q < 1 else -math.inf, _loss(-s * z, q, z))
        hi = _loss(1 + s * z, q, z)
    else:  # P = mu_0, loss is minus the remove loss, decreasing in x
        lo = -_loss(s * z, q, z)
        hi = min(-math.log1p(-q) if q < 1 else math.inf, -_loss(-s * z, q, z))
    reverse = "add" if direction == "remove" else "remove"
    return connect_the_dots(lambda e: subsampled_gaussian_delta(e, q, z, direction),
                            lambda e: subsampled_gaussian_delta(e, q, z, reverse), lo, hi, h)


_STEP_PLDS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("step_plds",
                                                                        default=None)


@contextlib.contextmanager
def reusing_step_plds():
    """Within this block, accountants share the discrete PLDs of their steps: a search that
    prices one ledger plus k more steps for many k builds each step's PLD once."""
    token = _STEP_PLDS.set({})
    try:
        yield
    finally:
        _STEP_PLDS.reset(token)


def _step_pld(q: float, z: float, direction: str, h: float, tail_mass: float) -> DiscretePLD:
    """:func:`subsampled_gaussian_pld`, kept for the enclosing :func:`reusing_step_plds`."""
    kept = _STEP_PLDS.get()
    if kept is None:
        return subsampled_gaussian_pld(q, z, direction, h, tail_mass)
    key = (q, z, direction, h, tail_mass)
    if key not in kept:
        kept[key] = subsampled_gaussian_pld(q, z, direction, h, tail_mass)
        kept[key].masses.flags.writeable = False
    return kept[key]


# --------------------------------------------------------------------------- composition

@dataclass(frozen=True)
class ComposedPLD:
    """A composed, dominating PLD: ``masses`` on losses ``(start + j) h`` for j < N, plus
    ``extra_delta`` (infinite-loss mass and the bounds on mass outside the window) that is
    added to every delta."""

    start: int
    masses: np.ndarray
    extra_delta: float
    h: float

    @property
    def losses(self) -> np.ndarray:
        return (self.start + np.arange(self.masses.size)) * self.h

    def delta(self, eps: float) -> float:
        """delta(eps) = extra + sum over losses l > eps of m (1 - e^{eps - l})."""
        above = max(0, math.floor(eps / self.h) + 1 - self.start)  # first index with l > eps
        losses = (self.start + np.arange(above, self.masses.size)) * self.h
        losses_above = losses > eps  # guard the floor against rounding
        value = np.dot(self.masses[above:][losses_above], -np.expm1(eps - losses[losses_above]))
        return min(1.0, float(value) + self.extra_delta)

    def _grid_deltas(self) -> np.ndarray:
        """delta at every grid loss l_k: extra + A_k - C_k with A_k = sum_{j>k} m_j and
        C_k = sum_{j>k} m_j e^{-(j-k) h}, from the stable recurrence
        C_k = e^{-h} (m_{k+1} + C_{k+1})."""
        m = self.masses
        shifted = np.append(m[1:], 0.0)[::-1]  # m_{k+1}, reversed
        c = signal.lfilter([math.exp(-self.h)], [1.0, -math.exp(-self.h)], shifted)[::-1]
        a = np.cumsum(shifted)[::-1]
        return self.extra_delta + np.maximum(a - c, 0.0)

    def epsilon(self, delta: float) -> float:
        """Smallest eps >= 0 with self.delta(eps) <= delta (exact for this discrete PLD)."""
        if self.extra_delta >= delta:
            return math.inf
        deltas = self._grid_deltas()
        zero = -self.start  # index of loss 0 on the grid
        at_zero = deltas[zero] if 0 <= zero < deltas.size else self.delta(0.0)
        if at_zero <= delta:
            return 0.0
        losses = self.losses
        first = int(np.searchsorted(losses, 0.0, side="right"))  # first positive loss
        # delta is non-increasing; the last grid point has delta = extra < target
        k = first + int(np.argmax(deltas[first:] <= delta))
        while self.delta(losses[k]) > delta:  # the recurrence is exact up to rounding
            k += 1
        # on (l_{k-1}, l_k] delta(eps) = extra + A - e^eps B with fixed A, B
        left = losses[k - 1] if k > first else 0.0
        masses, at = self.masses[k:], losses[k:]
        a = float(masses.sum()) + self.extra_delta
        b = float(np.dot(masses, np.exp(losses[k] - at)))  # e^{l_k} B
        if b <= 0 or a <= delta:
            return float(left)
        eps = losses[k] + math.log((a - delta) / b)
        return float(min(max(eps, left), losses[k]))


def _composed_log_mgf(plds: list[tuple[DiscretePLD, int]], t: np.ndarray) -> np.ndarray:
    """K(t) = sum_k count_k log sum_i m_ki e^{t l_ki} (finite parts), for each t (any sign).

    One table of e^{t (i h) - shift_t} over the union of the grids serves every PLD (the
    shift keeps every exponent <= 0); a t at which some PLD's sum is below 1e-200 (where
    underflowed terms could matter) gets K = inf,
    which only discards that t."""
    h = plds[0][0].h
    first = min(p.offset for p, _ in plds)
    last = max(p.offset + p.masses.size for p, _ in plds)
    n = last - first
    losses_first, losses_last = first * h, (last - 1) * h
    shift = np.where(t > 0, t * losses_last, t * losses_first)
    # e^{t l_i - shift} as (block start factor) x (offset within the block): two small
    # tables of exponentials instead of one per grid point; blocks are short enough that
    # the within-block factor e^{t h j} stays below e^50
    block = int(max(1, min(256, 50.0 / max(float(np.max(np.abs(t))) * h, 1e-300))))
    starts = first + np.arange(0, n, block)
    with np.errstate(under="ignore"):
        outer = np.exp(t[:, None] * (starts[None, :] * h) - shift[:, None])
        inner = np.exp(t[:, None] * (np.arange(block) * h)[None, :])
        table = (outer[:, :, None] * inner[:, None, :]).reshape(t.size, -1)[:, :n]
    total = np.zeros_like(t)
    for pld, count in plds:
        sums = table[:, pld.offset - first: pld.offset - first + pld.masses.size] @ pld.masses
        with np.errstate(divide="ignore"):
            total += count * np.where(sums > 1e-200, np.log(sums) + shift, math.inf)
    return total


def _place(row: np.ndarray, offset: int, masses: np.ndarray) -> None:
    """Add ``masses`` at positions (offset + i) mod len(row) of ``row``."""
    size = row.size
    start = offset % size
    while masses.size:
        take = min(masses.size, size - start)
        row[start:start + take] += masses[:take]
        masses, start = masses[take:], 0


def compose(plds: list[tuple[DiscretePLD, int]], tail_mass: float) -> ComposedPLD:
    """Compose ``count`` copies of each discrete PLD (all on the same grid spacing)."""
    h = plds[0][0].h
    log_survive = sum(c * math.log1p(-p.infinity_mass) for p, c in plds)
    infinity_mass = -math.expm1(log_survive)
    # Chernoff bounds for the window [b_lo, b_hi] of the composed finite part:
    # mass above b <= exp(K(t) - t b), mass below b <= exp(K(-t) + t b), for t > 0
    var = 0.0
    for p, c in plds:
        total = max(float(p.masses.sum()), 1e-300)
        mean = float(np.dot(p.masses, p.losses)) / total
        var += c * float(np.dot(p.masses, (p.losses - mean) ** 2)) / total
    sd = max(math.sqrt(var), h)
    # t on the composed loss's scale, and on an absolute one: tiny q with small z composes
    # to a narrow bulk with a heavy tail, whose bounds only small t keep finite (with the
    # first scale alone, q = 1e-10, z = 0.3 coarsened the grid to h = 26 and priced
    # 26.2 for 0.0003)
    scale = math.sqrt(2 * math.log(1 / tail_mass)) / sd
    t = np.concatenate([scale * np.geomspace(3e-3, 3.0, 12), np.geomspace(1e-2, 1e2, 9)])
    k = _composed_log_mgf(plds, np.concatenate([t, -t]))
    k_up, k_down = k[:t.size], k[t.size:]
    log_tail = math.log(tail_mass)
    b_hi = float(np.min((k_up - log_tail) / t))
    b_lo = float(np.max((log_tail - k_down) / t))
    start, stop = math.floor(b_lo / h), math.ceil(b_hi / h)
    size = fft.next_fast_len(stop - start + 1, real=True)
    if size > MAX_FFT_SIZE:
        raise _GridTooFine(size)
    stop = start + size - 1
    # rigorous bounds on the mass outside [start, stop] * h, at the final edges
    with np.errstate(over="ignore"):
        upper = float(np.min(np.exp(k_up - t * (stop + 1) * h)))
        lower = float(np.min(np.exp(k_down + t * (start - 1) * h)))
    # the composition in long double, and a posteriori its rounding: the float64 result's
    # distance from it is float64's error, and long double's is that times u_long / u_64
    cyclic = _cyclic_composition(plds, size, _LONG)
    ratio = float(np.finfo(_LONG).eps / np.finfo(np.float64).eps)
    rounding = 0.0 if ratio == 1.0 else _ROUNDING_MARGIN * ratio * float(  # long is float64
        np.abs(cyclic - _cyclic_composition(plds, size, np.float64)).sum())
    window = np.maximum(np.roll(cyclic, -(start % size)), 0.0)
    return ComposedPLD(start, window, infinity_mass + upper + lower + rounding, h)


def _cyclic_composition(plds, size: int, dtype) -> np.ndarray:
    """prod_k rfft(m_k)^count_k, inverse-transformed (float64 values of a ``dtype``
    computation), in polar form and only at frequencies whose modulus has not yet underflowed
    (a composition of many steps is smooth: few frequencies survive)."""
    log_modulus = np.zeros(size // 2 + 1, dtype)
    phase = np.zeros(size // 2 + 1, dtype)
    alive = np.arange(size // 2 + 1)
    for first in range(0, len(plds), _FFT_BATCH):
        batch = plds[first:first + _FFT_BATCH]
        placed = np.zeros((len(batch), size), dtype)
        for row, (pld, _) in enumerate(batch):
            _place(placed[row], pld.offset, pld.masses)
        transforms = fft.rfft(placed, axis=1, workers=-1)
        for row, (_, count) in enumerate(batch):
            if dtype != np.float64:  # drop first, in float64, what cannot survive this row
                with np.errstate(divide="ignore"):
                    rough = log_modulus[alive].astype(np.float64) + count * np.log(
                        np.abs(transforms[row, alive].astype(np.complex128)))
                alive = alive[rough > _LOG_UNDERFLOW - 1.0]
            transform = transforms[row, alive]
            with np.errstate(divide="ignore"):
                log_modulus[alive] += count * np.log(np.abs(transform))
            phase[alive] += count * np.angle(transform)
            alive = alive[log_modulus[alive] > _LOG_UNDERFLOW]
    product = np.zeros(size // 2 + 1, dtype=np.result_type(dtype, 1j))
    product[alive] = np.exp(log_modulus[alive] + 1j * np.mod(phase[alive], 2 * np.pi))
    return fft.irfft(product, n=size).astype(np.float64)


class _GridTooFine(Exception):
    def __init__(self, size):
        self.size = size


# --------------------------------------------------------------------------- accountant

class PLDAccountant:
    """Privacy loss distribution accountant for Poisson-subsampled Gaussian steps.

    ``source``: a ledger, ledger path or sequence of steps (:mod:`dpcore.accounting.steps`).
    ``value_discretization`` is the loss grid spacing h (it is coarsened, by powers of two,
    only if the composed distribution would need more than ``MAX_FFT_SIZE`` grid points;
    the bound stays valid, only less tight); None (default) starts from 1e-4 and refines
    grids of fewer than ``SMALL_GRID`` points towards ``FINE_GRID``. ``tail_mass`` bounds the
    truncated tails, which are added to delta. With more than ``max_groups`` distinct (q, z)
    pairs, z is rounded down onto a grid of relative resolution ``noise_resolution``
    (conservative).
    """

    name = "pld"

    def __init__(self, source: Source = (), *,
                 value_discretization: float | None = None,
                 tail_mass: float = DEFAULT_TAIL_MASS,
                 noise_resolution: float | None = DEFAULT_NOISE_RESOLUTION,
                 max_groups: int = DEFAULT_MAX_GROUPS):
        self.value_discretization = (None if value_discretization is None else check.positive(
            "value_discretization", value_discretization))
        self.tail_mass = check.delta("tail_mass", tail_mass)
        self.noise_resolution = noise_resolution
        self.max_groups = max_groups
        self._groups: dict[tuple[float, float], int] = {}
        self.steps = 0
        self.infinite = False
        self.rounded = False
        self._composed: dict[str, ComposedPLD] | None = None
        self.compose(source)

    def compose(self, source: Source) -> "PLDAccountant":
        """Add the steps of ``source`` (returns ``self``)."""
        composition = group_steps(source, noise_resolution=self.noise_resolution,
                                  max_groups=self.max_groups)
        self.steps += composition.steps
        self.infinite = self.infinite or composition.infinite
        self.rounded = self.rounded or composition.rounded
        for g in composition.groups:
            key = (g.q, g.noise_multiplier)
            self._groups[key] = self._groups.get(key, 0) + g.count
        self._composed = None
        return self

    def _gaussian_and_rest(self) -> tuple[float, list[Group]]:
        """Noise multiplier of all q = 1 steps merged (inf if none), and the other groups."""
        inverse_square = sum(c / (z * z) for (q, z), c in self._groups.items() if q == 1)
        z = math.inf if inverse_square == 0 else inverse_square ** -0.5
        rest = [Group(q, z_, c) for (q, z_), c in sorted(self._groups.items()) if q < 1]
        return z, rest

    def _compose_all(self) -> dict[str, ComposedPLD]:
        if self._composed is None:
            gaussian_z, rest = self._gaussian_and_rest()
            if math.isinf(gaussian_z):
                groups = rest
            elif _losses_fit(gaussian_z):
                groups = rest + [Group(1.0, gaussian_z, 1)]
            else:  # merged, the q = 1 steps' losses would not fit (2,000 steps of z = 1)
                groups = [Group(q, z, c) for (q, z), c in sorted(self._groups.items())]
            total = sum(g.count for g in groups)
            per_step = 2.0 ** math.floor(math.log2(self.tail_mass / max(total, 1)))
            h = self.value_discretization or DEFAULT_VALUE_DISCRETIZATION
            while True:
                try:
                    self._composed, points = self._compose_at(groups, h, per_step)
                    break
                except _GridTooFine as exc:
                    h *= 2 ** math.ceil(math.log2(exc.size / MAX_FFT_SIZE) + 1e-9)
                    if h > _MAX_LOSS:  # its bins too wide for any loss float64 can hold
                        raise ValueError(
                            f"{total} steps are too many for the PLD accountant's grid of "
                            f"{MAX_FFT_SIZE} losses (the composed losses span beyond "
                            f"{_MAX_LOSS:g} per bin); use accountant='rdp'") from None
            # the default h, on a small grid (a composition of tiny losses, whose epsilon the
            # rounding of each step's losses to h inflates), is refined to about FINE_GRID
            refine = self.value_discretization is None and points < SMALL_GRID
            while refine and points <= FINE_GRID // 2:
                h /= 2 ** math.floor(math.log2(FINE_GRID / points))
                try:
                    self._composed, points = self._compose_at(groups, h, per_step)
                except _GridTooFine:
                    break
        return self._composed

    def _compose_at(self, groups: list[Group], h: float, per_step: float):
        """Both directions' composition of ``groups`` on the grid of spacing ``h``, and the
        most grid points one of them, or one of their steps, takes."""
        composed, points = {}, 0
        for direction in ("remove", "add"):
            plds = [(_step_pld(g.q, g.noise_multiplier, direction, h, per_step), g.count)
                    for g in groups]
            composed[direction] = compose(plds, self.tail_mass)
            points = max(points, composed[direction].masses.size,
                         *(pld.masses.size for pld, _ in plds))
        return composed, points

    def _trivial(self):
        """'zero' if nothing costs anything, 'inf' if some step was noiseless, 'gaussian' for
        only q = 1 steps (closed form), else None."""
        if self.infinite:
            return "inf"
        if not self._groups:
            return "zero"
        if all(q == 1 for q, _ in self._groups):
            return "gaussian"
        return None

    def epsilon(self, delta: float) -> float:
        """Smallest epsilon this accountant certifies at ``delta`` (an upper bound on the
        exact epsilon); see :meth:`epsilon_and_accountant`."""
        return self.epsilon_and_accountant(delta)[0]

    def epsilon_and_accountant(self, delta: float) -> tuple[float, str]:
        """(epsilon, "pld"), or (epsilon, "rdp") where the RDP bound of the same steps, as
        valid, is smaller: below the delta the discretisation resolves (its truncated tails
        and rounding, about ``tail_mass``, are added to delta, so the PLD bound is infinite
        there), and where the grid is coarse for the losses (tiny q over millions of steps:
        each step's losses are far below h)."""
        delta = check.delta("delta", delta)
        trivial = self._trivial()
        if trivial == "inf":
            return math.inf, self.name
        if trivial == "zero":
            return 0.0, self.name
        if trivial == "gaussian":
            return gaussian_epsilon(self._gaussian_and_rest()[0], delta), self.name
        epsilon = max(pld.epsilon(delta) for pld in self._compose_all().values())
        rdp = self.rdp().epsilon(delta)
        return (rdp, RDPAccountant.name) if rdp < epsilon else (epsilon, self.name)

    def rdp(self) -> RDPAccountant:
        """An RDP accountant of the same steps (noise multipliers as grouped here)."""
        return RDPAccountant([check_step(q, z, c) for (q, z), c in self._groups.items()],
                             noise_resolution=None)

    def delta(self, epsilon: float) -> float:
        """Smallest delta this accountant certifies at ``epsilon`` (an upper bound)."""
        epsilon = check.non_negative("epsilon", epsilon, allow_inf=True)
        trivial = self._trivial()
        if math.isinf(epsilon):
            return 0.0
        if trivial == "inf":
            return 1.0
        if trivial == "zero":
            return 0.0
        if trivial == "gaussian":
            return float(gaussian_delta(epsilon, self._gaussian_and_rest()[0]))
        # as in epsilon_and_accountant, the smaller of two upper bounds
        return min(max(pld.delta(epsilon) for pld in self._compose_all().values()),
                   self.rdp().delta(epsilon))


def gaussian_epsilon(z: float, delta: float) -> float:
    """Exact epsilon of the Gaussian mechanism with noise multiplier ``z`` at ``delta``,
    rounded up so that gaussian_delta(epsilon, z) <= delta."""
    if gaussian_delta(0.0, z) <= delta:
        return 0.0
    hi = 1.0
    while gaussian_delta(hi, z) > delta:
        hi *= 2
    root = optimize.brentq(lambda e: float(gaussian_delta(e, z)) - delta, 0.0, hi,
                           xtol=1e-14, rtol=1e-14)
    while gaussian_delta(root, z) > delta:
        root = math.nextafter(root, math.inf) * (1 + 1e-15)
    return float(root)
