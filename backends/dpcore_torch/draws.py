"""Random draws in a fallback module's forward pass (dropout, stochastic depth), kept so that
its per-example replay (:mod:`dpcore_torch.fallback`) uses the same ones.

The replay re-runs a module on one example at a time under ``torch.func.vmap``, where a random
operation would draw anew (torch.func refuses it), so example i's gradient would not be the
gradient of the forward pass that was taken. While a fallback unit's call is recorded, a
``TorchFunctionMode`` performs each random operation itself and keeps its draw:

* dropout (``F.dropout``, ``dropout1d/2d/3d``, ``alpha_dropout``, ``feature_alpha_dropout``
  and the ``torch.*dropout`` functions they call) draws z ~ Bernoulli(1 - p) as ATen does on
  the CPU, on a tensor like the input (of shape (N, C, 1, ...) for channel dropout), and
  returns x z / (1 - p), or for alpha dropout (a = (1 - p)^(-1/2) (alpha^2 p + 1)^(-1/2))
  x a z + alpha a (z - 1 + p), the same values as PyTorch under one seed;
* ``F.scaled_dot_product_attention`` with ``dropout_p > 0`` runs as ATen's math kernel,
  dropout on the attention weights drawn as above;
* ``torch.rand``, ``randn``, ``rand_like``, ``randn_like``, ``bernoulli`` and the in-place
  ``bernoulli_``, ``uniform_`` and ``normal_`` draw as they do, and their values are kept;
* ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``'s forward) runs its own code
  with its dropout and attention calls routed to the above, its weights' dropout drawn on
  them as (B, heads, T, S) (the layout it flattens to (B heads, T, S)).

The replay of example i takes, in call order, the draw's row i where the draw has the batch
on axis 0 (its replayed shape is (1, ...) where the recorded one was (B, ...)), and the whole
draw where it is shared by the batch (the replayed shape is the recorded one). Row i is
example i's only while the forward pass keeps each example in its row
(:mod:`dpcore_torch.rows`): a draw of B rows made, or used, after an operation that may move
rows (a sort of the batch, a transpose of axis 0) is refused at the replay, as is a replay
that asks for other draws (another number, function or shape): dpcore raises rather than
guess. An in-place draw on a tensor the replay cannot fill per example (``torch.empty(...)``,
not derived from the batch) is returned by the call; any later use of the tensor itself is
refused, so code that uses the return value (as stochastic depth does) runs as recorded.
"""

from __future__ import annotations

import inspect
import math
from contextlib import contextmanager
import threading
import types
import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .rows import function_name

_ALPHA = 1.7580993408473766  # SELU's alpha * lambda, as in ATen's alpha dropout

# dropout functions: (channel-wise?, alpha?, in place?, name of the probability, of the flag)
_DROPOUTS = {
    F.dropout: (False, False, None, "p", "training"),
    F.alpha_dropout: (False, True, None, "p", "training"),
    F.dropout1d: (True, False, None, "p", "training"),
    F.dropout2d: (True, False, None, "p", "training"),
    F.dropout3d: (True, False, None, "p", "training"),
    F.feature_alpha_dropout: (True, True, None, "p", "training"),
    torch.dropout: (False, False, False, "p", "train"),
    torch.dropout_: (False, False, True, "p", "train"),
    torch.alpha_dropout: (False, True, False, "p", "train"),
    torch.alpha_dropout_: (False, True, True, "p", "train"),
    torch.feature_dropout: (True, False, False, "p", "train"),
    torch.feature_dropout_: (True, False, True, "p", "train"),
    torch.feature_alpha_dropout: (True, True, False, "p", "train"),
    torch.feature_alpha_dropout_: (True, True, True, "p", "train"),
}
_DEFAULT_TRAINING = {F.dropout: True, F.dropout1d: True, F.dropout2d: True, F.dropout3d: True,
                     F.alpha_dropout: False, F.feature_alpha_dropout: False}
