"""Which tensors of a fallback unit's forward pass keep each example in its row, so that row
i of a tensor can be credited to example i: by the taps (:mod:`dpcore_torch.taps`), whose
per-example gradients are rows of backprops, and by the replay of random draws
(:mod:`dpcore_torch.draws`), which gives example i row i of each draw.

Every tensor the call meets is *rowwise* (row i depends on example i alone), *shared*
(depends on no example), or unknown. The unit's positional inputs have the examples on
axis 0 (the fallback's contract): rowwise. Its parameters and buffers, tensors its modules
hold as attributes (a cache from an earlier call), the other arguments, and tensors made
from shared ones or from nothing are shared. The mode that records the
call shows every operation to a :class:`Rows`. An operation with a rowwise argument gives
rowwise results if it keeps rows apart: elementwise operations with the rowwise operands
aligned on axis 0, reductions and softmaxes over other axes, views and reshapes that keep
axis 0 (its size and the rank unchanged where it expands), indexing whose first index is
``:`` with at most one advanced index, concatenation along another axis, ``F.linear`` and
products with the rowwise operand on the left (or batched on both sides), convolutions,
pooling, per-example normalisation, embedding lookups, attention, and rule layers as wholes.
Anything else *loses track* of the call, and its name is kept for messages: an operation on a
rowwise tensor outside that list (a transpose of axis 0, a sort of the rows, ``.item()``, a
hook), a write of rowwise values into a tensor that was not rowwise (its views, made before,
would carry them unseen), or any operation on a tensor of unknown origin (made where dpcore
did not look). With one example (B = 1) every tensor is that example's.

A lost call is never wrong, only slower: the taps leave it to the replay, and the replay
refuses draws of B rows it can no longer tell apart. Gradients changed in the backward pass
(a hook, an autograd Function's own backward) are not seen, here as for the layer rules.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

_NAMESPACES = (torch, torch.Tensor, torch._C.TensorBase, F, torch.special, torch.linalg)


def _funcs(*names):
    """Every function object the torch function mode may see under these names."""
    found = set()
    for name in names:
        for space in _NAMESPACES:
            f = getattr(space, name, None)
            if callable(f):
                found.add(f)
    return found


_ELEMENTWISE_NAMES = """add sub subtract mul multiply div divide true_divide floor_divide remainder
fmod pow float_power neg negative abs absolute sqrt rsqrt exp exp2 expm1 log log1p log2 log10
sin cos tan asin acos atan atan2 sinh cosh tanh asinh acosh atanh sigmoid logit relu relu6
gelu silu mish softplus softsign elu selu celu leaky_relu hardtanh hardsigmoid hardswish
logsigmoid tanhshrink threshold hardshrink softshrink prelu clamp clamp_min clamp_max clip
where maximum minimum fmax fmin lerp addcmul addcdiv reciprocal sign sgn square erf erfc erfinv
floor ceil round trunc frac logical_and logical_or logical_not logical_xor bitwise_and
bitwise_or bitwise_xor bitwise_not eq ne lt le gt ge greater less greater_equal less_equal
not_equal isnan isinf isfinite isposinf isneginf nan_to_num masked_fill copy_ fill_ zero_ to
type type_as float double half bfloat16 long int bool contiguous clone detach detach_
requires_grad_ dropout alpha_dropout feature_alpha_dropout dropout1d dropout2d dropout3d
feature_dropout xlogy hypot sinc deg2rad rad2deg heaviside copysign nextafter positive
__add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__ __truediv__
__rtruediv__ __itruediv__ __div__ __rdiv__ __floordiv__ __rfloordiv__ __mod__ __rmod__
__pow__ __rpow__ __ipow__ __neg__ __pos__ __abs__ __and__ __or__ __xor__ __invert__ __eq__
__ne__ __lt__ __le__ __gt__ __ge__ __iand__ __ior__ __ixor__ bernoulli uniform_ normal_
exponential_ random_ geometric_ cauchy_ log_normal_ new_tensor""".split()
_ELEMENTWISE = _funcs(*_ELEMENTWISE_NAMES, *(n + "_" for n in _ELEMENTWISE_NAMES
                                             if not n.startswith("_")))
# input rowwise (the first argument), the others shared: the least rank of a batched input
_PER_EXAMPLE = {}
for _names, _rank in ((("linear",), 2), (("conv1d", "conv_transpose1d"), 3),
                      (("conv2d", "conv_transpose2d", "pixel_shuffle", "pixel_unshuffle"), 4),
                      (("conv3d", "conv_transpose3d"), 5),
                      (("max_pool1d", "max_pool2d", "max_pool3d", "max_pool1d_with_indices",
                        "max_pool2d_with_indices", "max_pool3d_with_indices", "avg_pool1d",
                        "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d",
                        "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool1d",
                        "adaptive_max_pool2d", "adaptive_max_pool3d", "lp_pool1d",
                        "lp_pool2d", "group_norm"), 2),
                      (("interpolate", "upsample", "instance_norm", "local_response_norm"), 3),
                      (("embedding", "one_hot"), 1)):
    _PER_EXAMPLE.update(dict.fromkeys(_funcs(*_names), _rank))
_PER_EXAMPLE.update({F.unfold: 4, F.fold: 3})  # im2col and back on (N, C, ...)
_NORMS = _funcs("layer_norm", "rms_norm")  # normalised over trailing axes, not axis 0
# a dim that must not be 0: (position of the argument, its default)
_ALONG_DIM = {}
for _names, _at in ((("softmax", "log_softmax", "softmin", "cumsum", "cumprod",
                      "logcumsumexp", "cummax", "cummin", "narrow", "select", "unflatten"),
                     (1, None)),
                    (("glu", "argsort", "sort"), (1, -1)), (("unbind",), (1, 0)),
                    (("split", "chunk", "tensor_split", "split_with_sizes"), (2, 0)),
                    (("topk", "kthvalue"), (2, -1)), (("normalize",), (2, 1)),
                    (("repeat_interleave",), (2, None))):
    _ALONG_DIM.update(dict.fromkeys(_funcs(*_names), _at))
_ALONG_DIM.update({torch.Tensor.unfold: (1, None)})  # windows along an axis (not F.unfold)
_GATHERS = _funcs("gather", "index_select")  # (input, dim, index)
_TAKE_ALONG = _funcs("take_along_dim")
# operations on the last axes only, and the least rank that leaves axis 0 out of them
_LAST_AXES = dict.fromkeys(_funcs("tril", "triu", "tril_", "triu_"), 3)
_LAST_AXES.update(dict.fromkeys(_funcs("view_as_complex"), 2))
_LAST_AXES.update(dict.fromkeys(_funcs("view_as_real"), 1))
# reductions: dims that must be given and exclude 0, at this position
_REDUCTIONS = dict.fromkeys(_funcs(
    "sum", "mean", "amax", "amin", "max", "min", "prod", "logsumexp", "var", "std",
    "var_mean", "std_mean", "median", "nanmedian", "all", "any", "argmax", "argmin",
    "count_nonzero", "nansum", "nanmean", "aminmax"), 1)
_REDUCTIONS.update(dict.fromkeys(_funcs("norm", "vector_norm"), 2))
_SAME_ROWS = _funcs("view", "reshape", "expand", "squeeze", "broadcast_to", "flatten",
                    "unsqueeze", "repeat", "pad")
_SHAPED_LIKE = _funcs("view_as", "reshape_as", "expand_as")  # the second only gives a shape
_TRANSPOSES = _funcs("transpose", "swapaxes", "swapdims", "movedim", "moveaxis", "permute",
                     "flip", "roll")
_JOINS = _funcs("cat", "concat", "concatenate", "stack")
_PRODUCTS = _funcs("matmul", "bmm", "mm", "__matmul__", "baddbmm", "addmm")
_EINSUM = _funcs("einsum")
_FACTORIES = _funcs("new_empty", "new_zeros", "new_ones", "new_full", "empty_like",
                    "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
                    "randint_like")  # only the argument's shape
_METADATA = _funcs("size", "dim", "numel", "nelement", "is_floating_point", "is_complex",
                   "element_size", "is_contiguous", "stride", "storage_offset", "__len__",
                   "get_device", "has_names", "is_shared", "is_pinned", "_is_view",
                   "retain_grad", "is_set_to", "__hash__", "__format__", "__repr__",
                   "__str__")
_GETITEM = _funcs("__getitem__")
_SETITEM = _funcs("__setitem__")
# single forms the per-operation checks tell apart (found once here, not per operation)
_MAX_MIN, _STACK, _EXPAND_AS = _funcs("max", "min"), _funcs("stack"), _funcs("expand_as")
_INDEX_SELECT, _FLATTEN, _UNSQUEEZE = (_funcs("index_select"), _funcs("flatten"),
                                       _funcs("unsqueeze"))
_SQUEEZE, _REPEAT, _PAD = _funcs("squeeze"), _funcs("repeat"), _funcs("pad")
_EXPAND = _funcs("expand", "broadcast_to")
_PERMUTE, _FLIP, _ROLL = _funcs("permute"), _funcs("flip"), _funcs("roll")
_VIEW_GETTERS = {"mT": 3, "mH": 3, "data": 1, "real": 1, "imag": 1}  # name: least rank
_DATA_GETTERS = {"T", "H", "grad"}  # properties whose value moves or mixes rows
_READ_GETTERS = set(_VIEW_GETTERS) | _DATA_GETTERS  # the other properties read no values


def function_name(func) -> str:
    """A readable name of a function the torch function mode sees (torch.nn.functional.
    dropout, torch.Tensor.transpose, Tensor.mT for a property)."""
    owner = getattr(func, "__self__", None)
    if type(func).__name__ == "method-wrapper" and owner is not None:
        return f"Tensor.{owner.__name__}"
    name = getattr(func, "__name__", None) or repr(func)
    return f"{getattr(func, '__module__', None) or 'torch.Tensor'}.{name}"


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []


class Rows:
    """The rowwise and shared tensors of one recorded call of a unit, for a batch of
    ``batch``: ``inputs`` rowwise, ``shared`` (parameters, buffers, other arguments)
    shared."""

    def __init__(self, batch: int, inputs=(), shared=()):
        self.batch, self.lost = batch, None
        self._rows: dict[int, weakref.ref] = {}
        self._shared: dict[int, weakref.ref] = {}
        for t in shared:
            self.share(t)
        for t in inputs:
            self.mark(t)

    def mark(self, t) -> None:
        """Take ``t`` as rowwise (with B rows; else the call loses track)."""
        if not isinstance(t, torch.Tensor):
            return
        if t.dim() and t.shape[0] == self.batch:
            self._rows[id(t)] = weakref.ref(t)
            self._shared.pop(id(t), None)
        elif self.lost is None:
            self.lost = "a rowwise result without the batch's rows"

    def share(self, t) -> None:
        if isinstance(t, torch.Tensor) and not self.rowwise(t):
            self._shared[id(t)] = weakref.ref(t)

    def share_all(self, tensors) -> None:
        for t in tensors:
            self.share(t)

    def alias(self, t, copy) -> None:
        """``copy`` (a copy of ``t`` made outside the mode) as ``t`` is."""
        if self.rowwise(t):
            self.mark(copy)
        elif self.shared(t):
            self.share(copy)

    def rowwise(self, t) -> bool:
        ref = self._rows.get(id(t))
        return ref is not None and ref() is t

    def shared(self, t) -> bool:
        ref = self._shared.get(id(t))
        return ref is not None and ref() is t

    def _unknown(self, tensors) -> bool:
        return any(not self.rowwise(t) and not self.shared(t) for t in tensors)

    def observe(self, func, args, kwargs, out) -> None:
        """Follow one operation of the call (``out``: what the caller gets)."""
        if self.lost is not None or self.batch <= 1:
            return
        if func in _METADATA or (type(func).__name__ == "method-wrapper" and getattr(
                func.__self__, "__name__", "") not in _READ_GETTERS):
            return  # no values read: shape, dtype, device, ...
        if func in _FACTORIES:  # only the shape of the argument: shared values (a draw's
            for t in _tensors(out):  # rows were marked by the recorder)
                if not self.rowwise(t):
                    self.share(t)
            return
        operands = list(args) + list(kwargs.values())
        if func in _SHAPED_LIKE:  # the second argument only gives a shape
            operands = operands[:1]
        tensors = _tensors(operands)
        if self._unknown(tensors):
            self.lost = f"{function_name(func)} (on a tensor made where dpcore did not look)"
            return
        rowwise = [t for t in tensors if self.rowwise(t)]
        if func in _SETITEM:
            out = args[0]  # the target, changed in place
        target = kwargs.get("out", args[0] if args and out is args[0] else None)
        if rowwise and isinstance(target, torch.Tensor) and not self.rowwise(target):
            # examples' values written into a tensor that was not theirs: views of it made
            # before would carry them unseen
            self.lost = function_name(func)
            return
        if not rowwise:
            for t in _tensors(out):
                self.share(t)
            return
        if not self._keeps_rows(func, args, kwargs, _tensors(out), rowwise):
            self.lost = function_name(func)
            return
        for t in _tensors(out):
            self.mark(t)

    def require(self, outputs) -> None:
        """Lose track unless every one of the call's ``outputs`` is rowwise or shared (one
        made where the mode did not look, by ``torch.jit.script`` say, is neither)."""
        if self.lost is None and self.batch > 1 and self._unknown(outputs):
            self.lost = "an output made where dpcore did not look"

    def observe_opaque(self, inputs, out, batch_outputs) -> None:
        """A rule layer's call on ``inputs``: its ``batch_outputs`` (those of ``out`` with
        the examples on axis 0; the others stay unknown) are rowwise where an input is (a
        rule keeps each example in its row); all its outputs are shared where all inputs
        are."""
        if self.lost is not None or self.batch <= 1:
            return
        tensors = _tensors(list(inputs))
        if self._unknown(tensors):
            self.lost = "a layer called on a tensor made where dpcore did not look"
        elif any(self.rowwise(t) for t in tensors):
            for t in _tensors(batch_outputs):
                self.mark(t)
        else:
            for t in _tensors(out):
                self.share(t)

    def _keeps_rows(self, func, args, kwargs, outs, rowwise) -> bool:
        if not outs or any(o.dim() == 0 or o.shape[0] != self.batch for o in outs):
            return False  # a value (.item(), a bool) or rows gone: the examples may mix
        if "axis" in kwargs and "dim" not in kwargs:  # NumPy's name, which torch accepts
            kwargs = {("dim" if k == "axis" else k): v for k, v in kwargs.items()}
        first, ndim = args[0] if args else None, outs[0].dim()
        alone = len(rowwise) == 1 and rowwise[0] is first  # the first argument, alone
        if type(func).__name__ == "method-wrapper":
            least = _VIEW_GETTERS.get(getattr(func.__self__, "__name__", ""))
            return least is not None and first.dim() >= least
        if func in _ELEMENTWISE:
            return all(t.dim() == ndim for t in rowwise)
        if func in _PER_EXAMPLE:
            return alone and first.dim() >= _PER_EXAMPLE[func]
        if func in _NORMS:
            shape = kwargs.get("normalized_shape", _arg(args, 1))
            shape = [shape] if isinstance(shape, int) else shape
            return alone and len(shape) < first.dim()
        if func in _ALONG_DIM:
            at, default = _ALONG_DIM[func]
            dim = kwargs.get("dim", _arg(args, at, default))
            return alone and isinstance(dim, int) and dim % first.dim() != 0
        if func in _REDUCTIONS:
            other = kwargs.get("other", _arg(args, 1))
            if isinstance(other, torch.Tensor):  # max(a, b), min(a, b): elementwise
                return func in _MAX_MIN and all(t.dim() == ndim for t in rowwise)
            dim = kwargs.get("dim", _arg(args, _REDUCTIONS[func]))
            return (alone and isinstance(dim, (int, list, tuple)) and len(_listed(dim)) > 0
                    and 0 not in _axes(dim, first.dim()))
        if func in _SAME_ROWS:
            return alone and _keeps_axis0(func, args, kwargs, first, outs[0])
        if func in _SHAPED_LIKE:  # the first's rows (the other gave only a shape)
            return first.shape[0] == outs[0].shape[0] and (
                func not in _EXPAND_AS or first.dim() == outs[0].dim())
        if func in _TRANSPOSES:
            return alone and _fixes_axis0(func, args, kwargs, first.dim())
        if func in _JOINS:
            dim = kwargs.get("dim", _arg(args, 1, 0))
            rank = ndim - (func in _STACK)
            return (isinstance(dim, int) and dim % ndim != 0
                    and all(t.dim() == rank for t in rowwise))
        if func in _PRODUCTS:
            return _product_keeps_rows(func, args, kwargs, rowwise, ndim)
        if func in _EINSUM:
            return _einsum_keeps_rows(args, rowwise)
        if func in _GATHERS:  # along another axis, with indices shared or aligned rows
            dim = kwargs.get("dim", _arg(args, 1))
            index = kwargs.get("index", _arg(args, 2))
            return (any(t is first for t in rowwise) and isinstance(dim, int)
                    and dim % first.dim() != 0
                    and all(t is first or (t is index and t.dim() == first.dim()
                                           and func not in _INDEX_SELECT)
                            for t in rowwise))
        if func in _TAKE_ALONG:  # (input, indices, dim)
            dim = kwargs.get("dim", _arg(args, 2))
            indices = kwargs.get("indices", _arg(args, 1))
            return (isinstance(dim, int) and dim % first.dim() != 0
                    and all(t is first or (t is indices and t.dim() == first.dim())
                            for t in rowwise))
        if func in _LAST_AXES:  # on the last axes only: tril, triu, complex views
            return alone and first.dim() >= _LAST_AXES[func]
        if func is F.scaled_dot_product_attention:
            return all(t.dim() >= 3 and t.dim() == ndim for t in rowwise)
        if func in _GETITEM:
            return alone and _index_keeps_axis0(args[1], first.dim())
        if func in _SETITEM:
            value, region = args[2], first[args[1]]
            return (_index_keeps_axis0(args[1], first.dim())
                    and all(t is first or (t is value and t.dim() == region.dim())
                            for t in rowwise))
        return False


def _arg(args, i, default=None):
    return args[i] if len(args) > i else default


def _listed(value):
    return [value] if isinstance(value, int) else list(value)


def _axes(value, ndim: int) -> set[int]:
    """The axes named by ``value`` (an int or a sequence), made non-negative."""
    return {v % ndim if ndim else 0 for v in _listed(value)}


def _keeps_axis0(func, args, kwargs, x, out) -> bool:
    """A view, reshape, flatten, squeeze, unsqueeze, expansion or padding whose axis 0 is
    the input's (a reshape in C order that keeps the first size keeps the rows)."""
    if out.shape[0] != x.shape[0]:
        return False
    if func in _FLATTEN:
        return kwargs.get("start_dim", _arg(args, 1, 0)) % x.dim() != 0
    if func in _UNSQUEEZE:
        return kwargs.get("dim", _arg(args, 1)) % out.dim() != 0
    if func in _SQUEEZE:
        dim = kwargs.get("dim", _arg(args, 1))
        return dim is None or 0 not in _axes(dim, x.dim())
    if func in _REPEAT:
        sizes = list(args[1:]) if isinstance(_arg(args, 1), int) else list(_arg(args, 1, ()))
        return len(sizes) == x.dim() and sizes[0] == 1
    if func in _PAD:
        return len(kwargs.get("pad", _arg(args, 1, ()))) // 2 < x.dim()
    if func in _EXPAND:  # no new leading axis (of B, by chance)
        return out.dim() == x.dim()
    return True  # view, reshape (C order: the same first size keeps the rows)


