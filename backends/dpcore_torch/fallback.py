"""Per-example gradients of any module by ``torch.func``, from the inputs and output backprops
kept from the one ordinary backward pass.

For a module f with parameters theta, inputs x_i and output backprop g_i = dL/df(x_i) of
example i, the chain rule gives the per-example gradient

    grad_i = d/d theta <f(x_i; theta), g_i>,

which ``vmap(grad(.))`` evaluates for all i by re-running f on one example at a time (as a batch
of one), with the random draws of the forward pass (:mod:`dpcore_torch.draws`). This is the
fallback for layers without a rule in :mod:`dpcore_torch.layers`, and with the whole model as
f it is the ``mode="vmap"`` engine; a module whose own parameters are used only by
broadcasting operations skips the replay (:mod:`dpcore_torch.taps`). Positional tensors must
have the examples on axis 0 (0-d ones, e.g. a time step, are shared); keyword arguments are
passed unchanged to every example (e.g. an attention mask shared by all), except PyTorch's
per-example padding masks (``key_padding_mask``, ``src_key_padding_mask``, ...), which are
split like positional tensors.
Each replayed output must be a batch of one: an output with more rows would make example i's
"gradient" depend on the other examples (a per-example tensor passed by keyword), and is
refused.
"""

from __future__ import annotations

import threading
import warnings
from contextlib import contextmanager, nullcontext
from functools import partial

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from .call_buffers import CallBuffers
from .draws import Recording, Replayer, ReplayMismatchError, alias, share, unobserved
from .independence import NotPerExampleError, probing
from .instrumentation import instrumentation
from .layers import birth, cast_to, keep_rows, late_backward, parameter, reach, tracing
from .rows import Rows
from .taps import Kept, Taps

_state = threading.local()


def replaying() -> bool:
    """True while a fallback re-runs a module per example: instrumented layers inside it must
    run their plain forward and record nothing."""
    return getattr(_state, "replaying", False)


def recording() -> bool:
    """Whether a layer call is to be recorded: gradients are on and no fallback is
    replaying."""
    return not replaying() and torch.is_grad_enabled()


@contextmanager
def _replay():
    previous = replaying()
    _state.replaying = True
    try:
        yield
    finally:
        _state.replaying = previous


class Call:
    """One call of a fallback module: positional args, keyword args, the random draws made in
    it (:mod:`dpcore_torch.draws`) and where it lost track of its rows (:mod:`dpcore_torch.
    rows`; ``draws`` is the pair), the buffers it changed as they were before it, those it
    changed that were not kept, and as it left them (:mod:`dpcore_torch.call_buffers`;
    ``buffers`` is the triple),
    its taps, and the backprops of its floating-point tensor outputs (None until the backward
    pass reaches them)."""

    __slots__ = ("args", "kwargs", "draws", "lost", "start", "unkept", "end", "taps",
                 "outputs", "g", "cache", "born", "reached_at", "backward")

    def __init__(self, args, kwargs, draws, buffers, taps, n_outputs):
        (self.draws, self.lost), self.args, self.kwargs, self.taps = draws, args, kwargs, taps
        self.start, self.unkept, self.end = buffers
        self.outputs = [None] * n_outputs  # copies of the outputs, checked by the replay
        self.g = [None] * n_outputs
        self.cache = None
        self.born, self.reached_at, self.backward = birth(), None, None

    def release(self) -> None:
        """Drop the tensors (output hooks may still hold this object)."""
        self.args, self.kwargs, self.draws, self.g, self.cache = (), {}, [], [], None
        self.start = self.end = {}
        self.taps, self.outputs = None, []

    def keep_rows(self, keep) -> None:
        """Zero the rows of the examples where ``keep`` (B,) is False (see
        :meth:`dpcore_torch.layers.Use.keep_rows`)."""
        self.args = tuple(keep_rows(a, keep) if _batched(a) else a for a in self.args)
        self.g = [keep_rows(g, keep) for g in self.g]
        if self.cache is not None:
            self.cache = {k: keep_rows(t, keep) for k, t in self.cache.items()}
        if self.taps is not None:  # the replay forms the rest, without the dropped rows
            self.taps.complete = False

    @property
    def batch_size(self) -> int:
        return next(a.shape[0] for a in self.args if _batched(a))

    @property
    def reached(self) -> bool:
        """Whether the backward pass reached any output (else the call contributes zero)."""
        return any(g is not None for g in self.g)