# draws kept as values: the function's result is the draw (in place: on its first argument)
_IN_PLACE = (torch.Tensor.bernoulli_, torch.Tensor.uniform_, torch.Tensor.normal_)
_VALUES = (torch.rand, torch.randn, torch.rand_like, torch.randn_like, torch.bernoulli,
           torch.Tensor.bernoulli) + _IN_PLACE

_MHA = F.multi_head_attention_forward
_MHA_NAMES = list(inspect.signature(_MHA).parameters)

_state = threading.local()


class ReplayMismatchError(RuntimeError):
    """A fallback module's replay asked for other random draws than its recorded call."""


def _dropout_arguments(func, args, kwargs):
    """(x, p, training, inplace) of a call of a dropout function."""
    _, _, inplace, p_name, flag_name = _DROPOUTS[func]
    names = ("input", p_name, flag_name, "inplace")
    values = dict(zip(names, args)) | kwargs
    if inplace is None:
        inplace = values.get("inplace", False)
    training = values.get(flag_name, _DEFAULT_TRAINING.get(func, True))
    return values["input"], values.get(p_name, 0.5), training, inplace


def _noise_shape(func, x) -> tuple:
    """The shape ATen draws dropout noise in: the input's, or (N, C, 1, ...) channel-wise
    (an unbatched input of dropout1d or dropout3d: (C, 1, ...))."""
    if not _DROPOUTS[func][0]:
        return tuple(x.shape)
    if (func is F.dropout1d and x.dim() == 2) or (func is F.dropout3d and x.dim() == 4):
        return (x.shape[0],) + (1,) * (x.dim() - 1)
    return tuple(x.shape[:2]) + (1,) * (x.dim() - 2)


def _apply_dropout(func, x, z, p, inplace):
    """x masked by Bernoulli noise z (0 or 1, in x's dtype) as ATen's dropout applies it."""
    if _DROPOUTS[func][1]:
        a = 1.0 / math.sqrt((_ALPHA * _ALPHA * p + 1) * (1 - p))
        b = z.add(-1).mul_(_ALPHA * a).add_(_ALPHA * a * p)
        z = z.mul(a)
        return (x.mul_(z) if inplace else x * z).add_(b)
    z = z.div(1 - p)
    return x.mul_(z) if inplace else x * z


def _attention_arguments(args, kwargs):
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
             "enable_gqa")
    values = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
              "enable_gqa": False} | dict(zip(names, args)) | kwargs
    return [values[n] for n in names]


def _attention_weights(q, k, attn_mask, is_causal, scale, enable_gqa):
    """softmax(q k^T scale + mask), formed as ATen's math kernel forms it."""
    s = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(q.size(-1)))
    if enable_gqa:
        k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
    scores = (q * s) @ (k * s).transpose(-2, -1)
    if is_causal:
        if attn_mask is not None:
            raise RuntimeError("scaled_dot_product_attention: an explicit attn_mask should "
                               "not be set when is_causal=True (PyTorch's rule)")
        attn_mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool,
                               device=q.device).tril()
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask)
    return torch._safe_softmax(scores, -1)  # a row masked everywhere gives 0, as ATen's