def _fixes_axis0(func, args, kwargs, ndim: int) -> bool:
    """A transpose, permutation, flip or roll that leaves axis 0 where it is."""
    if func in _PERMUTE:
        order = kwargs.get("dims", list(args[1:]))
        if len(order) == 1 and not isinstance(order[0], int):
            order = list(order[0])
        return order[0] % ndim == 0
    if func in _FLIP:
        dims = kwargs.get("dims", list(args[1:]))
        if len(dims) == 1 and not isinstance(dims[0], int):
            dims = list(dims[0])
        return 0 not in _axes(dims, ndim)
    if func in _ROLL:
        dims = kwargs.get("dims", _arg(args, 2))
        return dims is not None and 0 not in _axes(dims, ndim)
    named = [v for v in list(args[1:]) + list(kwargs.values())
             if isinstance(v, (int, list, tuple))]  # transpose, swap*, movedim's axes
    return bool(named) and all(0 not in _axes(v, ndim) for v in named)


_OPERANDS = {"addmm": ("input", "mat1", "mat2"), "baddbmm": ("input", "batch1", "batch2"),
             "mm": ("input", "mat2"), "bmm": ("input", "mat2"), "matmul": ("input", "other"),
             "__matmul__": ("input", "other")}


def _product_keeps_rows(func, args, kwargs, rowwise, ndim: int) -> bool:
    """Row i of a product depends on row i alone: the rowwise operand on the left with a
    shared right operand of no more axes, or the batch a leading batch axis of both."""
    names = _OPERANDS[func.__name__]
    values = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    if any(n not in values for n in names):
        return False
    operands = [values[n] for n in names]
    if len(operands) == 3:
        bias, operands = operands[0], operands[1:]
        if any(t is bias for t in rowwise) and bias.dim() != ndim:
            return False
    a, b = operands
    rows_a, rows_b = any(t is a for t in rowwise), any(t is b for t in rowwise)
    if rows_b:
        return b.dim() >= 3 and a.dim() <= b.dim() and (not rows_a or a.dim() == b.dim())
    return rows_a and a.dim() >= 2 and b.dim() <= a.dim() and (b.dim() <= 2
                                                                 or b.dim() == a.dim())


