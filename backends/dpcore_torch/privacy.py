"""``make_private``: one call from a model, optimizer and data loader to their private versions.

    model, optimizer, loader = make_private(model, optimizer, loader,
                                            noise_multiplier=1.0, max_grad_norm=1.0)

The model is instrumented in place (its ``state_dict`` keys do not change); the optimizer is
wrapped by :class:`~dpcore_torch.optimizer.PrivateOptimizer`; the loader is replaced by Poisson
sampling at rate q = batch_size / n with the same dataset and collate function. Each
``optimizer.step()`` is one Gaussian sum query of the chosen mechanism, written to the ledger.
"""

from __future__ import annotations

import math
import warnings
from functools import partial
from typing import Mapping

import torch
from torch import nn
from torch.utils.data import DataLoader

from dpcore import (ClipSchedule, Ledger, Mechanism, PrivateAggregator, QuantileClipping, flat,
                    noise_multiplier_left, per_layer)
from dpcore import _validation as check

from .batch_norm import BatchNormStatistics, PrivateStatistics
from .data import (LOADER_OPTIONS, check_whole_dataset, poisson_loader, sample_rate_of,
                   steps_per_epoch)
from .distributed import Workers
from .engine import PerExampleEngine
from .optimizer import PrivateOptimizer, refuse_closure_steps

CLIPPINGS = ("flat", "per_layer")


def build_mechanism(clipping, leaf_sizes: Mapping[str, int], max_grad_norm: float,
                    noise_multiplier: float | None) -> Mechanism:
    """``"flat"``: one group, clip S; ``"per_layer"``: one group per parameter with
    S_g = S / sqrt(L) and proportional noise (Eq. (1) multiplier = ``noise_multiplier``);
    a :class:`dpcore.Mechanism` (leaves = parameter names) keeps its clips and allocation,
    its noise scaled to ``noise_multiplier`` if given (every sigma~_g times z / z_mechanism)."""
    if isinstance(clipping, Mechanism):
        if noise_multiplier is None:
            return clipping
        own = clipping.noise_multiplier
        if not 0 < own < math.inf:
            raise ValueError(f"the mechanism's noise multiplier is {own} (Eq. (1)), which no "
                             f"scaling of its noise makes {noise_multiplier}; give its "
                             f"groups noise, or leave noise_multiplier and target_epsilon out")
        return clipping.with_noise([g.noise_std * noise_multiplier / own
                                    for g in clipping.groups])
    if clipping == "flat":
        return flat(list(leaf_sizes), max_grad_norm, noise_multiplier)
    if clipping == "per_layer":
        return per_layer(leaf_sizes, max_grad_norm, noise_multiplier)
    raise ValueError(f"clipping must be one of {CLIPPINGS} or a dpcore.Mechanism, "
                     f"got {clipping!r}")


def calibrate(target_epsilon: float, delta: float, q: float, steps: int,
              accountant: str = "pld") -> float:
    """The smallest noise multiplier z whose ``steps`` steps at rate q are
    (target_epsilon, delta)-DP (by the core's calibration)."""
    from dpcore.accounting import calibrate_noise_multiplier

    return calibrate_noise_multiplier(target_epsilon, delta, q=q, steps=steps,
                                      accountant=accountant)


