"""Private averages of per-record vectors, step by step, with every step in the ledger.

One step: :meth:`PrivateAggregator.sample` (or :meth:`~PrivateAggregator.begin_step` when the
framework samples) writes the sampling event; :meth:`~PrivateAggregator.release` clips each
record's groups, sums, writes the groups' sum-query events, adds the noise and divides by the
public expected number of records q n. Backends that form clipped sums themselves (ghost
clipping, book-keeping) call :meth:`~PrivateAggregator.clip_factors` and
:meth:`~PrivateAggregator.release_sums` instead, or, with writeable arrays, add their sums into
the step's noise (:meth:`~PrivateAggregator.noise_draws`, then
:meth:`~PrivateAggregator.release_noisy_sums`).

The clips may move from step to step: ``clipping`` is a :class:`~dpcore.schedules.ClipSchedule`
or :class:`~dpcore.adaptive.QuantileClipping`; :attr:`PrivateAggregator.mechanism` is always the
mechanism in force at the current step, and the ledger records it.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np
from array_api_compat import array_namespace

from . import _validation as check
from . import aggregation
from .adaptive import AdaptiveClipping
from .backend import Backend
from .ledger import Ledger, PathLike, SamplingEvent, SumQueryEvent
from .noise import NoiseDraws
from .plugins import get_backend
from .budget import BudgetExhaustedError, PrivacyBudget
from .queries import Mechanism, effective_noise_multiplier
from .secure import SecureGenerator, SecurePoissonSampler, SecureStandardNormal


class FixedClipping:
    """The same mechanism at every step."""

    count_groups: tuple = ()

    def __init__(self, mechanism: Mechanism):
        self.base = mechanism

    def mechanism(self, step: int) -> Mechanism:
        return self.base


class PrivateAggregator:
    """Gaussian sum queries of ``mechanism`` on Poisson samples (rate ``q``) of ``n`` records.

    ``ledger`` is a :class:`Ledger`, a path (created, or reopened and appended to) or None (in
    memory); on a ledger holding steps the run resumes (:attr:`start_step`,
    :meth:`load_state_dict`). ``seed`` fixes sampling and noise for tests (keyed by
    :attr:`start_step`, so a resumed run draws anew); None takes OS entropy. ``secure``
    draws sampling and noise from the system's cryptographically secure generator instead of
    NumPy's and the backend's (:mod:`dpcore.secure`; unseeded, and slower).
    ``on_nonfinite`` is ``"raise"`` or ``"drop"`` (see :func:`aggregation.clip_factors`).
    ``clipping`` makes the clips move over the steps (a schedule, or adaptive clipping).
    With a ``budget`` (:class:`~dpcore.budget.PrivacyBudget`), a step that would exceed it is
    refused before anything of it is recorded: :meth:`begin_step` raises
    :class:`~dpcore.budget.BudgetExhaustedError` (Algorithm 1 of the momentum paper).
    ``extra`` declares mechanisms that every step also releases (:meth:`release` with
    ``mechanism=``: batch-norm statistics, a metric): the budget prices each step with
    their groups, and under it each is released at most once a step.
    """

    def __init__(self, mechanism: Mechanism, *, n: int, q: float,
                 backend: str | Backend = "numpy", ledger: Ledger | PathLike | None = None,
                 seed: int | None = None, on_nonfinite: str = "raise", clipping=None,
                 budget: PrivacyBudget | None = None, secure: bool = False,
                 extra: Sequence[Mechanism] = ()):
        if not isinstance(mechanism, Mechanism):
            raise TypeError(f"mechanism must be a dpcore Mechanism, got {mechanism!r}")
        self.n = check.count("n", n, minimum=1)  # q n divides every release
        self.q = check.probability("q", q)
        if on_nonfinite not in aggregation.NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite must be one of {aggregation.NONFINITE_POLICIES}, "
                             f"got {on_nonfinite!r}")
        self.on_nonfinite = on_nonfinite
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self.secure = bool(secure)
        if self.secure and seed is not None:
            raise ValueError(f"secure=True draws from the system's cryptographically secure "
                             f"generator, which takes no seed (got seed={seed!r}): a seed "
                             f"would make the noise predictable")
        if clipping is not None and not callable(getattr(clipping, "bind", None)):
            raise TypeError(f"clipping must be a ClipSchedule or a QuantileClipping (or None: "
                            f"fixed clips), got {clipping!r}")
        self._policy = (FixedClipping(mechanism) if clipping is None
                        else clipping.bind(mechanism, self.expected_size))
        if budget is not None:
            check.warn_unless_below_one_over_n(budget.delta, self.n)
        self.budget = budget
        self.extra = tuple(extra)
        for m in self.extra:
            if not isinstance(m, Mechanism):
                raise TypeError(f"extra must hold dpcore Mechanisms, got {m!r}")
        names = [g.name for m in (mechanism, *self.extra) for g in m.groups]
        if len(set(names)) < len(names):
            raise ValueError(f"the extra mechanisms' group names must differ from each other "
                             f"and from the aggregator's: {sorted(names)}")
        given = isinstance(ledger, Ledger)
        if given and (ledger.header.record, ledger.header.microbatch_size) != (
                mechanism.record, mechanism.microbatch_size):
            raise ValueError(f"ledger is for {_unit(ledger.header)}, the mechanism for "
                             f"{_unit(mechanism)}")
        self.ledger = ledger if given else Ledger(ledger, record=mechanism.record,
                                                  microbatch_size=mechanism.microbatch_size)
        try:
            self._start(seed)
        except BaseException:
            if not given:  # its lock would outlive the error where a traceback keeps this
                self.ledger.close()  # frame (a notebook): the file is closed again
            raise

    def _start(self, seed) -> None:
        """Sampling, noise and the first mechanism, from the steps the ledger holds."""
        self.start_step = self.ledger.samplings  # a resumed run continues the ledger's steps
        self._sampling = SamplingEvent(self.q, self.n)  # every step's (immutable) event
        if self.secure:
            self.sampler = SecurePoissonSampler(self.n, self.q)
            self.rng = SecureGenerator()
            self.standard_normal = SecureStandardNormal(self.backend)
        else:
            # resumed, a seed gives other draws than the steps it continues: the same noise
            # twice would cancel in the difference of two releases, the same samples would
            # make the steps' samplings dependent
            sampling_seed, noise_seed = np.random.SeedSequence(
                seed, spawn_key=(self.start_step,) if self.start_step else ()).spawn(2)
            self.sampler = self.backend.poisson_sampler(self.n, self.q, seed=sampling_seed)
            self.rng = self.backend.rng(
                None if seed is None else int(noise_seed.generate_state(1, np.uint64)[0] >> 1))
            self.standard_normal = self.backend.standard_normal
        self._extra_released: set[int] = set()  # under a budget: extra released this step
        self._mechanism = None
        self._last_release = -1  # the last step released
        self._enter(self.start_step - 1)

    def _enter(self, step: int, mechanism: Mechanism | None = None) -> None:
        """Fix the mechanism of step ``step`` (``start_step - 1``: before the first; the
        policy's, unless given), the groups it releases (with adaptive clipping's counts) and
        their ledger events."""
        if mechanism is None:
            mechanism = self._policy.mechanism(max(step, 0))
        self._step = step
        self._extra_released = set()
        if mechanism is self._mechanism and not self._policy.count_groups:
            return  # fixed clipping: the same mechanism, groups and events as the last step
        self._mechanism = mechanism
        released = self._mechanism.groups + self._policy.count_groups
        self._released = Mechanism(released, self._mechanism.record,
                                   self._mechanism.microbatch_size)
        self._events = [SumQueryEvent(g.name, g.clip, g.noise_std) for g in released]

    @property
    def mechanism(self) -> Mechanism:
        """The mechanism in force at the current step."""
        return self._mechanism

    @property
    def clips_move(self) -> bool:
        """Whether the mechanism changes from step to step (a clip schedule or adaptive
        clipping): compiled steps built for one mechanism cannot serve such an aggregator."""
        return not isinstance(self._policy, FixedClipping)

    @property
    def count_groups(self) -> tuple:
        """Groups each step releases besides the mechanism's (adaptive clipping's counts of
        unclipped records); a fused step that releases only the gradient cannot serve them."""
        return self._policy.count_groups

    def _refuse_traced(self, arrays: Mapping[str, object], factors=None) -> None:
        """A release happens on the host, once per step: inside a compiled trace (the user's
        ``jax.jit``) it would write the ledger once and draw the noise once, at tracing, and
        every call of the program would reuse that draw. ``arrays`` by leaf, and the clip
        ``factors`` adaptive clipping counts from."""
        traced = [leaf for leaf, x in arrays.items() if self.backend.is_traced(x)]
        if factors is not None and self.backend.is_traced(factors):
            traced.append("the clip factors")
        if traced:
            raise RuntimeError(
                f"the aggregator releases on the host, once per step, but {traced[:4]} are "
                f"values of a compiled trace (jax.jit, tf.function): the noise and the ledger "
                f"events would be made once, at tracing, for every call of the program. "
                f"Release outside the trace, or use the backend's compiled steps")

    def require_backend_generator(self, what: str) -> None:
        """Refuse a ``secure`` aggregator to ``what``, a compiled step that draws its noise
        with the backend's own generator (on the device, inside the compiled program)."""
        if self.secure:
            raise ValueError(
                f"this aggregator is secure=True (noise from the system's cryptographically "
                f"secure generator, drawn on the host), but {what} draw the noise with the "
                f"backend's generator inside a compiled step: use the backend's "
                f"private_gradient(loss_fn, params, batch, aggregator) for secure steps, or "
                f"an aggregator with secure=False")

    @property
    def expected_size(self) -> float:
        """q n: the public denominator of every average."""
        return self.q * self.n

    def next_noise_multiplier(self) -> float:
        """z of Eq. (1) for the next step: its gradient groups, any count groups and the
        extra mechanisms' groups."""
        groups = (self._policy.mechanism(self._step + 1).groups + self._policy.count_groups
                  + tuple(g for m in self.extra for g in m.groups))
        return effective_noise_multiplier(g.privacy_tuple for g in groups)

    def next_step_fits(self) -> bool:
        """Whether the budget (if any) affords one more step."""
        return self.budget is None or self.budget.allows(self.ledger, self.q,
                                                         self.next_noise_multiplier())

    def begin_step(self) -> None:
        """Record that a Poisson sample of rate q was drawn from the n records (after the
        step's mechanism is made: a clip it refuses leaves nothing recorded), once the
        releases dispatched before have written theirs (``backend.settle()``)."""
        self.backend.settle()
        mechanism = self._policy.mechanism(self._step + 1)
        if self.budget is not None:
            z = self.next_noise_multiplier()
            if not self.budget.allows(self.ledger, self.q, z):
                raise BudgetExhaustedError(
                    f"one more step (q={self.q}, z={z:.4g}) would exceed the budget epsilon="
                    f"{self.budget.target_epsilon} at delta={self.budget.delta}; "
                    f"{self._step + 1} steps were taken")
            self.budget.spend(self.q, z)
        self.ledger.write(self._sampling)
        self._enter(self._step + 1, mechanism)

    def sample(self) -> np.ndarray:
        """Draw a Poisson sample (sorted record indices, possibly empty) and begin its step."""
        indices = self.sampler.sample()
        self.begin_step()
        return indices

    def clip_factors(self, sq_norms, *, mask=None):
        """Per-record, per-group clip factors (B, G) from per-leaf squared norms (B, L), leaves
        in ``mechanism.leaves`` order."""
        return self._clip_factors(sq_norms, self.mechanism, mask)

    def _clip_factors(self, sq_norms, mechanism: Mechanism, mask):
        """:meth:`clip_factors` under ``mechanism`` (the aggregator's or another's)."""
        xp = self.backend.namespace()
        if mask is not None:
            aggregation.check_mask(mask, sq_norms.shape[0], xp)
        norms = aggregation.group_norms(sq_norms, mechanism, mechanism.leaves, xp=xp)
        return aggregation.clip_factors(norms, [g.clip for g in mechanism.groups], mask=mask,
                                        on_nonfinite=self.on_nonfinite, xp=xp)

    def release_sums(self, clipped_sums: Mapping[str, object], *, factors=None,
                     mask=None) -> dict:
        """Ledger, noise, division: the private average from clipped per-leaf sums.

        Adaptive clipping also needs the step's clip ``factors`` (and ``mask``) to count the
        unclipped records; its counts are released as groups of their own."""
        self._check_unreleased()
        self._mechanism.check_leaves(clipped_sums)
        self._refuse_traced(clipped_sums, factors)
        xp = self.backend.namespace()
        plain = {leaf: type(clipped_sums[leaf]).__name__ for leaf in self._mechanism.leaves
                 if not hasattr(clipped_sums[leaf], "dtype")}
        if plain:
            raise TypeError(f"clipped sums must be arrays of the backend's namespace, got "
                            f"{plain}; nothing was recorded")
        bad = [leaf for leaf in self._mechanism.leaves
               if not aggregation.all_finite(clipped_sums[leaf], xp)]
        if bad:
            raise FloatingPointError(
                f"the clipped sums of leaves {bad} hold NaN or Inf: a record escaped its clip "
                f"(or the sum overflowed), and noise would not hide it; nothing was recorded")
        counts = self._count_sums(factors, mask)
        self.record_release()
        # 16-bit sums noised in float32: scaled in float16, a std of 1e-8 drew zeros
        narrow = [leaf for leaf in self._mechanism.leaves if _is_16_bit_float(clipped_sums[leaf])]
        wide = {leaf: xp.astype(clipped_sums[leaf], xp.float32) for leaf in narrow}
        self.rng, released = aggregation.noisy_average(
            {**clipped_sums, **wide, **counts}, self._released, self.rng, self.standard_normal,
            self.expected_size, xp=self.backend.namespace())
        if counts:
            self._policy.observe(released)
            released = {leaf: released[leaf] for leaf in self._mechanism.leaves}
        return {**released, **{leaf: xp.astype(released[leaf], clipped_sums[leaf].dtype)
                               for leaf in narrow}}

    def record_release(self) -> None:
        """Write the current step's sum-query events, once the checks of a release pass. The
        releases here call it; so does a backend that draws a step's noise itself (a
        compiled step)."""
        self._check_unreleased()
        self.ledger.record_sum_queries(self._events)
        self._last_release = self._step

    def _check_unreleased(self) -> None:
        """A step must have begun; under a budget, it is released once: the budget priced
        the step as one release, and a second query of the same sample could overrun it."""
        self._check_own_sample()
        if self.budget is not None and self._last_release == self._step:
            raise RuntimeError(
                f"step {self._step} was released already, and the privacy budget priced it as "
                f"one release: release every quantity of a step at once (extra groups of the "
                f"mechanism, e.g. for metrics), or begin a new step (sample() or begin_step())")

    def _check_own_sample(self) -> None:
        """A release is priced under the ledger's last sampling event: it must be this
        aggregator's, the one its step began with."""
        if not self.begun:
            raise RuntimeError("no sample to release from: call sample() or begin_step() first")
        if self.ledger.samplings != self._step + 1:
            raise RuntimeError(
                f"this aggregator's step {self._step} began with the ledger's sampling event "
                f"{self._step + 1}, and the ledger now holds {self.ledger.samplings}: another "
                f"aggregator began a step on the same ledger since, under whose sampling (q) "
                f"this release would be priced. Give each aggregator a ledger of its own")

    @property
    def step(self) -> int:
        """The index of the current step in the run's ledger (the last one begun;
        ``start_step - 1`` before the first)."""
        return self._step

    @property
    def begun(self) -> bool:
        """Whether this aggregator has begun a step."""
        return self._step >= self.start_step

    def state_dict(self) -> dict:
        """What a checkpoint keeps beside the ledger to continue the run: the steps begun and
        adaptive clipping's current clips (JSON-serialisable)."""
        state = {"steps": self._step + 1}
        if isinstance(self._policy, AdaptiveClipping):
            state["clips"] = list(self._policy.clips)
        return state

    def load_state_dict(self, state: Mapping) -> None:
        """Continue from :meth:`state_dict`'s ``state``, before the first step. A checkpoint of
        more steps than the ledger holds is refused: those steps would go unaccounted."""
        if self.begun:
            raise RuntimeError(f"load the state before the first step (step {self._step} "
                               f"has begun)")
        steps = check.count("steps", state.get("steps"), minimum=0)
        if steps > self.start_step:
            raise ValueError(
                f"the checkpoint was taken after {steps} steps, but the ledger holds "
                f"{self.start_step}: the steps it misses would not be accounted. Resume with "
                f"the run's ledger (the path it was written to)")
        clips = state.get("clips")
        adaptive = isinstance(self._policy, AdaptiveClipping)
        if (clips is not None) != adaptive:
            raise ValueError(f"the checkpoint {'has' if clips is not None else 'lacks'} "
                             f"adaptive clipping's clips, and this aggregator "
                             f"{'uses' if adaptive else 'does not use'} adaptive clipping")
        if adaptive:
            if len(clips) != len(self._policy.clips):
                raise ValueError(f"the checkpoint has {len(clips)} clips, the mechanism "
                                 f"{len(self._policy.clips)} groups")
            self._policy.clips = [check.positive("clip", c) for c in clips]
            self._enter(self._step)  # the mechanism before the first step, with these clips

    def _count_sums(self, factors, mask) -> dict:
        """Adaptive clipping's centred counts of the unclipped records ({} without it)."""
        if not self._policy.count_groups:
            return {}
        if factors is None:
            raise ValueError("adaptive clipping needs the step's clip factors: pass "
                             "factors=factors (and mask=mask) to the release")
        if mask is not None:
            aggregation.check_mask(mask, factors.shape[0], self.backend.namespace())
        return self._policy.count_sums(factors, mask)

    def noise_draws(self, like: Mapping[str, object], *, noise: bool = True) -> NoiseDraws:
        """This step's noise ``alpha_j sigma~_g N(0, I)`` for every leaf j, as writeable arrays
        shaped, typed and placed like ``like[j]`` and drawn on first access
        (:class:`~dpcore.noise.NoiseDraws`): a backend adds its clipped sums into them in place
        and passes them to :meth:`release_noisy_sums`. ``noise=False`` gives zeros instead,
        for a process whose sums are added to those of another that draws the noise (its
        release is not private on its own: it must go into that sum and nowhere else)."""
        if not self.begun:
            raise RuntimeError("no sample to release from: call sample() or begin_step() first")
        self._mechanism.check_leaves(like)
        self._refuse_traced(like)
        narrow = {leaf: str(like[leaf].dtype) for leaf in self._mechanism.leaves
                  if hasattr(like[leaf], "dtype") and _is_16_bit_float(like[leaf])}
        if narrow:
            raise TypeError(f"noise_draws are typed like the sums, and 16-bit ones would scale "
                            f"the noise in 16 bits (a std of 1e-8 in float16 is 0): {narrow}; "
                            f"add float32 sums into float32 draws")
        return NoiseDraws(self, self._step, self._mechanism, like, noise=noise)

    def release_noisy_sums(self, draws: NoiseDraws, *, factors=None, mask=None,
                           observe: bool = True) -> dict:
        """Ledger, division: the private average from this step's :meth:`noise_draws` with the
        clipped sums added into them. Only draws made by this aggregator for the current step
        are accepted, each once, so no gradient leaves without its noise.

        Adaptive clipping's counts are noised as the draws are (not at all with
        ``noise=False``). ``observe=False`` leaves the clips where they are and returns the
        noisy averages of the counts beside the leaves (keys :attr:`count_groups`' names):
        for processes that add their releases up and then move the clips alike from the sum
        (:meth:`observe_counts`)."""
        if not isinstance(draws, NoiseDraws) or draws.aggregator is not self:
            raise TypeError(f"expected the NoiseDraws of this aggregator's noise_draws(), got "
                            f"{type(draws).__name__}")
        if draws.step != self._step or draws.released:
            raise ValueError(f"these noise draws belong to step {draws.step}"
                             f"{' and were released already' if draws.released else ''}; the "
                             f"current step is {self._step}: draw a step's noise once per release")
        self._check_unreleased()
        self._refuse_traced({}, factors)
        counts = self._count_sums(factors, mask)
        if counts and observe and not draws.noise:
            raise ValueError("these draws carry no noise (noise=False), so neither do the "
                             "counts of adaptive clipping: release with observe=False, add "
                             "the counts up with those of the process that draws the noise, "
                             "and move the clips from the sum (observe_counts)")
        if not draws.finite():
            raise FloatingPointError(
                "the sums added into the noise draws hold NaN or Inf: a record escaped its "
                "clip (or a sum overflowed), and noise would not hide it; nothing was recorded")
        self.record_release()
        released = draws.finish(self.expected_size)
        if not counts:
            return released
        if draws.noise:
            self.rng, counts = aggregation.noisy_average(
                counts, self._released, self.rng, self.standard_normal,
                self.expected_size, xp=self.backend.namespace())
        else:
            counts = {name: count / self.expected_size for name, count in counts.items()}
        if not observe:
            return {**released, **counts}
        self.observe_counts(counts)
        return released

    def observe_counts(self, released: Mapping[str, object]) -> None:
        """Move adaptive clipping's clips from the noisy averages of a step's counts (a
        release with ``observe=False``, added up over the processes that share the step)."""
        self._policy.observe(released)

    def release(self, per_record: Mapping[str, object], *, mask=None,
                mechanism: Mechanism | None = None, noise: bool = True,
                agree: Callable[[BaseException | None], None] | None = None) -> dict:
        """The private average of ``per_record`` (leaf -> (B, *shape)), rows = the sample's
        records; ``mask`` (B,) marks real rows of a padded batch.

        ``mechanism`` releases quantities other than the aggregator's (a metric of the
        sample, batch-norm statistics: groups, clips and noise of their own) on the current
        step's sample: their sum-query events join the step's, and the accountants price
        the step's queries together (Eq. (1)). Its group names must differ from the
        aggregator's; under a budget it must be one of the aggregator's ``extra``, released
        once a step. ``noise=False`` (with ``mechanism``) adds no noise, for a process whose
        release goes into a sum with that of one that draws it (not private on its own).
        ``agree(error)`` (with ``mechanism``) is called after the checks and the clipped sums,
        before anything is recorded, with what they raised or None: a backend whose processes
        release shares of one sample makes every process raise there if one failed, so
        their ledgers stay alike."""
        if mechanism is not None:
            return self._release_other(per_record, mechanism, mask, noise, agree)
        if not noise:
            raise ValueError("noise=False serves the releases of other mechanisms; for the "
                             "aggregator's own, use noise_draws(like, noise=False)")
        factors, sums = self._clipped_sum(per_record, self.mechanism, mask)
        return aggregation.in_record_dtypes(self.release_sums(sums, factors=factors, mask=mask),
                                            per_record)

    def _clipped_sum(self, per_record, mechanism: Mechanism, mask):
        """(clip factors (B, G), clipped sums by leaf) of ``per_record`` under ``mechanism``."""
        mechanism.check_leaves(per_record)
        self._refuse_traced(per_record)
        per_record = aggregation.as_floating(per_record)
        leaves = mechanism.leaves
        factors = self._clip_factors(aggregation.per_leaf_sq_norms(per_record, leaves),
                                     mechanism, mask)
        zero_rows = None
        if mask is not None or self.on_nonfinite == "drop":
            zero_rows = array_namespace(factors).equal(factors[:, 0], 0)
        return factors, aggregation.clipped_sum(per_record, factors, mechanism, leaves,
                                                zero_rows=zero_rows)

    def _release_other(self, per_record, mechanism: Mechanism, mask, noise: bool,
                       agree) -> dict:
        """:meth:`release` of another ``mechanism``'s groups on the current step."""
        error = None
        try:
            declared = self._check_other(mechanism)
            _, sums = self._clipped_sum(per_record, mechanism, mask)
        except BaseException as raised:
            error = raised
        if agree is not None:
            agree(error)
        if error is not None:
            raise error
        self.ledger.record_sum_queries(
            [SumQueryEvent(g.name, g.clip, g.noise_std) for g in mechanism.groups])
        if self.budget is not None:
            self._extra_released.add(declared)
        if not noise:
            return aggregation.in_record_dtypes(
                {leaf: total / self.expected_size for leaf, total in sums.items()}, per_record)
        self.rng, released = aggregation.noisy_average(
            sums, mechanism, self.rng, self.standard_normal, self.expected_size,
            xp=self.backend.namespace())
        return aggregation.in_record_dtypes(released, per_record)

    def _check_other(self, mechanism: Mechanism) -> int | None:
        """Refuse what a release of ``mechanism`` on this step could not price; its index
        among the declared ``extra`` (under a budget)."""
        if not isinstance(mechanism, Mechanism):
            raise TypeError(f"mechanism must be a dpcore Mechanism, got {mechanism!r}")
        self._check_own_sample()
        if self.budget is not None:
            declared = next((k for k, m in enumerate(self.extra) if m == mechanism), None)
            if declared is None:
                raise RuntimeError(
                    "a release of a mechanism the aggregator was not given as extra, under a "
                    "privacy budget that prices each step by its declared groups: give it in "
                    "PrivateAggregator(..., extra=[mechanism])")
            if declared in self._extra_released:
                raise RuntimeError(f"step {self._step} released this extra mechanism already, "
                                   f"and the budget priced the step with it once")
        header = self.ledger.header
        if (mechanism.record, mechanism.microbatch_size) != (header.record,
                                                             header.microbatch_size):
            raise ValueError(f"the mechanism is for {_unit(mechanism)}, the ledger for "
                             f"{_unit(header)}: a step's queries share one unit of privacy")
        clash = sorted({g.name for g in mechanism.groups} & {g.name for g in self._released.groups})
        if clash:
            raise ValueError(f"group names {clash} are the aggregator's own; give the other "
                             f"mechanism's groups names of their own (the ledger tells them "
                             f"apart by name)")
        return declared if self.budget is not None else None


def _unit(of) -> str:
    """The unit of privacy of a mechanism or ledger header, as its fields read."""
    size = f", microbatch_size={of.microbatch_size}" if of.microbatch_size is not None else ""
    return f"record={of.record!r}{size}"


def _is_16_bit_float(a) -> bool:
    """Whether ``a`` holds float16 or bfloat16, whatever its framework (by the dtype's name:
    TensorFlow's tensors have no Array API namespace)."""
    name = getattr(a.dtype, "name", None) or str(a.dtype).rsplit(".", 1)[-1]
    return name in ("float16", "bfloat16")
