"""The per-example engine: instruments an ``nn.Module`` so that one ordinary forward and backward
pass yields per-example squared norms (B, L) and clipped sums for every trainable parameter.

Every trainable parameter (a *leaf*, named as in ``module.named_parameters()``) is owned by a
*unit*: a layer with a rule (:mod:`dpcore_torch.layers`: Linear, Conv1d/2d, Embedding, LayerNorm,
GroupNorm; :mod:`dpcore_torch.recurrent`: RNN, GRU, LSTM; :mod:`dpcore_torch.attention`:
MultiheadAttention; :mod:`dpcore_torch.batch_norm`: BatchNorm) or a fallback module
(:mod:`dpcore_torch.fallback`, ``torch.func``, or for parameters used only by broadcasting
operations, :mod:`dpcore_torch.taps`). A leaf used once
takes its rule's cheapest norm (ghost or materialised) and book-keeping sum; a leaf used several
times in a step (tied weights, a layer called twice) has its per-example gradient formed as the
sum of the uses' contributions, grad_i = sum_u grad_i^(u), before any norm is taken.

Loss reduction: with ``loss_reduction="mean"`` the backprops carry a factor 1/B; the engine
multiplies per-example gradients by B (norms by B^2), so they are always the gradients of each
example's own loss. ``"sum"`` takes them as they are.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Mapping, Sequence

import torch
from torch import nn

from .attention import ATTENTION_RULES
from .batch_norm import BATCH_NORM_RULES, PrivateStatistics
from .draws import enter_opaque, leave_opaque, opaque
from .fallback import FallbackUnit, recording
from .independence import Probe, probing, rerunning
from .instrumentation import forget, instrumentation, set_by_dpcore
from .layers import (PREFERENCES, RULES, AccumulationError, NotPerExampleError, Rule,
                     add_contraction, check_lookup_table, full_precision, keep_rows,
                     row_sq_norms, tick, tracing)
from .recurrent import RECURRENT_RULES

MODES = ("auto", "vmap")
REDUCTIONS = ("mean", "sum")


NOT_COPIED = (
    "a PerExampleEngine (and the private optimizer holding it) cannot be copied or pickled: "
    "the copy would not see the model's forward passes. Copy or save the model (a plain "
    "model, dpcore's instrumentation left out) and the optimizer's state_dict(), and make "
    "the copy private on its own")


class LeakedGradientError(RuntimeError):
    """A parameter got a gradient that no instrumented layer saw per example."""


def check_per_example(module: nn.Module, *, private_batch_norm: bool = False) -> None:
    """Raise :class:`NotPerExampleError` for layers that mix the examples of a batch (not
    BatchNorm layers whose statistics are released privately)."""
    for name, sub in module.named_modules():
        if not (private_batch_norm and isinstance(sub, nn.modules.batchnorm._BatchNorm)):
            _check_layer(name or "<root>", sub)


def _check_layer(name: str, sub: nn.Module) -> None:
    # PyTorch normalises with the batch's statistics in training mode, and in eval mode too
    # when it keeps no running statistics (track_running_stats=False)
    if isinstance(sub, nn.modules.batchnorm._BatchNorm) and (sub.training
                                                             or sub.running_mean is None):
        c = sub.num_features
        state = ("is in training mode" if sub.training else
                 "keeps no running statistics (track_running_stats=False)")
        fix = ("call .eval() on it to use frozen running statistics" if sub.running_mean
               is not None else "construct it with track_running_stats=True and call .eval()")
        raise NotPerExampleError(
            f"{type(sub).__name__} {name!r} {state}: it normalises each example with "
            f"statistics of the whole batch, so per-example gradients (and DP) are undefined. "
            f"Replace it with nn.GroupNorm({min(32, c)}, {c}) (or nn.LayerNorm), or {fix}, "
            f"or have make_private release its statistics privately "
            f"(batch_norm=BatchNormStatistics(clip, noise_multiplier))")
    if (isinstance(sub, nn.modules.instancenorm._InstanceNorm) and sub.training
            and sub.track_running_stats):
        raise NotPerExampleError(
            f"{type(sub).__name__} {name!r} tracks running statistics in training mode: it "
            f"moves them with the batch's statistics, without noise, and eval mode reads "
            f"them. Construct it with track_running_stats=False (each example is normalised "
            f"with its own statistics in training either way)")
    if isinstance(sub, (nn.MultiheadAttention, nn.RNNBase)) and not sub.batch_first:
        raise NotPerExampleError(
            f"{type(sub).__name__} {name!r} has batch_first=False: dpcore needs the examples on "
            f"axis 0; construct it with batch_first=True and pass (batch, sequence, feature) "
            f"inputs")


def _refuse_16_bit_params(params: Mapping[str, nn.Parameter]) -> None:
    """Refuse float16 and bfloat16 parameters: their clipped sums would be formed and rounded
    in that dtype before the noise, and a rounded sum of many records moves by more than the
    clip when one record leaves it (1.5 clips for a batch of 512 in bfloat16)."""
    for name, p in params.items():
        if p.is_floating_point() and torch.finfo(p.dtype).bits < 32:
            raise ValueError(
                f"parameter {name!r} is {p.dtype}: its clipped sum would be rounded to "
                f"{p.dtype} before the noise, and one record could move it by more than its "
                f"clip. Keep the parameters in float32 and compute in 16 bits under "
                f"torch.autocast(device_type, dtype={p.dtype}) (no GradScaler)")


def _refuse_batch_statistics(name: str):
    """A forward pre-hook refusing a normalisation layer put (back) into a mode that mixes
    the examples or moves running statistics with the batch's, with gradients or without
    (``torch.no_grad()`` passes in training mode, ``swa_utils.update_bn``, move them too)."""
    def refuse(module, args):
        _check_layer(name, module)
    return refuse


def _accumulation_error(unit) -> AccumulationError:
    """For a unit with a back-propagated call made after a backward pass had reached some
    call of the step: two batches, two backward passes, one step. Pairing row i of the two
    batches as one example would clip two records together (twice the sensitivity). Calls
    made after a backward pass and never back-propagated (an evaluation forward with
    gradients on) contribute zero and pass; so do calls that activation checkpointing
    recomputes during a backward pass, and several backward passes through one forward."""
    return AccumulationError(
        f"{type(unit.module).__name__} was back-propagated for a forward pass made after an "
        f"earlier backward pass of this step (gradient accumulation). dpcore clips each "
        f"example within one forward pass: for a Poisson sample split into micro-batches, "
        f"call optimizer.accumulate() (in a custom loop: dpcore_torch.step.clip_into) after "
        f"each micro-batch's backward pass and optimizer.step() once per sample. If the "
        f"earlier pass was not for this step's gradient (torch.autograd.grad for adversarial "
        f"inputs, say), call optimizer.zero_grad() (engine.clear()) before the training "
        f"forward pass")


class _RuleUnit:
    """A layer with a rule; its forward is routed through the rule's autograd function."""

    def __init__(self, module: nn.Module, rule: Rule, names: dict[str, str]):
        self.module, self.rule, self.names = module, rule, names  # attr -> leaf name
        self.calls = []
        original = module.forward

        def forward(*args, **kwargs):
            if not recording():
                return original(*args, **kwargs)
            if not args and "input" in kwargs:  # layer(input=x)
                args, kwargs = (kwargs["input"],), {k: v for k, v in kwargs.items()
                                                    if k != "input"}
            return opaque(lambda: rule.forward(module, self.calls, args, kwargs), args, kwargs,
                          self.batch_outputs)

        module.forward = forward
        instrumentation(module).added.add("forward")

    def remove(self) -> None:
        del self.module.forward

    def batch_outputs(self, out):
        """The outputs of a call with the examples on axis 0 (the rule's)."""
        return self.rule.batch_outputs(self.module, out)

    def grads(self, call):
        return {k: self.rule.cached_grad(self.module, call, k) for k in self.names}