def make_private(module: nn.Module, optimizer: torch.optim.Optimizer, data_loader: DataLoader,
                 *, max_grad_norm: float, noise_multiplier: float | None = None,
                 target_epsilon: float | None = None, target_delta: float | None = None,
                 epochs: int | None = None, clipping="flat", loss_reduction: str = "mean",
                 ledger=None, seed: int | None = None, mode: str = "auto",
                 prefer: str = "memory", accountant: str = "pld", clip_policy=None,
                 budget=None, on_nonfinite: str = "raise", check_independence: bool = True,
                 secure: bool = False, distributed: bool = False,
                 batch_norm: BatchNormStatistics | None = None, metrics=()):
    """Private (module, optimizer, data_loader).

    Give ``noise_multiplier`` z, or ``target_epsilon`` with ``target_delta`` and ``epochs`` to
    calibrate z up front for epochs * round(1/q) steps (halves up:
    :func:`dpcore.sampling.steps_per_epoch`). ``clipping`` is ``"flat"``,
    ``"per_layer"`` or a :class:`dpcore.Mechanism` over the parameter names, whose clips and
    allocation are kept and whose noise is scaled to z (as given, without either).
    ``loss_reduction`` must match the loss (``"mean"`` or ``"sum"`` over the batch).
    ``ledger`` is a path, a :class:`dpcore.Ledger` or None (in memory); the run's ledger
    path, reopened, resumes the run (with ``optimizer.load_state_dict`` of a checkpoint's
    ``optimizer.state_dict()``). ``seed`` fixes sampling and noise (tests only; None draws
    OS entropy); ``secure`` draws sampling and noise from the system's cryptographically
    secure generator instead (:mod:`dpcore.secure`; no seed). ``mode`` is ``"auto"`` (ghost
    norms and book-keeping where a layer rule exists, ``torch.func`` elsewhere) or
    ``"vmap"`` (``torch.func`` for the whole model); ``prefer`` ("memory" or "time") picks
    ghost norms or materialised per-example gradients per layer
    (:func:`dpcore_torch.layers.use_ghost`). ``accountant`` calibrates ``target_epsilon``.
    ``check_independence``: the model's first two training steps raise
    :class:`NotPerExampleError` if it mixes the examples of the batch
    (:mod:`dpcore_torch.independence`), and every step a layer that sees k >= 2 rows per
    example of the model's input (a model folding augmentations into the batch) raises it;
    turn it off only for a model whose inputs or outputs have rows that are not the examples.

    ``clip_policy`` makes the clip move: ``"adaptive"`` (adaptive quantile clipping with the
    paper's defaults, starting from ``max_grad_norm``; the noise multiplier is the total, count
    included), a :class:`dpcore.QuantileClipping` or a :class:`dpcore.ClipSchedule`.
    ``on_nonfinite``: a record whose gradient holds NaN or Inf makes ``optimizer.step()``
    raise :class:`dpcore.aggregation.NonFiniteNormError` before any sum is released or
    recorded (``"raise"``), or is given weight 0 (``"drop"``; dropping costs no privacy).
    ``budget`` (a :class:`dpcore.PrivacyBudget`) makes ``optimizer.step()`` refuse, with
    :class:`dpcore.BudgetExhaustedError` and before recording anything, the step that would
    exceed it; ``optimizer.next_step_fits()`` asks first (Algorithm 1).

    ``distributed=True``: one of several processes of ``torch.distributed`` training one model
    (:mod:`dpcore_torch.distributed`), each called with the whole dataset and its own loader
    whose ``batch_size`` is per process (q = world * batch_size / n). The model is made
    process 0's; each step clips every process's share of one Poisson sample, process 0 adds
    the noise, and the sums are added over the processes; only process 0 writes a ledger
    path. Adaptive clipping counts the unclipped records of every process's share: the
    counts are added up with the releases, their noise drawn by process 0 alone.

    ``batch_norm`` (a :class:`~dpcore_torch.batch_norm.BatchNormStatistics`) trains the
    model's BatchNorm layers with their batch statistics released privately at each step's
    forward pass (:mod:`dpcore_torch.batch_norm`); the step's noise multiplier (given or
    calibrated) then covers those releases too, and so does a ``budget`` (its step begins,
    and may be refused, at the forward pass); with ``distributed``, every process's share
    is summed, process 0 drawing the noise. ``metrics`` declares the mechanisms of metrics
    released each step by ``optimizer.release``: the step's noise multiplier (given or
    calibrated) covers them too, the gradient's share being 1/z_g^2 = 1/z^2 - sum_m 1/z_m^2,
    and a ``budget`` prices them.
    """
    if not isinstance(data_loader, DataLoader):
        raise TypeError(f"data_loader must be a torch DataLoader, got {data_loader!r}")
    check_whole_dataset(data_loader)
    refuse_closure_steps(optimizer)
    clipping_policy = _clipping_policy(clip_policy)
    statistics = None
    if batch_norm is not None:
        statistics = _batch_norm_statistics(module, batch_norm)
    if isinstance(module, nn.parallel.DistributedDataParallel):
        raise TypeError("make_private takes the model itself, not a DistributedDataParallel "
                        "(which would add up the unclipped gradients): pass model.module "
                        "with distributed=True, and dpcore adds up the clipped ones")
    workers = None
    if distributed:
        workers = Workers(next(module.parameters(), torch.empty(0)).device)
    if workers is not None:
        if workers.rank != 0 and not isinstance(ledger, Ledger):
            if ledger is not None:
                warnings.warn(
                    f"process {workers.rank} was given the ledger path {str(ledger)!r}: only "
                    f"process 0 writes a ledger file (every process keeps the same events); "
                    f"give the path to process 0", RuntimeWarning, stacklevel=2)
            ledger = None
        workers.copy_model(module)
    n = len(data_loader.dataset)
    q = sample_rate_of(data_loader, 1 if workers is None else workers.world)
    own = isinstance(clipping, Mechanism)  # its own noise unless one of the two is given
    if noise_multiplier is not None and target_epsilon is not None or (
            noise_multiplier is None and target_epsilon is None and not own):
        raise ValueError(f"give {'at most' if own else 'exactly'} one of noise_multiplier and "
                         f"target_epsilon (got noise_multiplier={noise_multiplier!r}, "
                         f"target_epsilon={target_epsilon!r})")
    if target_epsilon is not None:
        if target_delta is None or epochs is None:
            raise ValueError("target_epsilon needs target_delta and epochs to calibrate the "
                             "noise multiplier")
        check.warn_unless_below_one_over_n(check.delta("target_delta", target_delta), n)
        steps = check.count("epochs", epochs, minimum=1) * steps_per_epoch(q)
        noise_multiplier = calibrate(target_epsilon, target_delta, q, steps,
                                     accountant) * _largest_clip_scale(clip_policy, steps)
    elif target_delta is not None or epochs is not None:
        raise ValueError(f"target_delta and epochs serve target_epsilon's calibration, and the "
                         f"noise multiplier was given (got target_delta={target_delta!r}, "
                         f"epochs={epochs!r}): drop them, or give target_epsilon instead")
    if statistics is not None and noise_multiplier is not None:  # the step's total
        noise_multiplier = batch_norm.gradient_noise_multiplier(noise_multiplier,
                                                                len(statistics.layers))
    metrics = tuple(metrics)
    if metrics and noise_multiplier is not None:
        noise_multiplier = _gradient_share(noise_multiplier, metrics)
    engine = PerExampleEngine(module, mode=mode, loss_reduction=loss_reduction, prefer=prefer,
                              check_independence=check_independence, batch_norm=statistics)
    given = ledger
    try:
        mechanism = build_mechanism(clipping, engine.leaf_sizes, max_grad_norm,
                                    noise_multiplier)
        extra = (*(() if statistics is None else statistics.mechanisms()), *metrics)

        def build():
            return PrivateAggregator(
                mechanism, n=n, q=q, backend="torch", ledger=ledger, seed=seed,
                clipping=clipping_policy,
                budget=budget, on_nonfinite=on_nonfinite, secure=secure, extra=extra)

        def settings():  # what every process must share (their models: copy_model)
            return (f"q={q}, n={n} and {mechanism}, extra {extra}, loss_reduction="
                    f"{loss_reduction!r}, {_optimizer_settings(optimizer)}")

        if workers is not None:  # opened in every process or in none
            ledger = workers.agree(partial(_opened, ledger, mechanism))
            # a resumed ledger: process 0's events, so every process continues its steps
            workers.share_ledger(ledger)
        aggregator = build() if workers is None else workers.agree(build, settings)
    except BaseException:
        engine.detach()  # the model as it was: make_private can be called again
        if isinstance(ledger, Ledger) and ledger is not given:
            ledger.close()  # the file opened here (its lock) too
        raise
    loader = poisson_loader(  # the aggregator's sampler: the backend's, which conformance tests
        data_loader.dataset, q, sampler=aggregator.sampler, collate_fn=data_loader.collate_fn,
        shard=None if workers is None else workers.shard,
        **{option: getattr(data_loader, option) for option in LOADER_OPTIONS})
    private = PrivateOptimizer(optimizer, engine, aggregator, workers=workers, loader=loader)
    if statistics is not None:  # released on the optimizer's step, by its aggregator
        statistics.begin = private.begin
        statistics.release = (aggregator.release if workers is None else
                              partial(workers.release_extra, aggregator))
    return module, private, loader