def _attend(weights, value, q, enable_gqa, z, p):
    if enable_gqa:
        value = value.repeat_interleave(q.size(-3) // value.size(-3), dim=-3)
    return _apply_dropout(F.dropout, weights, z, p, False) @ value


def _value_shape(func, args, kwargs) -> tuple:
    """The shape of the draw a value-kept random function returns."""
    if func in (torch.rand, torch.randn):
        size = kwargs.get("size", args)
        if len(size) == 1 and not isinstance(size[0], int):
            size = size[0]
        return tuple(size)
    return tuple(args[0].shape)


def _value_dtype(func, args, kwargs):
    if func in (torch.rand, torch.randn):
        return kwargs.get("dtype") or torch.get_default_dtype()
    return kwargs.get("dtype") or args[0].dtype


class _Draws(TorchFunctionMode):
    """The base of the recording and replaying modes: sorts a call into dropout, attention
    with dropout, a value draw, or anything else (run as it is)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        return self.after(func, args, kwargs, self.run(func, args, kwargs))

    def after(self, func, args, kwargs, out):
        """What the mode does with a call's result: hand it on."""
        return out

    def run(self, func, args, kwargs):
        if func in _DROPOUTS:
            x, p, training, inplace = _dropout_arguments(func, args, kwargs)
            if training and 0 < p < 1 and x.numel():
                return self.dropout(func, x, p, inplace)
        elif func is F.scaled_dot_product_attention:
            q, k, v, mask, p, causal, scale, gqa = _attention_arguments(args, kwargs)
            if p > 0:
                return self.attention(q, k, v, mask, p, causal, scale, gqa)
        elif func in _VALUES:
            return self.value(func, args, kwargs)
        elif func is _MHA:
            return self.multi_head_attention(args, kwargs)
        return func(*args, **kwargs)

    def multi_head_attention(self, args, kwargs):
        """``F.multi_head_attention_forward``'s own code (this mode is off while it runs),
        its module-level ``dropout`` and ``scaled_dot_product_attention`` routed here."""
        heads = (dict(zip(_MHA_NAMES, args)) | kwargs)["num_heads"]

        def dropout(x, p=0.5, training=True, inplace=False):
            y = self.__torch_function__(F.dropout, (), (x.unflatten(0, (-1, heads)), p,
                                                         training, inplace))
            return y.flatten(0, 1)

        def attention(*a, **k):
            return self.__torch_function__(F.scaled_dot_product_attention, (), a, k)

        scope = _MHA.__globals__ | {"dropout": dropout, "scaled_dot_product_attention": attention}
        body = types.FunctionType(_MHA.__code__, scope, _MHA.__name__, _MHA.__defaults__,
                                  _MHA.__closure__)
        body.__kwdefaults__ = _MHA.__kwdefaults__
        return body(*args, **kwargs)


class Recorder(_Draws):
    """Active while fallback calls are recorded: draws each random operation's noise and
    appends it to the draws of every call being recorded (a fallback inside a fallback
    replays within the outer one), and shows every operation to the calls' row trackers
    (:class:`dpcore_torch.rows.Rows`) and taps (:class:`dpcore_torch.taps.Taps`), except
    inside a rule layer's forward (:func:`opaque`). A draw is *aligned* where its row i is
    known to be example i's: made on a rowwise tensor, or inside a rule layer or
    ``F.multi_head_attention_forward``, whose layouts are known."""

    def __init__(self):
        super().__init__()
        self.active: list[Recording] = []
        self.suspended = 0  # inside rule layers' forwards (and composites)

    def after(self, func, args, kwargs, out):
        if not self.suspended:
            for call in self.active:
                if call.taps is not None:
                    out = call.taps.observe(func, args, kwargs, out)
                call.rows.observe(func, args, kwargs, out)
        return out

    def keep(self, func, draw, x=None):
        for call in self.active:
            aligned = bool(self.suspended) or (x is not None and call.rows.rowwise(x))
            call.draws.append((func, draw, aligned))

    def dropout(self, func, x, p, inplace):
        z = x.new_empty(_noise_shape(func, x)) if _DROPOUTS[func][0] else torch.empty_like(x)
        z.bernoulli_(1 - p)
        self.keep(func, z.bool(), x)
        return _apply_dropout(func, x, z, p, inplace)

    def attention(self, q, k, v, mask, p, causal, scale, gqa):
        w = _attention_weights(q, k, mask, causal, scale, gqa)
        z = torch.empty_like(w).bernoulli_(1 - p)
        self.keep(F.scaled_dot_product_attention, z.bool(), q)
        return _attend(w, v, q, gqa, z, p)

    def value(self, func, args, kwargs):
        out = func(*args, **kwargs)
        self.keep(func, out.detach().clone())  # a copy: the caller may change out in place
        for call in self.active:  # so that a reordering of its rows is seen
            call.rows.mark(out)
        return out

    def multi_head_attention(self, args, kwargs):
        with unobserved():  # its own code: the layout of its draws is known
            return super().multi_head_attention(args, kwargs)


def _recorder():
    return getattr(_state, "recorder", None)


def _active_rows():
    """The row trackers of the calls being recorded."""
    recorder = _recorder()
    return [] if recorder is None else [call.rows for call in recorder.active]


@contextmanager
def unobserved():
    """Operations run here (dpcore's own, a rule layer's) are not shown to the calls being
    recorded."""
    recorder = _recorder()
    if recorder is None:
        yield
        return
    recorder.suspended += 1
    try:
        yield
    finally:
        recorder.suspended -= 1


def share(tensors) -> None:
    """Take ``tensors`` (a unit's parameters as it holds them in a call) as shared by the
    calls being recorded."""
    for rows in _active_rows():
        rows.share_all(tensors)


def alias(t, copy) -> None:
    """``copy``, made of ``t`` outside the mode (a hooked output's), as ``t`` is."""
    for rows in _active_rows():
        rows.alias(t, copy)


def _observed_opaque(inputs, out, batch_outputs) -> None:
    """A layer's call, its operations unobserved, as a whole: its ``batch_outputs`` are
    rowwise where an input is (:meth:`dpcore_torch.rows.Rows.observe_opaque`)."""
    recorder = _recorder()
    if recorder is not None and not recorder.suspended:
        for call in recorder.active:
            call.rows.observe_opaque(inputs, out, batch_outputs)


def enter_opaque(module, args, kwargs) -> None:
    """Forward pre-hook of a layer known to keep each example in its row whose own code
    moves the batch axis (``nn.MultiheadAttention``, ``batch_first``: checked by the
    engine): its operations are not followed (:func:`leave_opaque` after it)."""
    recorder = _recorder()
    if recorder is not None:
        recorder.suspended += 1


def leave_opaque(module, args, kwargs, out) -> None:
    """Forward hook closing :func:`enter_opaque`."""
    recorder = _recorder()
    if recorder is not None and recorder.suspended:
        recorder.suspended -= 1
        _observed_opaque([*args, *kwargs.values()], out, out)  # all have the examples first


def opaque(run, args, kwargs, batch_outputs):
    """``run()``, a rule layer's forward on ``args`` and ``kwargs``: its operations are not
    shown to the row trackers and taps, and its ``batch_outputs(out)`` are rowwise where an
    input is (a rule keeps each example in its row)."""
    if _recorder() is None:  # every rule layer's call: nothing to do outside a recording
        return run()
    with unobserved():
        out = run()
    _observed_opaque([*args, *kwargs.values()], out, batch_outputs(out))
    return out


@torch.no_grad()
def _fill(target, value):
    """Whether the target of an in-place draw could take the kept value (it cannot where it
    is not derived from the batch, and so cannot hold one example's row under ``vmap``)."""
    try:
        target.copy_(value)
    except RuntimeError:
        return False
    return True


class Replayer(_Draws):
    """Active while a fallback call is replayed for example ``index`` (a 0-d tensor, batched
    under ``vmap``): gives each random operation the recorded draw, in order. ``lost``: the
    operation where the recorded call lost track of its rows (:mod:`dpcore_torch.rows`), or
    None."""

    def __init__(self, draws, batch: int, index, module: str, lost: str | None = None):
        super().__init__()
        self.draws, self.batch, self.index, self.module = draws, batch, index, module
        self.lost, self.n = lost, 0
        self.unfilled: dict[int, weakref.ref] = {}  # in-place draws' targets left empty
        self._pending = None

    def take(self, func, shape):
        """The recorded draw for the next random call, ``func`` asking for ``shape``: its row
        for this example, or the whole draw where the batch shares it."""
        if self.n >= len(self.draws):
            raise ReplayMismatchError(
                f"the replay of {self.module} on one example called {function_name(func)} "
                f"after the {len(self.draws)} random draw(s) of its recorded call: how many "
                f"it draws depends on the batch (or its data), and dpcore cannot replay that")
        kept, draw, aligned = self.draws[self.n]
        self.n += 1
        if kept is not func and not (func in _DROPOUTS and kept in _DROPOUTS):
            raise ReplayMismatchError(
                f"the replay of {self.module} on one example called {function_name(func)} "
                f"where its recorded call drew with {function_name(kept)} (random draw "
                f"{self.n})")
        if tuple(draw.shape) == shape:
            return draw.clone()  # the replay may change it in place
        if draw.dim() and draw.shape[0] == self.batch and shape == (1, *draw.shape[1:]):
            if not aligned and self.lost is not None:
                raise ReplayMismatchError(
                    f"{self.module}'s forward pass drew {function_name(func)} of {self.batch} "
                    f"rows after {self.lost} (or before it, for use after it), an operation "
                    f"dpcore does not know to keep each example in its row: it cannot tell "
                    f"which row of the draw was example i's, so it cannot replay it. Keep "
                    f"the examples on axis 0 of the tensors around random draws")
            return draw.index_select(0, self.index.view(1))
        raise ReplayMismatchError(
            f"the replay of {self.module} on one example drew {function_name(func)} of "
            f"shape {shape}, which is neither the recorded draw's shape "
            f"{tuple(draw.shape)} (shared by the batch) nor one example's row of it: dpcore "
            f"gives each example its row of a draw with the batch on axis 0 and cannot tell "
            f"which part of this one belongs to the example")

    def check_done(self) -> None:
        if self.n != len(self.draws):
            raise ReplayMismatchError(
                f"the replay of {self.module} on one example made {self.n} random draw(s) "
                f"where its recorded call made {len(self.draws)}")

    def after(self, func, args, kwargs, out):
        if self.unfilled:
            for t in list(args) + list(kwargs.values()):
                ref = self.unfilled.get(id(t))
                if ref is not None and ref() is t:
                    raise ReplayMismatchError(
                        f"{self.module} uses a tensor after drawing into it in place, which "
                        f"dpcore cannot replay per example (the tensor, made apart from the "
                        f"batch, cannot hold one example's row): use the value the in-place "
                        f"call returns (noise = noise.bernoulli_(p)), or draw out of place")
        if self._pending is not None:
            self.unfilled[id(self._pending)] = weakref.ref(self._pending)
            self._pending = None
        return out

    def dropout(self, func, x, p, inplace):
        z = self.take(func, _noise_shape(func, x)).to(x.dtype)
        return _apply_dropout(func, x, z, p, inplace)

    def attention(self, q, k, v, mask, p, causal, scale, gqa):
        w = _attention_weights(q, k, mask, causal, scale, gqa)
        z = self.take(F.scaled_dot_product_attention, tuple(w.shape)).to(w.dtype)
        return _attend(w, v, q, gqa, z, p)

    def value(self, func, args, kwargs):
        value = self.take(func, _value_shape(func, args, kwargs)).to(
            _value_dtype(func, args, kwargs))
        if func not in _IN_PLACE:
            return value
        if _fill(args[0], value):
            return args[0]
        self._pending = args[0]  # left empty: any later use of it is refused
        return value


class Recording:
    """Context of a fallback call being recorded: its random draws go to ``draws`` (a list
    of (function, draw, aligned)), and its operations are shown to ``rows`` and ``taps``
    (or None). One :class:`Recorder` serves nested recordings, so each draw is made once."""

    def __init__(self, draws: list, rows, taps=None):
        self.draws, self.rows, self.taps = draws, rows, taps

    def __enter__(self):
        recorder = _recorder()
        self.outermost = recorder is None
        if self.outermost:
            recorder = _state.recorder = Recorder()
            recorder.__enter__()
        recorder.active.append(self)
        return self

    def __exit__(self, *exc):
        recorder = _state.recorder
        recorder.active.pop()
        if self.outermost:
            _state.recorder = None
            recorder.__exit__(*exc)
        return False
