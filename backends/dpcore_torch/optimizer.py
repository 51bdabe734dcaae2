"""A wrapper that makes any torch optimizer private.

``step()`` replaces every trainable parameter's ``.grad`` by the private average gradient of the
step (:func:`dpcore_torch.step.clip_into`, then the release), records the step's sampling event
and sum queries in the ledger, then runs the wrapped optimizer's own ``step()``: the update is
post-processing of the private release, so momentum, Adam or weight decay cost no privacy.
``accumulate()`` clips a micro-batch of the step's Poisson sample into it without releasing.
"""

from __future__ import annotations

import inspect
import warnings

import torch

from dpcore import PrivateAggregator

from .distributed import Workers
from .data import PoissonLoader
from .engine import NOT_COPIED, PerExampleEngine
from .step import clip_into


def refuse_closure_steps(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer whose ``step`` needs a closure (L-BFGS): it evaluates the loss
    several times per step, each a gradient of the same sample that would need a release
    of its own, while a private step releases one."""
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise TypeError(f"{type(optimizer).__name__}.step needs a closure, which it calls "
                        f"several times per step: each call's gradient of the sample would "
                        f"be a release of its own. Use an optimizer that steps on one "
                        f"gradient (SGD, Adam, ...)")


class PrivateOptimizer(torch.optim.Optimizer):
    """``optimizer`` with private gradients. It shares ``param_groups`` and ``state`` with the
    wrapped optimizer, so learning-rate schedulers and checkpoints work on either."""

    # torch.amp.GradScaler then hands its scale to step(), which refuses it (below)
    _step_supports_amp_scaling = True

    def __init__(self, optimizer: torch.optim.Optimizer, engine: PerExampleEngine,
                 aggregator: PrivateAggregator, *, workers: Workers | None = None,
                 loader: PoissonLoader | None = None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {optimizer!r}")
        self.engine = engine
        self._ours = {id(p) for p in engine.params.values()}
        self._refuse_stray(optimizer.param_groups)
        super().__init__([torch.zeros(0)], {})
        self.original_optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.defaults = optimizer.defaults
        self.aggregator, self.workers = aggregator, workers
        self._pending = None  # (noise draws, clip factors) of a step being accumulated
        self._failed = None  # what made a micro-batch of the current step fail
        self._stepped_at = 0  # the engine's batch count at the last step released
        self._loader = loader  # the run's Poisson loader: which sample a step's parts are of
        self._begun_on = None  # the loader's samples handed out when the step began
        self._warned_unsampled = False  # a step on a batch not of the loader (warned once)
        self._taken_on = None  # the loader's samples handed out when the last step was taken

    def __reduce_ex__(self, protocol):
        """Refused (:meth:`PerExampleEngine.__reduce_ex__`): torch's optimizers copy and pickle
        only ``defaults``, ``state`` and ``param_groups``, which would give a private
        optimizer without its engine and aggregator."""
        raise TypeError(NOT_COPIED)

    def _refuse_stray(self, param_groups, *, grads: bool = False) -> None:
        """Refuse trainable tensors the engine does not clip (with ``grads``: tensors holding
        a gradient too): the wrapped optimizer would apply their ordinary gradients without
        privacy, or, a parameter frozen when the model was made private and unfrozen since
        inside a layer dpcore forms gradients for, leave it untrained unnoticed."""
        stray = [p for group in param_groups for p in group["params"]
                 if id(p) not in self._ours and (p.requires_grad or grads
                                                  and p.grad is not None)]
        if not stray:
            return
        names = {id(p): n for n, p in self.engine.module.named_parameters()}
        stray = [names.get(id(p), f"<tensor of shape {tuple(p.shape)}>") for p in stray]
        raise ValueError(
            f"the optimizer updates tensors the private model does not clip: {stray}; their "
            f"ordinary gradients would be released without privacy. dpcore clips the "
            f"parameters that were trainable when the model was made private: unfreeze "
            f"parameters (and add them to the optimizer) before make_private")

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "original_optimizer"):  # not the placeholder of __init__
            params = param_group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            param_group = {**param_group, "params": params}
            self._refuse_stray([param_group])
            self.original_optimizer.add_param_group(param_group)
            return
        super().add_param_group(param_group)

    @property
    def ledger(self):
        return self.aggregator.ledger

    @property
    def noise_multiplier(self) -> float:
        """z of Eq. (1) over the gradient's groups (as Opacus's: noise std / clip for one
        group). With BatchNorm statistics, adaptive clipping's counts or metrics released
        on a step, the step's total is lower: the ledger's
        ``optimizer.ledger.steps()[-1].noise_multiplier``."""
        return self.aggregator.mechanism.noise_multiplier

    def next_step_fits(self) -> bool:
        """Whether the privacy budget (if any) affords one more step."""
        return self.aggregator.next_step_fits()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original_optimizer.zero_grad(set_to_none)
        self.engine.clear()

    def accumulate(self) -> None:
        """Clip the examples of the backward pass just run into the current step without
        releasing it: for a Poisson sample split into micro-batches that fit in memory, call
        this after each micro-batch's backward pass and :meth:`step` once at the end. The
        sample's sampling event is written at its first micro-batch; the noise is drawn once
        and the sums added into it. If a micro-batch fails (a NaN record), the step is
        abandoned: nothing of it is released, the sample's later micro-batches are dropped
        (released as a step of their own, they would be a sample the ledger does not
        describe) and :meth:`step` raises the error. In one process ``accumulate()`` raises it
        too; across processes (``distributed=True``) it does not, so that every process
        reaches :meth:`step`, which raises in all of them."""
        if self.engine.batch_norm is not None:
            raise ValueError("accumulate() with BatchNorm statistics released privately: they "
                             "are released from the step's first forward pass, which would "
                             "hold one micro-batch of the Poisson sample. Give the loader a "
                             "batch size that fits in memory, or replace BatchNorm with "
                             "GroupNorm")
        with torch.no_grad():
            self._forget_a_failure_of_an_earlier_sample()
            if self._failed is not None:  # this step failed already: the micro-batch is dropped
                self.engine.clear()
                return
            try:
                self._accumulate()
            except Exception as error:
                self._failed = error
                if self.workers is None:
                    raise

    def _new_sample(self) -> bool:
        """Whether the loader has handed out a sample since the current step began."""
        return self._loader is not None and self._loader.samples_given != self._begun_on

    def _forget_a_failure_of_an_earlier_sample(self) -> None:
        if self._failed is not None and self._new_sample():
            self._failed = None  # the loop skipped that sample's step() after the error

    def begin(self) -> int:
        """Begin the step (its sampling event, its noise draws) unless it has begun; its
        number. ``step()`` (or the first ``accumulate()``) begins it, or, before them, the
        first BatchNorm layer releasing its statistics in the forward pass.

        A step begun on an earlier sample of the loader and never taken (the loop skipped
        the rest of that sample after an error) is abandoned, with a warning, nothing of it
        released: adding this sample into it would release two samples as one."""
        if self._pending is not None and self._new_sample():
            warnings.warn(
                f"step {self.aggregator.step} was begun on an earlier batch of the loader and "
                f"never taken by step(): it is abandoned, nothing of it released, and this "
                f"batch begins a new step (call step() once per batch of the loader)",
                RuntimeWarning, stacklevel=3)
            self._pending, self._failed = None, None
        if self._pending is None:
            if self._loader is not None:
                self._refuse_a_used_sample()
                self._begun_on = self._loader.samples_given
            self.aggregator.begin_step()
            noise = self.workers is None or self.workers.draws_noise
            self._pending = (self.aggregator.noise_draws(self.engine.params, noise=noise), [])
        return self.aggregator.step

    def _refuse_a_used_sample(self) -> None:
        """A step needs a sample of the loader that no step was taken on: a second step on
        one batch would be recorded as a fresh Poisson sample, priced as if its records had
        been drawn anew (four steps a batch: epsilon 1.20 reported for 6.48). (A step that
        failed released nothing: the sample may be stepped on again.) Steps before
        any batch came from the loader (batches of another DataLoader, whose sampling the
        ledger does not describe) get a warning, once."""
        given = self._loader.samples_given
        if given == 0 and not self._warned_unsampled:
            self._warned_unsampled = True
            warnings.warn(
                "a step on a batch that did not come from the loader make_private returned: "
                "the ledger records it as a Poisson sample at q, which only that loader draws",
                RuntimeWarning, stacklevel=4)
        elif given and given == self._taken_on:
            raise RuntimeError(
                f"step {self.aggregator.step + 1} has no sample of its own: a step was taken "
                f"on the last batch of the loader make_private returned, and a step on a batch "
                f"already released would be priced as a fresh Poisson sample. Take one "
                f"step() per batch of that loader; nothing was recorded")

    def _accumulate(self) -> None:
        self._refuse_stray(self.param_groups, grads=True)
        self.begin()
        draws, factors = self._pending
        try:
            factors.append(clip_into(self.engine, self.aggregator, draws))
        except BaseException:
            self._pending = None
            raise

    def _accumulate_unless_failed(self) -> None:
        if self._failed is not None:
            self.engine.clear()
            raise self._failed
        self._accumulate()

    def _step_taken(self) -> str:
        """What makes this step the same in every process (:mod:`dpcore_torch.distributed`):
        among it, the loader's samples handed out when it began (a process skipping a batch,
        or stepping on batches of another loader, would add its share of another sample)."""
        agg = self.aggregator
        return (f"step {agg.step} at q={agg.q}, n={agg.n}, secure={agg.secure}, "
                f"on_nonfinite={agg.on_nonfinite!r} of {agg.mechanism}, begun on the "
                f"loader's sample {self._begun_on}")

    @torch.no_grad()
    def step(self, closure=None):
        """One private step (one Poisson sample): clip, sum, noise, ledger, then update; the
        examples of the last backward pass join any :meth:`accumulate`-d micro-batches."""
        if hasattr(self, "found_inf"):  # set by torch.amp.GradScaler.step
            del self.found_inf, self.grad_scale  # (its own step deletes them when it returns)
            raise ValueError(
                "torch.amp.GradScaler scales the loss, and with it every per-example gradient "
                "dpcore clips, and it would skip the steps whose gradients overflow, which "
                "depends on the data: train under bfloat16 autocast without a scaler, or in "
                "float32")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._forget_a_failure_of_an_earlier_sample()
        try:
            if self.workers is None:
                self._accumulate_unless_failed()
            else:  # every process raises if one did (dpcore_torch.distributed)
                self.workers.agree(self._accumulate_unless_failed, self._step_taken)
        except BaseException:
            self._pending = None  # the step is abandoned: nothing of it was released
            raise
        finally:
            self._failed = None
        (draws, factors), self._pending = self._pending, None
        factors = factors[0] if len(factors) == 1 else torch.cat(factors)
        if self.workers is None:
            grads = self.aggregator.release_noisy_sums(draws, factors=factors)
        else:
            grads = self._release_across(draws, factors)
        for name, p in self.engine.params.items():  # a parameter frozen since: not updated
            p.grad = grads[name] if p.requires_grad else None
        self._stepped_at, self._taken_on = self.engine.batches, self._begun_on
        self.original_optimizer.step()
        return loss

    def release(self, values, mechanism) -> dict:
        """The private average of a metric of the batch last passed forward: ``values``
        {name: (B, ...) tensor}, rows as the batch's records, clipped and noised by
        ``mechanism`` (groups, clips and noise of its own) as a query of that batch's step,
        priced with it. Before :meth:`step` it begins the batch's step; after it, it lands
        on the step just taken. Under a budget the mechanism must be declared
        (``make_private(..., metrics=[mechanism])``); across processes every process calls
        it with its share, and the shares are added up (process 0 draws the noise)."""
        if self.workers is not None and self._pending is not None and self._pending[1]:
            raise ValueError(
                "release() between accumulate() and step() across processes: their numbers "
                "of micro-batches differ, so their releases would not meet. Release the "
                "metric after step(), from the values of the whole sample")
        if self.workers is None:
            self._check_rows(values)
        else:  # a refusal in one process is one in all: none waits in the others' sum
            self.workers.agree(lambda: self._check_rows(values))
        if self._pending is None and self.engine.batches != self._stepped_at:
            self.begin()  # a batch since the last step: its step begins here
        with torch.no_grad():
            if self.workers is None:
                return self.aggregator.release(values, mechanism=mechanism)
            return self.workers.release_extra(self.aggregator, values, mechanism)

    def _check_rows(self, values) -> None:
        """Refuse ``values`` with more rows than the loader's last sample has records (in
        this process): rows per token or per augmentation would let one record move the
        release by several clips, priced as one."""
        records = None if self._loader is None else self._loader.last_size
        rows = max((int(v.shape[0]) for v in values.values() if getattr(v, "ndim", 0)),
                   default=0)
        if records is not None and rows > records:
            raise ValueError(
                f"release() takes at most one row per record, but the values have {rows} rows "
                f"and the loader's last sample {records} records: rows per token or per "
                f"augmentation would let one record move the release by several clips. "
                f"Reduce the values to one row per record first")

    def _release_across(self, draws, factors) -> dict:
        """The release summed over the processes; a release (its ledger write) failing in one
        fails in all. Adaptive clipping's noisy counts go into the same sum, and every
        process moves its clips from the sum, so they stay alike."""
        agg, error, released = self.aggregator, None, None
        try:
            released = agg.release_noisy_sums(draws, factors=factors, observe=False)
        except BaseException as raised:
            error = raised
        like = {**self.engine.params, **{g.name: factors.new_zeros(1)
                                         for g in agg.count_groups}}
        released = self.workers.sum_(released, like, error)
        if agg.count_groups:
            agg.observe_counts(released)
        return released

    def state_dict(self):
        """The wrapped optimizer's state and, under ``"dpcore"``, the aggregator's (the steps
        taken, adaptive clipping's clips): with the run's ledger, a checkpoint resumes the
        run where it was taken."""
        return {**self.original_optimizer.state_dict(), "dpcore": self.aggregator.state_dict()}

    def load_state_dict(self, state_dict) -> None:
        """Load :meth:`state_dict`'s output (or a plain optimizer's state), before the first
        step; a checkpoint of more steps than the ledger holds is refused, with nothing
        loaded (:meth:`dpcore.PrivateAggregator.load_state_dict`)."""
        state = dict(state_dict)
        ours = state.pop("dpcore", None)
        if ours is None and self.aggregator.count_groups and self.aggregator.start_step:
            raise ValueError(
                "the checkpoint has no 'dpcore' entry (a wrapped optimizer's state_dict): this "
                "resumed run's adaptive clipping would start again from its first clip. Save "
                "and load the private optimizer's state_dict(); nothing was loaded")
        before = self.original_optimizer.state_dict()
        self.original_optimizer.load_state_dict(state)  # torch checks it: all or nothing
        try:
            if ours is not None:
                self.aggregator.load_state_dict(ours)
        except BaseException:
            self.original_optimizer.load_state_dict(before)
            raise
        # torch makes new group and state objects: share them again (schedulers change ours)
        self.param_groups = self.original_optimizer.param_groups
        self.state = self.original_optimizer.state

    def epsilon(self, delta: float, **kwargs) -> float:
        """epsilon at ``delta`` of every step in the ledger so far."""
        from dpcore import accounting

        return accounting.epsilon(self.aggregator.ledger, delta, **kwargs)

    def __repr__(self) -> str:
        return f"PrivateOptimizer({self.original_optimizer!r}, {self.aggregator.mechanism})"