def _optimizer_settings(optimizer) -> str:
    """The optimizer's class and each parameter group's settings and size: processes that
    step otherwise would train different models from the same releases."""
    def plain(value):  # an object's address differs between processes
        return type(value).__qualname__ if " at 0x" in repr(value) else value

    groups = [{"parameters": len(group["params"]),
               **{key: plain(value) for key, value in group.items() if key != "params"}}
              for group in optimizer.param_groups]
    return f"{type(optimizer).__name__} {groups}"


def _clipping_policy(clip_policy):
    """The aggregator's ``clipping`` for ``clip_policy``."""
    if isinstance(clip_policy, str) and clip_policy == "adaptive":
        return QuantileClipping()
    if clip_policy is None or isinstance(clip_policy, (QuantileClipping, ClipSchedule)):
        return clip_policy
    raise ValueError(f"clip_policy must be None (fixed clip), 'adaptive', a "
                     f"dpcore.QuantileClipping or a dpcore.ClipSchedule, got {clip_policy!r}")


def _largest_clip_scale(clip_policy, steps: int) -> float:
    """What the calibrated z is multiplied by so that a clip schedule holding the noise's
    standard deviation, z_t = z / factor(t), keeps z_t >= z over the ``steps`` planned: its
    largest factor above 1 (a warm-up to 2 C priced at z spent 2.3 of a target 1)."""
    if not isinstance(clip_policy, ClipSchedule) or clip_policy.hold != "noise_std":
        return 1.0
    return max(1.0, *(check.positive(f"clip schedule factor at step {t}", clip_policy.factor(t))
                      for t in range(steps)))