def _input_shapes(args, kwargs) -> tuple[set, set]:
    """(the sizes of axis 0, the sizes of every axis and the lengths of lists) of a model
    call's inputs: its tensor arguments and those one level into lists, tuples, dicts and
    dataclasses."""
    firsts, sizes = set(), set()
    for value in (*args, *kwargs.values()):
        if isinstance(value, Mapping):
            values = list(value.values())
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            values = [getattr(value, f.name) for f in dataclasses.fields(value)]
        elif isinstance(value, (list, tuple)):
            values = list(value)
            sizes.add(len(value))
        else:
            values = [value]
        for t in values:
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                firsts.add(t.shape[0])
                sizes.update(t.shape)
    return firsts, sizes


class PerExampleEngine:
    """Per-example norms and clipped sums of ``module``'s trainable parameters.

    ``mode="auto"`` uses the layer rules and falls back to ``torch.func`` per module;
    ``mode="vmap"`` treats the whole model as one ``torch.func`` unit. ``prefer`` ("memory" or
    "time") chooses between ghost norms and materialised gradients per layer
    (:func:`dpcore_torch.layers.use_ghost`). ``check_independence`` probes the first two training
    forward passes of ``module`` for mixing of the examples (:mod:`dpcore_torch.independence`;
    in ``"auto"`` mode, where the layers' backprops are used). Call :meth:`clear` (the
    private optimizer does) between steps, :meth:`detach` to restore the module.
    """

    def __init__(self, module: nn.Module, *, mode: str = "auto", loss_reduction: str = "mean",
                 prefer: str = "memory", check_independence: bool = True,
                 batch_norm: PrivateStatistics | None = None):
        if prefer not in PREFERENCES:
            raise ValueError(f"prefer must be one of {PREFERENCES}, got {prefer!r}")
        self.prefer = prefer
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if loss_reduction not in REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {REDUCTIONS}, got {loss_reduction!r}")
        check_per_example(module, private_batch_norm=batch_norm is not None)
        engines = [sub for sub in module.modules() if getattr(sub, "_dpcore_engine", None)]
        if engines:
            raise ValueError(
                f"{type(engines[0]).__name__} is instrumented by a PerExampleEngine already (was "
                f"the model made private twice?); call that engine's detach() first, or keep "
                f"using it: two engines would both record every call")
        self.module, self.mode, self.loss_reduction = module, mode, loss_reduction
        self.params: dict[str, nn.Parameter] = {
            name: p for name, p in module.named_parameters() if p.requires_grad}
        if not self.params:
            raise ValueError(f"{type(module).__name__} has no trainable parameters")
        _refuse_16_bit_params(self.params)
        self._leaf_of = {id(p): name for name, p in self.params.items()}
        # smallest parameters first: see clipped_sums
        self._by_size = sorted(self.params, key=lambda name: self.params[name].numel())
        self.units: list = []
        self._handles = []
        self._leaked: set[str] = set()
        self._waiting: set[int] = set()  # ids of unreached calls kept through a clear()
        self._summed: dict[str, torch.Tensor] = {}  # leaves used several times: sum of uses
        self._model_calls: list[tuple] = []  # the model's calls: (first, last tick, shapes)
        self._model_call = None  # the (first tick, shapes) of a call of the model running
        self.batches = 0  # training forward passes of the model so far
        self._passes: list[int] = []  # when each forward pass of the model this step began
        self.batch_norm = batch_norm
        if batch_norm is not None:  # first: a BatchNorm's rule wraps its private forward
            batch_norm.instrument()
        try:
            if mode == "vmap":
                self._add_fallback(module, recurse=True, prefix="")
            else:
                self._walk(module, "")
        except BaseException:
            self.detach()  # the model as it was
            raise
        self._probe = Probe(self.units, list(self.params.values()),
                            {id(m): n or "<root>" for n, m in module.named_modules()},
                            recording) if check_independence and mode == "auto" else None
        # units form every gradient per example; one reaching a parameter is from elsewhere
        self._handles += [p.register_hook(self._leak_detector(leaf))
                          for leaf, p in self.params.items()]
        for name, sub in module.named_modules():
            hooks = []
            if (isinstance(sub, nn.modules.batchnorm._BatchNorm) and batch_norm is None
                    or isinstance(sub, nn.modules.instancenorm._InstanceNorm)):
                hooks.append(sub.register_forward_pre_hook(_refuse_batch_statistics(name)))
            if isinstance(sub, nn.MultiheadAttention):  # its code transposes the batch axis
                hooks += [sub.register_forward_pre_hook(enter_opaque, with_kwargs=True),
                          sub.register_forward_hook(leave_opaque, with_kwargs=True)]
            if sub is module:  # the training batches that enter the model
                hooks.append(sub.register_forward_pre_hook(
                    torch.compiler.disable(self._count_batch)))
            if sub is module and self._probe is not None:
                hooks += [  # not traced into a compiled model's call
                    sub.register_forward_pre_hook(torch.compiler.disable(self._probe_start),
                                                  with_kwargs=True),
                    sub.register_forward_hook(torch.compiler.disable(self._probe.finish),
                                              with_kwargs=True),
                    sub.register_forward_pre_hook(torch.compiler.disable(self._model_called),
                                                  with_kwargs=True),
                    sub.register_forward_hook(torch.compiler.disable(self._model_returned),
                                              with_kwargs=True)]
            if hooks:
                instrumentation(sub).hooks.extend(hooks)
                self._handles += hooks
        module._dpcore_engine = True
        instrumentation(module).added.add("_dpcore_engine")

    # ------------------------------------------------------------------ instrumentation
    def _walk(self, module: nn.Module, prefix: str) -> None:
        # a forward set on the instance (a user's or a library's patch) is not the layer's
        # own: the module takes the fallback, which runs whatever forward it has
        patched = "forward" in module.__dict__ and not set_by_dpcore(module, "forward")
        rule = None if patched else (
            RULES.get(type(module)) or RECURRENT_RULES.get(type(module))
            or ATTENTION_RULES.get(type(module)) or BATCH_NORM_RULES.get(type(module)))
        # a rule with ``subtree`` (attention) also forms its children's parameters
        own = {k: p for k, p in module.named_parameters(recurse=rule is not None and rule.subtree)
               if p.requires_grad}
        if rule is not None and own and rule.knows(module, own):
            for attr in own:
                rule.check(module, prefix.rstrip(".") or "<root>")
            names = {attr: self._leaf_of[id(p)] for attr, p in own.items()}
            self.units.append(_RuleUnit(module, rule, names))
            return
        if own and type(module).__module__.startswith("torch."):
            # a built-in layer without a rule may use its children's parameters functionally
            # (nn.MultiheadAttention with add_bias_kv, and its out_proj): one unit for the
            # whole subtree
            self._add_fallback(module, recurse=True, prefix=prefix)
            return
        if own:
            self._add_fallback(module, recurse=False, prefix=prefix)
        for name, child in module.named_children():
            self._walk(child, f"{prefix}{name}.")

    def _add_fallback(self, module: nn.Module, *, recurse: bool, prefix: str) -> None:
        names = {k: self._leaf_of[id(p)]
                 for k, p in module.named_parameters(recurse=recurse) if p.requires_grad}
        if names and isinstance(module, nn.EmbeddingBag):  # its own lookups, as Embedding's
            check_lookup_table(module, prefix.rstrip(".") or "<root>")
        if names:
            self.units.append(FallbackUnit(module, names, recurse))

    def _count_batch(self, module, args) -> None:
        """Root forward pre-hook: count the training passes of the user's batches (not the
        check's reruns, nor replays, nor passes without gradients), and note when each pass
        with gradients began (:meth:`_check_one_forward`)."""
        if recording() and not rerunning():
            self.batches += module.training
            self._passes.append(tick())

    def _model_called(self, module, args, kwargs) -> None:
        """Root forward pre-hook: what the model's input says of its examples
        (:func:`_input_shapes`, read by :meth:`_check_rows`)."""
        if recording():
            self._model_call = (tick(), _input_shapes(args, kwargs))

    def _model_returned(self, module, args, kwargs, output) -> None:
        if self._model_call is not None:
            start, shapes = self._model_call
            # until the engine's clear(); a loop that never clears keeps the last 64
            self._model_calls = [*self._model_calls[-63:], (start, tick(), shapes)]
            self._model_call = None

    def _check_rows(self, unit, call) -> None:
        """Refuse a layer call that saw k >= 2 rows for each of s examples, s the size of
        axis 0 of an input tensor of the model's call it was made in, and k s the size of no
        axis of its inputs: a model that folds k rows per example into the batch, whose rows
        would be clipped apart. (A time-major input (T, B, ...) has B on axis 1: left to the
        independence check, as are row counts that are no multiple.)"""
        if call.born is None:
            return
        rows = call.batch_size
        for start, end, (firsts, sizes) in self._model_calls:
            if not start < call.born < end or rows in sizes:
                continue
            folded = [s for s in firsts if rows >= 2 * s and rows % s == 0]
            if folded:
                raise NotPerExampleError(
                    f"{type(self.module).__name__}'s input has {max(folded)} examples on "
                    f"axis 0, but its layer {type(unit.module).__name__} saw {rows} rows: a "
                    f"model that folds several rows per example into the batch "
                    f"(augmentations of one image, one user's examples: x.flatten(0, 1)) "
                    f"would have each row clipped apart, and an example bounded by several "
                    f"clips. Use make_private(..., mode='vmap'), which clips each example's "
                    f"rows as one, or keep them off axis 0 (a Linear on (B, K, d) treats K as "
                    f"a sequence); if the model's input rows are not its examples, "
                    f"check_independence=False")

    def _leak_detector(self, leaf: str):
        def detect(grad):
            # our layers' functions return None for parameters; the check's passes are ignored
            if grad is not None and not probing():
                self._leaked.add(leaf)
            return grad
        return detect

    def __reduce_ex__(self, protocol):
        """An engine is bound to the model it instruments: a copy (``copy.deepcopy`` of a
        private optimizer, a pickle) would hold a copy of the model whose layers no longer
        record anything, so its sums would be zero and its steps pure noise."""
        raise TypeError(NOT_COPIED)

    def detach(self) -> None:
        """Remove every hook and restore the layers' own forward methods."""
        for unit in self.units:
            unit.remove()
        for handle in self._handles:
            handle.remove()
        if self.batch_norm is not None:
            self.batch_norm.remove()
        self.units, self._handles, self._probe = [], [], None
        self.module.__dict__.pop("_dpcore_engine", None)
        for sub in self.module.modules():
            forget(sub)

    def clear(self) -> None:
        """Forget the inputs and backprops kept for the current step. A call no backward pass
        has reached yet is kept through one ``clear`` (``optimizer.zero_grad()`` between a
        forward and its backward pass), and forgotten at the next. The independence check's
        rerun, if pending, is made here, once the kept tensors are released (before the
        private optimizer or :func:`dpcore_torch.step.private_grads` releases anything)."""
        waiting = set()
        for unit in self.units:
            calls, unit.calls[:] = list(unit.calls), []
            for call in calls:
                if call.reached_at is None and id(call) not in self._waiting:
                    unit.calls.append(call)
                    waiting.add(id(call))
                else:
                    call.release()
        self._waiting = waiting
        kept = [call.born for unit in self.units for call in unit.calls if call.born is not None]
        self._model_calls = [c for c in self._model_calls if kept and c[1] > min(kept)]
        # the start of the pass of the earliest kept call, and later ones
        self._passes = self._passes[max(0, bisect.bisect_right(
            self._passes, min(kept)) - 1):] if kept else []
        self._leaked.clear()
        self._summed.clear()
        if self._probe is not None:
            self._probe.rerun_if_pending(self.module)

    def check_pending(self) -> bool:
        """Whether the model is yet to be checked to keep the examples apart: the check waits
        for a pass with two distinct examples or more (an empty Poisson sample does not do)."""
        return self._probe is not None and self._probe.state != "done" and not self._probe.checked

    def _probe_start(self, module, args, kwargs) -> None:
        """The check's root forward pre-hook, but while a compiled step is traced (fake
        tensors: no values to compare; the eager steps made the check)."""
        if not tracing():
            self._probe.start(module, args, kwargs)

    # ------------------------------------------------------------------ per-step results
    @property
    def leaf_sizes(self) -> dict[str, int]:
        return {name: p.numel() for name, p in self.params.items()}

    def _contributions(self) -> tuple[dict[str, list], int]:
        if self._leaked:
            where = ("the model's forward" if self.mode == "vmap" else
                     "the call of the module that owns it")
            fix = "" if self.mode == "vmap" else ", or make_private(..., mode='vmap')"
            raise LeakedGradientError(
                f"parameters {sorted(self._leaked)} received gradients from a use dpcore could "
                f"not see per example, outside {where} (e.g. F.linear(h, layer.weight), or a "
                f"penalty on the parameters added to the loss). Use the weight only through "
                f"modules (tie weights by assigning the same Parameter to two modules), and "
                f"regularise through the optimizer (weight_decay){fix}")
        contributions: dict[str, list] = {leaf: [] for leaf in self.params}
        sizes, unreached = set(), set()
        reached = [(unit, call) for unit in self.units for call in unit.calls if call.reached]
        first = min((call.reached_at for _, call in reached), default=None)
        for unit, call in reached:
            if call.born is not None and call.born > first:  # made after a backward pass
                raise _accumulation_error(unit)
        self._check_one_forward(reached)
        for unit, call in reached:
            sizes.add(call.batch_size)
            for key, leaf in unit.names.items():
                contributions[leaf].append((unit, call, key))
        for unit in self.units:  # outputs unused by the loss: contribute zero
            unreached.update(call.batch_size for call in unit.calls if not call.reached)
        sizes = sizes or unreached  # nothing reached: all per-example gradients are zero
        if len(sizes) > 1:
            raise ValueError(f"the layers saw batches of different sizes {sorted(sizes)} in one "
                             f"step; dpcore needs every layer's input to have the examples on "
                             f"axis 0 (batch_first=True; an nn.EmbeddingBag takes a padded "
                             f"(B, T) tensor with padding_idx, not 1-D tokens with offsets; a "
                             f"model that folds several rows per example into the batch, "
                             f"x.flatten(0, 1), needs mode='vmap')")
        return contributions, (sizes.pop() if sizes else 0)

    def _check_one_forward(self, reached) -> None:
        """Refuse a step whose calls were made in several forward passes of the model and
        reached by several backward passes: ``la = loss(model(a)); lb = loss(model(b));
        la.backward(); lb.backward()`` would pair row i of ``a`` with row i of ``b`` and clip
        the two records as one. (Several forward passes back-propagated together stay the
        caller's statement that their rows are the same examples, e.g. two views of each;
        several backward passes through one forward, one per loss term, add up.)"""
        made = [(call, unit) for unit, call in reached if call.born is not None]
        if len({call.backward for call, _ in made}) < 2:
            return
        passes = {bisect.bisect_right(self._passes, call.born) for call, _ in made}
        if len(passes) > 1:
            raise AccumulationError(
                f"{type(made[0][1].module).__name__} and the other layers were called in "
                f"{len(passes)} forward passes of the model and back-propagated by separate "
                f"backward passes in one step (la = loss(model(a)); lb = loss(model(b)); "
                f"la.backward(); lb.backward()): dpcore would clip row i of every batch as "
                f"one example. For a Poisson sample split into micro-batches, run each "
                f"micro-batch's forward and backward pass and call optimizer.accumulate() "
                f"(in a custom loop: dpcore_torch.step.clip_into) after each; for two views "
                f"of the same examples, back-propagate the summed loss once")

    def _scale(self, batch: int) -> float:
        return float(batch) if self.loss_reduction == "mean" and batch > 0 else 1.0

    @staticmethod
    def _grad(unit, call, key, cached=True):
        if isinstance(unit, FallbackUnit):
            return unit.grads(call)[key]  # one vmap gives all of the call's parameters
        if cached:
            return unit.rule.cached_grad(unit.module, call, key)
        return unit.rule.grad(unit.module, call, key)

    def _summed_grad(self, leaf, uses):
        """The per-example gradient of ``leaf``: one use's (cached in the use), or the sum over
        several uses (formed once per step and kept here, not per use: a cell called at every
        step of a sequence would otherwise keep T per-example gradients)."""
        if len(uses) == 1:
            return self._grad(*uses[0])
        if leaf not in self._summed:
            total = self._grad(*uses[0], cached=False) + self._grad(*uses[1], cached=False)
            for use in uses[2:]:
                total.add_(self._grad(*use, cached=False))
            self._summed[leaf] = total
        return self._summed[leaf]

    def batch_size(self) -> int:
        return self._contributions()[1]

    @full_precision()
    def per_example_grads(self) -> dict[str, torch.Tensor]:
        """Materialised per-example gradients {leaf: (B, *shape)} of the current step."""
        contributions, batch = self._contributions()
        scale = self._scale(batch)
        out = {}
        for leaf, uses in contributions.items():
            p = self.params[leaf]
            out[leaf] = (self._summed_grad(leaf, uses) * scale if uses
                         else p.new_zeros((batch, *p.shape)))
        return out

    @full_precision()
    def sq_norms(self, leaves: Sequence[str]):
        """Squared per-example norms (B, L), columns in ``leaves`` order. Norms and clipped
        sums form their products at full precision (:func:`.layers.full_precision`): products
        whose inputs were rounded to TensorFloat-32 or bfloat16 would let a record's clipped
        contribution exceed its clip (by 2^-10 or 2^-7 of it, more where its terms cancel)."""
        contributions, batch = self._contributions()
        if self._model_calls:  # once per step: the norms come before any clipped sum
            for unit, call in {id(c): (u, c) for uses in contributions.values()
                               for u, c, _ in uses}.values():
                self._check_rows(unit, call)
        cols = []
        for leaf in leaves:
            uses = contributions[leaf]
            p = self.params[leaf]
            if not uses:
                cols.append(torch.zeros(batch, dtype=p.dtype, device=p.device))
            elif len(uses) == 1 and isinstance(uses[0][0], _RuleUnit):
                unit, call, key = uses[0]
                cols.append(unit.rule.sq_norm(unit.module, call, key, self.prefer))
            else:
                cols.append(row_sq_norms(self._summed_grad(leaf, uses)))
        if not cols:
            raise ValueError("no leaves given")
        norms = torch.stack(cols, dim=1)
        scale = self._scale(batch)
        return norms * (scale * scale) if scale != 1.0 else norms

    def keep_records(self, keep) -> None:
        """Zero the kept inputs, backprops and per-example gradients of the examples where
        ``keep`` (B,) is False (records dropped for a non-finite norm), so their NaN or Inf
        cannot reach the clipped sums as 0 * NaN."""
        for unit in self.units:
            for call in unit.calls:
                call.keep_rows(keep)
        self._summed = {leaf: keep_rows(g, keep) for leaf, g in self._summed.items()}

    def clipped_sums(self, factors, groups: Mapping[str, int]) -> dict[str, torch.Tensor]:
        """sum_i factors[i, groups[leaf]] * grad_i for every leaf: the book-keeping sums
        (:meth:`add_clipped_sums` into zeros)."""
        out = {leaf: torch.zeros_like(self.params[leaf]) for leaf in groups}
        self.add_clipped_sums(factors, groups, out)
        return out

    @full_precision()
    def add_clipped_sums(self, factors, groups: Mapping[str, int], out: Mapping) -> None:
        """``out[leaf] += sum_i factors[i, groups[leaf]] * grad_i`` in place for every leaf
        used in the step (an unused leaf's ``out`` is not touched: its sum is zero); ``out``
        is typically the step's noise (:class:`dpcore.noise.NoiseDraws`, drawn on access).

        This consumes the step: each layer call's kept input and backprop are released as
        soon as the sums of all its parameters are formed, so memory falls as sums grow."""
        contributions, batch = self._contributions()
        scale = self._scale(batch)
        pending: dict = {}  # call -> parameters still to sum (calls hash by identity)
        for leaf in groups:
            for _, call, _ in contributions[leaf]:
                pending[call] = pending.get(call, 0) + 1
        weights = {}
        # smallest parameters first: their layers' inputs and backprops are released before
        # the largest sums (an embedding's) are formed
        for leaf in [leaf for leaf in self._by_size if leaf in groups]:
            uses = contributions[leaf]
            if not uses:
                continue
            column = groups[leaf]
            if column not in weights:  # one tensor per group, so rules can share work
                weights[column] = factors[:, column] * scale if scale != 1.0 else \
                    factors[:, column]
            c = weights[column]
            if len(uses) == 1 and isinstance(uses[0][0], _RuleUnit):
                unit, call, key = uses[0]
                unit.rule.add_weighted_sum(unit.module, call, key, c, out[leaf])
            else:
                add_contraction(out[leaf], c, self._summed_grad(leaf, uses))
                self._summed.pop(leaf, None)
            for _, call, _ in uses:  # release a call once all its parameters are summed
                pending[call] -= 1
                if not pending[call]:
                    call.release()

    def __repr__(self) -> str:
        kinds = [type(u.module).__name__ + ("" if isinstance(u, _RuleUnit) else "(vmap)")
                 for u in self.units]
        return f"PerExampleEngine(mode={self.mode!r}, units={kinds})"
