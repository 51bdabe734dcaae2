"""The compiled private step: the per-example engine's whole step, traced once per padded batch
shape into one graph of ATen operations and compiled by TorchInductor.

Eagerly, a small model's DP step is dominated by per-operation overhead, not arithmetic: the
covertype MLP's norms, clip factors, clipped sums and noise are some 40 operations of 6-9 us
each beside a 0.6 ms step (docs/benchmarks-history.md). Compiled, they fuse into a few loops
around the same matrix products as the non-private step. One step:

1. host: the batch is padded to its bucket (:class:`dpcore.sampling.Buckets`, about 17 shapes
   over a run) with ``mask`` marking the real rows; ``aggregator.begin_step()`` writes the
   sampling event (and applies a budget); the step's clips S_g and leaf noise stds
   alpha_j sigma~_g are read from the mechanism in force; N(0, 1) normals, one per parameter
   value, are drawn from the aggregator's generator (the backend's ``torch.Generator``, or the
   system's CSPRNG with ``secure=True``), afresh every step;
2. graph: the model's forward (through :class:`~dpcore_torch.engine.PerExampleEngine`, whose
   layer rules and fallbacks are used unchanged) on the parameters as inputs
   (``torch.func.functional_call``), the backward pass of sum_i mask_i loss_i, squared norms,
   clip factors (padded and non-finite rows: 0, their kept tensors zeroed), the clipped sums
   added into alpha_j sigma~_g times the normals, the division by q n;
3. host: under ``on_nonfinite="raise"`` a real record with a NaN or Inf norm raises and
   nothing is released; otherwise the step's sum-query events are written and the private
   average gradient becomes every parameter's ``.grad``.

Tracing (``make_fx`` on fake tensors) records tensor operations only, so what cannot be a
fixed graph fails at tracing, naming the cause, rather than freezing one batch's values into
the program: a Python branch on a tensor's value, a tensor the model holds that is neither a
parameter nor a buffer, a rule whose shapes depend on the data. Checks the engine makes on
Python objects (parameters used outside their layer, several backward passes, rows folded
into the batch) run at tracing; they depend on the model and the shapes only. The first two
steps, and any later ones until the model has been checked to keep the examples apart
(:mod:`dpcore_torch.independence`; it waits for two distinct records), run the same function
eagerly, with the checks the engine makes on values (that one, and that a fallback module's
replay of each example gives its output in the batch). Later steps, compiled, do not repeat
them. Convolutions take the form the eager steps timed faster. A program is traced, before
its step begins, per bucket, training modes and autocast state (both are traced into it);
under autocast the norms, clip factors and sums are formed with it off, at tracing, in
Inductor's compilation (whose decompositions would otherwise take it) and at run time.

The program runs with float32 matrix products at full precision throughout (the eager engine
asks it for its norms and sums only): its graph does not separate the model's products from
the norms'.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch._inductor  # compile: Inductor on a traced graph, without dynamo
from array_api_compat import torch as xp
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from dpcore.aggregation import (NonFiniteNormError, clip_factors, clips_of, group_norms,
                                leaf_stds_of, structure)
from dpcore.sampling import Buckets

from .backend import TorchBackend
from .engine import LeakedGradientError, PerExampleEngine
from .layers import autocast_off, full_precision, traced
from .snapshot import autocast_state

EAGER_STEPS = 2  # steps run eagerly first: the engine's checks of values, and its timings


class _Step(nn.Module):
    """The traced function as a module with the model as its child, so that
    ``torch.func.functional_call`` swaps the parameters and buffers in for the whole step
    (the rules read ``module.weight`` while they form norms and sums, after the forward)."""

    def __init__(self, model: nn.Module, engine: PerExampleEngine, loss_fn: Callable,
                 mechanism, expected_size: float):
        super().__init__()
        self.model = model
        # not submodules or state of this module: plain attributes
        self.__dict__.update(engine=engine, loss_fn=loss_fn, mechanism=mechanism,
                             expected_size=expected_size)

    def forward(self, leaves, inputs, target, mask, normals, clips, stds):
        engine, mechanism = self.engine, self.mechanism
        order = list(engine.params)
        with torch.enable_grad():
            losses = self.loss_fn(self.model(*inputs), target)
            if tuple(losses.shape) != tuple(mask.shape):
                raise ValueError(
                    f"loss_fn must return one loss per example, shape ({mask.shape[0]},), got "
                    f"{tuple(losses.shape)}: pass an unreduced loss (reduction='none')")
            torch.where(mask, losses, 0).sum().backward()
        leaked = sorted(name for name, p in leaves.items() if p.grad is not None)
        if leaked:
            raise LeakedGradientError(
                f"parameters {leaked} received gradients from a use outside the call of the "
                f"module that owns it (e.g. F.linear(h, layer.weight), or a penalty on the "
                f"parameters in the loss), which dpcore cannot see per example. Use the weight "
                f"only through modules (tie weights by assigning the same Parameter to two "
                f"modules) and regularise through the optimizer (weight_decay)")
        with torch.no_grad(), autocast_off():  # the forward may run under autocast; not these
            sq_norms = engine.sq_norms(mechanism.leaves)
            norms = group_norms(sq_norms, mechanism, mechanism.leaves, xp=xp)
            finite = torch.isfinite(norms).all(1)
            factors = clip_factors(norms, clips, mask=mask, on_nonfinite="drop", xp=xp)
            # padded rows, and records dropped for a NaN or Inf, must not reach the sums as
            # 0 * NaN: their kept inputs and backprops are zeroed
            engine.keep_records(finite & mask)
            pieces = normals.split([engine.params[leaf].numel() for leaf in order])
            sums = {leaf: (piece * stds[j]).view(engine.params[leaf].shape)
                    for j, (leaf, piece) in enumerate(zip(order, pieces))}
            engine.add_clipped_sums(factors, mechanism.group_index, sums)
            engine.clear()
            means = {leaf: sums[leaf] / self.expected_size for leaf in order}
            bad = mask & ~finite
        return means, bad, bad.any()


def _as_tuple(x) -> tuple:
    """A tensor, or a tuple or list of tensors, as a tuple of tensors."""
    items = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    if not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in items):
        raise TypeError(f"inputs and target must be tensors (or tuples of tensors) with the "
                        f"examples on axis 0, got {[type(t).__name__ for t in items]}")
    return items


def _rows(tensors) -> int:
    sizes = {t.shape[0] for t in tensors}
    if len(sizes) != 1:
        raise ValueError(f"every tensor of the batch needs the examples on axis 0, with one "
                         f"size; got sizes {sorted(sizes)}")
    return sizes.pop()


def _pad(t, size: int):
    """``t`` with zero rows appended up to ``size`` rows, contiguous (the program's inputs
    have the strides it was traced with)."""
    if t.shape[0] == size:
        return t.contiguous()
    return torch.cat([t, t.new_zeros((size - t.shape[0], *t.shape[1:]))])


def _untraceable(*, size: int, error: Exception) -> RuntimeError:
    return RuntimeError(
        f"the private step could not be traced into a graph for batches of "
        f"{size} rows: {type(error).__name__}: {error}. Tracing needs the model's "
        f"tensor operations to be the same for every batch of one shape (no branch on a "
        f"tensor's value; every tensor it reads a parameter, buffer or input). Run this model "
        f"with make_private or private_grads (eager)")


class CompiledPrivateStep:
    """``step(inputs, target)``: one DP step of ``model`` on a Poisson sample, compiled.

    ``loss_fn(model(*inputs), target)`` must return one loss per example, shape (B,)
    (``nn.CrossEntropyLoss(reduction="none")``); ``inputs`` is a tensor or a tuple of the
    model's positional tensors, ``target`` a tensor or a tuple of tensors, all with the
    examples on axis 0. ``aggregator`` is a :class:`dpcore.PrivateAggregator` on the torch
    backend whose mechanism names the model's trainable parameters; its ``sampler`` draws the
    samples (``poisson_loader(dataset, q, sampler=aggregator.sampler)``). Each call is one step:
    it writes the sampling event, draws the noise, runs the program of the batch's bucket
    (``buckets``, by default :class:`dpcore.sampling.Buckets` of the aggregator's q n and q),
    writes the sum-query events and sets every parameter's ``.grad`` to the private average
    gradient, which it also returns ({parameter name: tensor}); then call
    ``optimizer.step()``. ``prefer`` is the engine's (ghost norms or materialised gradients),
    ``check_independence`` its check that the model keeps the examples apart, made on the
    first steps, which run eagerly. The model's parameters must stay the objects they were,
    frozen or not as they were (their values may change in place). The model stays
    instrumented until :meth:`detach`.

    Clip schedules are served (clips and noise stds are inputs of the program); adaptive
    clipping, whose counts are released beside the gradient, is not (use
    :func:`dpcore_torch.private_grads`).
    """

    def __init__(self, model: nn.Module, loss_fn: Callable, aggregator, *,
                 buckets: Buckets | None = None, prefer: str = "memory",
                 check_independence: bool = True):
        if not isinstance(aggregator.backend, TorchBackend):
            raise TypeError(f"the aggregator's backend must be the torch backend, got "
                            f"{aggregator.backend!r}; create it with backend='torch'")
        if aggregator.count_groups:
            raise ValueError("the aggregator releases adaptive clipping's counts beside the "
                             "gradient; the compiled step releases the gradient only: use "
                             "dpcore_torch.private_grads, or a ClipSchedule")
        self.engine = PerExampleEngine(model, loss_reduction="sum", prefer=prefer,
                                       check_independence=check_independence)
        try:
            self._check_params(aggregator)
        except BaseException:
            self.engine.detach()
            raise
        self.model, self.aggregator = model, aggregator
        self.buckets = buckets or Buckets(aggregator.expected_size, aggregator.q)
        self._structure = structure(aggregator.mechanism)
        self._step = _Step(model, self.engine, loss_fn, aggregator.mechanism,
                           aggregator.expected_size)
        self._eager = EAGER_STEPS
        self._values = sum(p.numel() for p in self.engine.params.values())  # normals a step
        frozen = {name: p for name, p in model.named_parameters() if not p.requires_grad}
        self._frozen_names = tuple(frozen)
        # (name, owner module, attribute, parameter) of every parameter, trainable ones first
        self._owners = [(name, model.get_submodule(name.rpartition(".")[0]),
                         name.rpartition(".")[2], p)
                        for name, p in (*self.engine.params.items(), *frozen.items())]
        self._modules = list(model.modules())  # their training modes key the programs
        self._buffer_names = tuple(name for name, _ in model.named_buffers())
        self._positions: dict[int, torch.Tensor] = {}  # arange(size) per bucket, for masks
        self._programs: dict[tuple, Callable] = {}
        self._inputs = (None, None)  # (mechanism, (clips, stds) tensors) of the last step

    def _check_params(self, aggregator) -> None:
        aggregator.mechanism.check_leaves(self.engine.params)
        kinds = {(p.dtype, p.device) for p in self.engine.params.values()}
        if len(kinds) > 1:
            raise ValueError(f"the compiled step draws one noise vector for all parameters, "
                             f"which must share a dtype and device; got {sorted(map(str, kinds))}")

    def __call__(self, inputs, target) -> dict[str, torch.Tensor]:
        inputs = _as_tuple(inputs)
        single = isinstance(target, torch.Tensor)  # else a tuple of tensors
        targets = (target,) if single else _as_tuple(target)
        rows = _rows([*inputs, *targets])
        size = self.buckets.size_for(rows)
        batch = [_pad(t, size) for t in (*inputs, *targets)]
        params, frozen = self._parameters()
        like = params[0]
        positions = self._positions.get(size)
        if positions is None:
            positions = self._positions[size] = torch.arange(size, device=like.device)
        agg = self.aggregator
        self.engine.clear()  # calls of forward passes with gradients since the last step
        layout = (len(inputs), single)
        # parameters, buffers, batch, mask, then the step's normals, clips and stds
        flat = [*params, *frozen, *self._buffers(), *batch, positions < rows]
        eager = self._eager > 0 or self.engine.check_pending()
        if not eager:  # traced (from the shapes) before the step begins: a model that
            # cannot be traced fails with no event written
            program = self._program(layout, batch, flat + [like.new_empty(self._values),
                                                           *self._clips_and_stds()])
        agg.begin_step()
        clips, stds = self._clips_and_stds()
        agg.rng, normals = agg.standard_normal(agg.rng, (self._values,), like)
        flat += [normals, clips, stds]
        with full_precision():
            if eager:
                out = self._run(layout, *flat)
                self._eager = max(self._eager - 1, 0)
            else:
                with autocast_off():  # the trace holds autocast's casts; at run time it
                    out = program(*flat)  # would round the norms' and sums' products too
        means, bad, any_bad = dict(zip(self.engine.params, out)), out[-2], out[-1]
        if agg.on_nonfinite == "raise" and bool(any_bad):
            bad_rows = torch.nonzero(bad).flatten().tolist()
            raise NonFiniteNormError(
                f"records {bad_rows[:10]}{' ...' if len(bad_rows) > 10 else ''} of this batch "
                f"have a NaN or infinite gradient norm; nothing was released. Fix the model "
                f"or loss, or create the aggregator with on_nonfinite='drop'")
        agg.record_release()
        for name, p in self.engine.params.items():
            p.grad = means[name]
        return means

    def _parameters(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The model's trainable and frozen parameters, as the step was built for them: a
        parameter replaced by another object, frozen or unfrozen since then is refused (the
        step would go on reading the old one, or noise a parameter no optimizer moves)."""
        trainable = len(self.engine.params)
        moved = [name for name, module, attr, p in self._owners
                 if module._parameters.get(attr) is not p]
        switched = [name for k, (name, _, _, p) in enumerate(self._owners)
                    if p.requires_grad != (k < trainable)]
        if moved or switched:
            raise ValueError(
                "the model's parameters changed since this step was built: "
                + "; ".join([f"{moved} replaced by other objects"] * bool(moved)
                            + [f"{switched} frozen or unfrozen"] * bool(switched))
                + ". Change their values in place (copy_, load_state_dict) or build a new "
                  "CompiledPrivateStep and optimizer")
        return ([p.detach() for *_, p in self._owners[:trainable]],
                [p.detach() for *_, p in self._owners[trainable:]])

    def _buffers(self) -> list[torch.Tensor]:
        """The model's buffers (inputs of the program, so it reads their current values)."""
        if not self._buffer_names:
            return []
        names, values = zip(*self.model.named_buffers())
        if names != self._buffer_names:
            raise ValueError(f"the model's buffers changed since this step was built, from "
                             f"{list(self._buffer_names)} to {list(names)}; build a new "
                             f"CompiledPrivateStep")
        return list(values)

    def _clips_and_stds(self):
        """The step's clips S_g (G,) and leaf stds (L,) as tensors, remade when the
        mechanism moves (a clip schedule); its groups, leaves and scales must not."""
        mechanism = self.aggregator.mechanism
        if mechanism is not self._inputs[0]:
            if structure(mechanism) != self._structure:
                raise ValueError("the aggregator's groups changed since this step was built; "
                                 "build a new CompiledPrivateStep")
            like = next(iter(self.engine.params.values()))
            self._inputs = (mechanism, tuple(
                torch.tensor(values, dtype=like.dtype, device=like.device) for values in
                (clips_of(mechanism), leaf_stds_of(mechanism, list(self.engine.params)))))
        return self._inputs[1]

    def _run(self, layout: tuple[int, bool], *flat) -> tuple:
        """The step as a function of a flat list of tensors to a flat tuple (what is traced):
        parameters, buffers, the batch's ``layout[0]`` inputs and its target (one tensor if
        ``layout[1]``, else a tuple), mask, normals, clips, stds in; the mean gradient leaf
        by leaf, the rows with non-finite norms and whether there is one out."""
        names, buffer_names = list(self.engine.params), self._buffer_names
        params, flat = flat[:len(names)], flat[len(names):]
        frozen, flat = flat[:len(self._frozen_names)], flat[len(self._frozen_names):]
        buffers, flat = flat[:len(buffer_names)], flat[len(buffer_names):]
        (inputs, targets), (mask, normals, clips, stds) = (
            (flat[:layout[0]], flat[layout[0]:-4]), flat[-4:])
        leaves = {name: p.detach().requires_grad_() for name, p in zip(names, params)}
        state = {**{f"model.{k}": v for k, v in leaves.items()},
                 **{f"model.{k}": v for k, v in zip(self._frozen_names, frozen)},
                 **{f"model.{k}": v for k, v in zip(buffer_names, buffers)}}
        means, bad, any_bad = torch.func.functional_call(
            self._step, state, (leaves, tuple(inputs), targets[0] if layout[1] else
                                tuple(targets), mask, normals, clips, stds))
        return (*means.values(), bad, any_bad)

    def _program(self, layout, batch, flat) -> Callable:
        """The compiled program for the layout, shapes and dtypes of the padded ``batch``
        (everything else keeps its shapes), the modules' training modes and the autocast in
        force (both are traced into the program), traced and compiled on first use. Inductor
        compiles the traced graph directly (``torch._inductor.compile``): through
        ``torch.compile`` each call would pass dynamo's guards and pytree flattening, 0.1 ms
        of the covertype MLP's 0.9 ms step on one core."""
        key = (layout, *((tuple(t.shape), t.dtype) for t in batch),
               tuple(m.training for m in self._modules), autocast_state())
        program = self._programs.get(key)
        if program is None:
            try:
                with traced(), full_precision():
                    graph = make_fx(lambda *a: self._run(layout, *a), tracing_mode="fake")(*flat)
            except Exception as error:
                if type(error).__module__.startswith("dpcore") or type(error) is ValueError:
                    raise  # dpcore's own refusals (a leaked gradient, mixed rows, ...)
                raise _untraceable(size=batch[0].shape[0], error=error) from error
            with autocast_off(), full_precision():  # the graph holds the forward's casts;
                # Inductor's own decompositions of the sums' products must not be autocast
                program = self._programs[key] = torch._inductor.compile(graph, flat)
        return program

    def compiled_shapes(self) -> int:
        """How many programs have been traced and compiled (one per bucket and dtypes)."""
        return len(self._programs)

    def detach(self) -> None:
        """Restore the model's own forward methods (the engine's :meth:`detach`)."""
        self.engine.detach()