def _ignore(g) -> None:
    """Where an untapped unit's parameters send the gradient they receive."""


def _batched(a) -> bool:
    """Whether positional argument ``a`` carries the examples (on axis 0)."""
    return isinstance(a, torch.Tensor) and a.dim() > 0


def _per_example_keywords(kwargs, b: int) -> list[str]:
    """The keyword arguments split per example: PyTorch's padding masks (B, S)."""
    return [k for k, v in kwargs.items() if k.endswith("key_padding_mask")
            and isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == b]


def _is_float(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _float_tensors(out):
    return [t for t in tree_flatten(out)[0] if _is_float(t)]


class _Stop(torch.autograd.Function):
    """A parameter as its fallback module's call sees it: the gradient stops here (handed to
    ``receive``, which the taps check theirs against), since the unit forms it per example.
    A gradient that reaches the parameter itself comes from a use outside the module, which
    the engine refuses (:class:`LeakedGradientError`). The output shares the parameter's
    storage (not as a view), so that an in-place change of it inside the forward (a
    ``clamp_`` under ``no_grad``) changes the parameter, as without dpcore."""

    @staticmethod
    def forward(ctx, p, receive):
        ctx.receive = receive
        return p.detach()

    @staticmethod
    def backward(ctx, g):
        ctx.receive(g)
        return None, None


class FallbackUnit:
    """A module whose parameters ``names`` (keys relative to the module) get per-example
    gradients through ``torch.func``.

    For its whole call (forward pre-hooks such as weight_norm's, forward, forward hooks:
    everything the replay runs again), the module holds its trainable parameters through
    :class:`_Stop`: its ``_call_impl``, which ``nn.Module.__call__`` looks up on the
    instance (or, for a module compiled with ``module.compile()``, its
    ``_compiled_call_impl``), is wrapped, and the parameters are put back in a ``finally``
    (also on ``KeyboardInterrupt``). A call made inside a call of the same module (a module
    that calls itself) is replayed with the outer one and not recorded on its own. Once
    removed, the wrapper (which a later ``module.compile()`` may have captured) calls the
    module as it is."""

    def __init__(self, module: nn.Module, names: dict[str, str], recurse: bool):
        self.module, self.names = module, names  # key in module -> leaf name
        self.calls: list[Call] = []
        ours = {id(module.get_parameter(k)): k for k in names}
        # every slot holding one of the parameters, by its key (a parameter tied within the
        # unit has several), and the key in ``names`` of its parameter
        self._slots = {f"{prefix}.{attr}" if prefix else attr: (holder, attr, ours[id(p)])
                       for prefix, holder in (module.named_modules() if recurse
                                              else [("", module)])
                       for attr, p in holder._parameters.items()
                       if p is not None and id(p) in ours}
        self._depth, self._removed = 0, False
        self._tapped = not recurse  # a subtree (mode="vmap", a built-in layer) is replayed
        self._compiled = getattr(module, "_compiled_call_impl", None)  # module.compile()
        self._buffers = CallBuffers(module)
        record = instrumentation(module)
        if self._compiled is None:
            module._call_impl = self._call
            record.added.add("_call_impl")
        else:
            module._compiled_call_impl = self._call
            record.added.add("_compiled_call_impl")  # a copy is not compiled (as nn.Module's)

    def remove(self) -> None:
        self._removed = True
        self.module.__dict__.pop("_call_impl", None)
        if self._compiled is not None:
            self.module._compiled_call_impl = self._compiled

    def _plain(self, *args, **kwargs):
        if self._compiled is not None:
            return self._compiled(*args, **kwargs)
        return type(self.module)._call_impl(self.module, *args, **kwargs)

    def _call(self, *args, **kwargs):
        plain = self._plain
        if self._removed or not recording():
            return plain(*args, **kwargs)
        if self._depth:  # a call inside a call: replayed with the outer one, draws included
            self._depth += 1
            try:
                return plain(*args, **kwargs)
            finally:
                self._depth -= 1
        batch = next((a.shape[0] for a in args if _batched(a)), None)
        split = [kwargs[k] for k in _per_example_keywords(kwargs, batch)]
        inputs = [a for a in args if _batched(a)] + split
        # shared: parameters, buffers, tensor attributes, and arguments that cannot be per
        # example (a keyword tensor of B rows may be, and stays unknown: a use loses track)
        rows = Rows(-1 if batch is None else batch, inputs,
                    [*self.module.parameters(), *self.module.buffers(),
                     *(v for m in self.module.modules() for v in vars(m).values()
                       if isinstance(v, torch.Tensor)),  # attributes: caches, tables
                     *(t for t in tree_flatten((args, kwargs))[0]
                       if isinstance(t, torch.Tensor) and all(t is not i for i in inputs)
                       and not (t.dim() and t.shape[0] == batch))])
        taps = Taps(batch, rows) if self._tapped and batch is not None else None
        stops, swapped = {}, []
        for holder, attr, key in self._slots.values():
            p = holder._parameters[attr]
            if p.grad_fn is not None:  # held by another unit's call already (a _Stop's output;
                continue  # a parameter, or its copy in a compiled step's trace, is a leaf)
            if key not in stops:
                stops[key] = _Stop.apply(p, _ignore if taps is None
                                         else partial(taps.receive, key))
                if taps is not None:
                    taps.hold(key, stops[key])
            holder._parameters[attr] = stops[key]
            swapped.append((holder, attr, p))
        rows.share_all(stops.values())
        share(stops.values())  # to the enclosing units' calls too
        self._depth, draws = 1, []
        with unobserved():  # dpcore's copies, not operations of an enclosing unit
            versions, copies = self._buffers.before()
        try:
            with Recording(draws, rows, taps):
                out = plain(*args, **kwargs)
        finally:
            self._depth = 0
            for holder, attr, p in swapped:
                holder._parameters[attr] = p
        with unobserved():
            buffers = self._buffers.after(versions, copies)
        return self._record(args, kwargs, (draws, rows), buffers, taps, out)

    def _record(self, args, kwargs, draws, buffers, taps, out):
        """Keep the call's inputs (as the caller passed them: the replay runs pre-hooks
        again) and hook its outputs (as every forward hook left them) for their backprops."""
        if not any(_batched(a) for a in args):
            raise TypeError(f"{type(self.module).__name__} was called without a positional "
                            f"tensor argument of at least one axis; dpcore's per-example "
                            f"fallback needs the batch as a positional tensor with the "
                            f"examples on axis 0")
        draws, rows = draws
        leaves, spec = tree_flatten(out)
        hidden = [type(leaf).__name__ for leaf in leaves
                  if not isinstance(leaf, (torch.Tensor, int, float, str, type(None)))
                  and any(isinstance(v, torch.Tensor)
                          for v in getattr(leaf, "__dict__", {}).values())]
        if hidden:  # its tensors would get no hook: their backprops would be lost
            raise TypeError(
                f"{type(self.module).__name__} returned a {hidden[0]} holding tensors, which "
                f"dpcore cannot look into to keep their backprops: return tensors, or "
                f"tuples, lists, dicts or named tuples of them")
        floats = [i for i, t in enumerate(leaves) if _is_float(t)]
        rows.require([leaves[i] for i in floats if leaves[i].requires_grad])
        call = Call(tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args),
                    kwargs, (draws, rows.lost), buffers, taps, len(floats))
        copied = False
        with unobserved():  # dpcore's own hooks, not operations of an enclosing unit
            for k, i in enumerate(floats):
                t = leaves[i]
                if not t.requires_grad:
                    continue
                call.outputs[k] = t.detach().clone()  # a replay checks its outputs with these
                if t._is_view():  # an in-place op on a view would rebase it past a hook
                    leaves[i], copied = Kept.apply(t, self._keeper(call, k)), True
                    alias(t, leaves[i])  # for the enclosing units' calls
                else:
                    t.register_hook(self._keeper(call, k))
        self.calls.append(call)
        return tree_unflatten(leaves, spec) if copied else out

    def _check_replay(self, call, deviation, scale) -> None:
        """Refuse a module whose output for example i in the batch is not its output for
        example i alone (batch statistics, a reordering, attention across examples): its
        "per-example" gradients would depend on other examples (the sensitivity unbounded).
        Tolerance: the rounding of the recorded output's precision (autocast), or 1e-4."""
        kept = [t for t in call.outputs if t is not None]
        if not kept:
            return
        tol = max(1e-4, 8 * max(torch.finfo(t.dtype).eps for t in kept))
        floor = 1e-6 * float(scale.max()) if scale.numel() else 0.0
        bad = deviation > tol * torch.clamp(scale, min=floor) + 1e-30
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            if call.unkept:
                raise ValueError(
                    f"{type(self.module).__name__}'s forward pass changed its buffers "
                    f"{self._buffers.names(call.unkept)} in a call although no call before "
                    f"had, so dpcore had not kept them to run the call again one example at a "
                    f"time, and the replay's output for example {i} differs from the call's "
                    f"(by {float(deviation[i]):.3g}, against {float(scale[i]):.3g}). dpcore "
                    f"keeps them from now on; run the step again")
            raise ValueError(
                f"{type(self.module).__name__}'s output for example {i} of the batch differs "
                f"from its output for that example alone (by {float(deviation[i]):.3g}, "
                f"against {float(scale[i]):.3g}): the module mixes the examples of a batch "
                f"(statistics of the batch, a reordering of it, attention across examples), "
                f"so each example's gradient would depend on the others and clipping would "
                f"not bound it. Such a module cannot be trained privately")

    def _check_buffers(self, call, drifts) -> None:
        """Refuse a module whose call leaves a buffer that the replay of one example does not
        leave the same (to 1e-4 of its largest value): the buffer holds a statistic of the
        batch (a running mean of the inputs), which later steps would read without noise.
        Buffers updated from the weights alone (spectral_norm's u and v, a count) pass."""
        if not call.end:
            return
        scale = max(float(t.abs().max()) if t.numel() else 0.0 for t in call.end.values())
        bad = ~(drifts <= 1e-4 * scale + 1e-30)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise NotPerExampleError(
                f"{type(self.module).__name__}'s forward pass leaves its buffers "
                f"{self._buffers.names(call.end)} otherwise than its replay on example {i} "
                f"alone does (by {float(drifts[i]):.3g}, against {scale:.3g}): they hold a "
                f"statistic of the batch (a running mean of the inputs, say), which the "
                f"model keeps and later steps read without noise. Compute it without the "
                f"training records, or keep it out of the trained model")

    @staticmethod
    def _keeper(call, k):
        def keep(g):
            if probing():
                return
            if not call.g:  # released
                raise late_backward()
            call.g[k] = g if call.g[k] is None else call.g[k] + g
            reach(call)
        return keep

    @staticmethod
    def batch_outputs(out):
        """The outputs of a call with the examples on axis 0: all (the replay checks them)."""
        return out

    def grads(self, call: Call) -> dict[str, torch.Tensor]:
        """{key: (B, *shape)} per-example gradients of this call (cached)."""
        if call.cache is not None:
            return call.cache
        params = {k: parameter(self.module, k).detach() for k in self.names}
        # copies: a replay that changes a parameter in place (a clamp, an initialisation
        # from the example) must not change the model's
        copies = {k: p.clone() for k, p in params.items()}
        slots = {slot: copies[key] for slot, (_, _, key) in self._slots.items()}
        b = call.batch_size
        dtype = next(iter(params.values())).dtype
        tapped = None if call.taps is None else call.taps.grads(dtype)
        if tapped is not None:
            call.cache, call.draws = tapped, []  # never replayed
            return call.cache
        if b == 0 or all(g is None for g in call.g):
            call.cache = {k: p.new_zeros((b, *p.shape)) for k, p in params.items()}
            return call.cache
        positions = [i for i, a in enumerate(call.args) if _batched(a)]
        keywords = _per_example_keywords(call.kwargs, b)
        sizes = [call.args[i].shape[0] for i in positions]
        if any(size != b for size in sizes):
            raise ValueError(
                f"{type(self.module).__name__} got positional tensors with different leading "
                f"sizes ({sizes}); dpcore needs the examples on axis 0 of every positional "
                f"input (batch_first=True)")
        module, args, name = self.module, list(call.args), type(self.module).__name__
        # the buffers the call changed, as each example's replay leaves them (a forward hook:
        # functional_call puts the module's own back on return) against as the call left them
        ends, holders, left = list(call.end.items()), self._buffers.holders(), []

        def read(_, __, ___):
            left.append([holders[m]._buffers.get(key) for (m, key), _ in ends])

        def drift(index):
            worst = index.new_zeros((), dtype=dtype)
            for got, (_, want) in zip(left.pop() if left else [], ends):
                if got is None or got.shape != want.shape:
                    return index.new_full((), float("inf"), dtype=dtype)
                worst = torch.maximum(worst, (got.detach().to(dtype) - want.to(dtype)).abs().max())
            return worst

        def inner(p, tensors, split, backprops, index, start):
            full = list(args)
            for i, t in zip(positions, tensors):
                full[i] = t.unsqueeze(0)
            kwargs = {**call.kwargs, **{k: t.unsqueeze(0) for k, t in zip(keywords, split)}}
            draws = Replayer(call.draws, b, index, name, call.lost)
            with _replay(), draws if call.draws else nullcontext():
                out = _float_tensors(functional_call(module, {**p, **start}, tuple(full),
                                                     kwargs, tie_weights=False))
            if call.draws:
                draws.check_done()
            deviation = scale = index.new_zeros((), dtype=dtype)
            for o, g, kept in zip(out, backprops, call.outputs):
                if g is not None and o.shape != (1, *g.shape):
                    raise ValueError(
                        f"{name} replayed on one example gave an output of shape "
                        f"{tuple(o.shape)}, not (1, {', '.join(map(str, g.shape))}): its "
                        f"output for one example depends on other examples' data, e.g. a "
                        f"per-example tensor passed by keyword (shared by every replay). "
                        f"Pass per-example tensors as positional arguments")
                if g is not None and kept is not None:  # the batch's row, as recorded
                    row = kept.index_select(0, index.view(1)).to(dtype)
                    deviation = torch.maximum(deviation, (o.detach() - row).abs().max())
                    scale = torch.maximum(scale, row.abs().max())
            loss = sum((o * g.unsqueeze(0)).sum() for o, g in zip(out, backprops)
                       if g is not None)
            return loss, (deviation, scale, drift(index))

        # replayed in the parameters' precision (inputs and backprops of an autocast forward
        # may be lower), as the layer rules form their gradients
        tensors = [cast_to(call.args[i], dtype) for i in positions]
        split = [call.kwargs[k] for k in keywords]
        backprops = [None if g is None else cast_to(g, dtype) for g in call.g]
        dims = [None if g is None else 0 for g in call.g]
        # the buffers the call changed (spectral_norm's u and v) as they were before it, in
        # copies: the module's stay as the forward pass left them
        start = self._buffers.by_name(call.start)
        hook = module.register_forward_hook(read) if ends else None
        with torch.no_grad(), warnings.catch_warnings():  # the result is data, no graph
            warnings.filterwarnings("ignore", "There is a performance drop")  # expected here
            try:
                by_slot, (deviation, scale, drifts) = vmap(grad(inner, has_aux=True),
                                                   in_dims=(None, 0, 0, dims, 0, None))(
                    slots, tensors, split, backprops, torch.arange(b, device=tensors[0].device),
                    start)
            except ReplayMismatchError:
                raise
            except RuntimeError as error:
                if "being vmapped over but `self` not being vmapped over" in str(error):
                    raise RuntimeError(
                        f"{name} writes values computed from the examples in place into a "
                        f"tensor that is not one per example ({error}). If that tensor is "
                        f"made in the forward pass (torch.zeros(B, ...) filled row by row), "
                        f"make it from the input (x.new_zeros(...)) or build the result out "
                        f"of place (torch.stack). If it is a parameter, buffer or attribute "
                        f"(a data-dependent initialisation such as ActNorm's, a running "
                        f"statistic), the batch's records would reach later steps without "
                        f"noise: initialise from public data instead") from error
                raise RuntimeError(
                    f"torch.func could not form per-example gradients of {name} ({error}). "
                    f"dpcore replays a layer it has no rule for one example at a time under "
                    f"torch.func.vmap, which that layer must support: random operations "
                    f"other than those dpcore keeps for the replay (dropout, attention "
                    f"dropout, rand, randn, bernoulli, uniform_, normal_) and fused kernels "
                    f"(of RNN, GRU and LSTM, which have a rule in mode='auto') do "
                    f"not") from error
            finally:
                if hook is not None:
                    hook.remove()
                left.clear()
        if not tracing():  # value checks; a compiled step's eager steps made them
            self._check_replay(call, deviation, scale)
            self._check_buffers(call, drifts)
        call.cache = dict.fromkeys(self.names, 0)
        for slot, (_, _, key) in self._slots.items():  # a parameter's slots add up
            call.cache[key] = call.cache[key] + by_slot[slot]
        return call.cache