def _einsum_keeps_rows(args, rowwise) -> bool:
    """An einsum with an explicit output whose rowwise operands all begin with the output's
    first letter (the batch), and no ellipsis."""
    equation, operands = args[0], args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = operands[0]
    if not isinstance(equation, str) or "->" not in equation or "." in equation:
        return False
    inputs, output = equation.replace(" ", "").split("->")
    terms = inputs.split(",")
    if not output or len(terms) != len(operands):
        return False
    batch = output[0]
    for term, operand in zip(terms, operands):
        if any(operand is t for t in rowwise) and (not term or term[0] != batch
                                                   or term.count(batch) != 1):
            return False
    return output.count(batch) == 1


def _index_keeps_axis0(index, ndim: int) -> bool:
    """Whether ``x[index]`` keeps axis 0 whole and in front: the first index is ``:`` (or an
    ellipsis covering axis 0), and at most one index is advanced (several, or a bool among
    others, move their axes to the front)."""
    index = index if isinstance(index, tuple) else (index,)
    if not index:
        return True
    advanced, consumed = 0, 0
    for i in index:
        if isinstance(i, bool) or (isinstance(i, torch.Tensor) and i.dtype == torch.bool):
            advanced += 1
            consumed += i.dim() if isinstance(i, torch.Tensor) else 0
        elif isinstance(i, torch.Tensor) and i.dim() > 0 or isinstance(i, list):
            advanced += 1
            consumed += 1
        elif i is not None and i is not Ellipsis:
            consumed += 1  # a slice, an int, a 0-d integer tensor
    if advanced > 1:
        return False
    head = index[0]
    if isinstance(head, slice):
        return head == slice(None)
    if head is Ellipsis:
        return consumed < ndim
    return False