def _gradient_share(total: float, metrics: tuple) -> float:
    """The gradient's z when the ``metrics`` mechanisms are released on every step too, so
    that the step's multiplier is ``total``."""
    for m in metrics:
        if not isinstance(m, Mechanism):
            raise TypeError(f"metrics must hold dpcore Mechanisms, got {m!r}")
    return noise_multiplier_left(
        total, [m.noise_multiplier for m in metrics],
        f"the metrics {[g.name for m in metrics for g in m.groups]}",
        "give their groups more noise")


def _opened(ledger, mechanism: Mechanism) -> Ledger:
    """``ledger`` (a path, a Ledger or None) as a :class:`dpcore.Ledger` for ``mechanism``."""
    if isinstance(ledger, Ledger):
        return ledger
    return Ledger(ledger, record=mechanism.record, microbatch_size=mechanism.microbatch_size)


def _batch_norm_statistics(module, settings) -> PrivateStatistics:
    """The model's BatchNorm layers, their statistics to be released privately."""
    if not isinstance(settings, BatchNormStatistics):
        raise TypeError(f"batch_norm must be a dpcore_torch.BatchNormStatistics, got "
                        f"{settings!r}")
    statistics = PrivateStatistics(settings, module)
    if not statistics.layers:
        raise ValueError(f"batch_norm={settings} was given, but {type(module).__name__} has no "
                         f"BatchNorm layer")
    return statistics
