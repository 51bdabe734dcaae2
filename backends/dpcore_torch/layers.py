"""Per-layer rules: per-example gradients, their squared norms and clipped sums from one backward.

An instrumented layer runs its forward through a custom autograd function that keeps its input
``x`` and, during the ordinary backward pass, the backprop ``g = dL/d(output)``; the function
returns the input's gradient only, so autograd never forms the (non-private) summed parameter
gradient. From (x, g) each rule gives, for example i:

* the per-example gradient (materialised, ``grad``);
* its squared norm (``sq_norm``), by the ghost-norm identity when that is cheaper (plus the
  bound on its rounding of :mod:`dpcore.rounding`, in float32 at least);
* the clipped sum ``sum_i c_i grad_i``, added in place into a given tensor (the step's noise:
  ``add_weighted_sum``), from x and c_i g_i directly ("book-keeping", Bu et al. 2023): one
  product the size of an ordinary weight gradient.

Linear, x (B, T, d_in), g (B, T, d_out), T the product of the middle axes (1 for plain vectors):
    grad_i = g_i^T x_i,  ||grad_i||^2 = <x_i x_i^T, g_i g_i^T>_F  (ghost: B T^2 (d_in + d_out) work,
    against B T d_in d_out to materialise; T = 1 gives ||x_i||^2 ||g_i||^2).
Conv (unfolded input X_i of shape (D, L), g_i of shape (O, L), per group): grad_i = g_i X_i^T,
    ghost ||grad_i||^2 = <X_i^T X_i, g_i^T g_i>_F, cost L^2 (D + O) against L D O.
Embedding, indices k_i (T,): grad_i = sum_t e_{k_it} g_it^T, nonzero only in the rows k_i
    touches: ||grad_i||^2 = sum_v ||sum_{t: k_it = v} g_it||^2, from the B T backprop rows
    summed per distinct (i, v) (never the dense B V d).
LayerNorm / GroupNorm, normalised input xh: grad_weight_i = sum (g_i * xh_i), grad_bias_i = sum g_i
    over the non-channel axes (small, always materialised).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.grad import conv1d_input, conv2d_input

from dpcore.rounding import ghost_margin, sum_margin

from .independence import NotPerExampleError, probing
from .snapshot import AUTOCAST_DEVICES


_trace = threading.local()


@contextlib.contextmanager
def traced():
    """Within: the step is being traced into a graph of tensor operations
    (:mod:`dpcore_torch.compiled`), where a value cannot steer Python: rules take forms whose
    shapes do not depend on the data, and make no choice by timing."""
    before = tracing()
    _trace.on = True
    try:
        yield
    finally:
        _trace.on = before


def tracing() -> bool:
    """Whether the step is being traced (:func:`traced`)."""
    return getattr(_trace, "on", False)


def parameter(module: nn.Module, name: str):
    """``module.get_parameter(name)`` without its type check: under
    ``torch.func.functional_call`` (a compiled step's trace) the parameters are plain
    tensors."""
    prefix, _, attr = name.rpartition(".")
    return getattr(module.get_submodule(prefix) if prefix else module, attr)


def keep_rows(t, keep):
    """``t`` (examples on axis 0) with the rows where ``keep`` is False set to 0; anything but
    a floating-point tensor is returned as it is."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return t
    return torch.where(keep.reshape(-1, *[1] * (t.dim() - 1)), t, 0)


def cast_to(t, dtype):
    """Floating tensor ``t`` in ``dtype``; other tensors as they are."""
    if t.dtype == dtype or not t.is_floating_point():  # the common case costs no torch call
        return t
    return t.to(dtype)


class AccumulationError(RuntimeError):
    """Gradients of several backward passes in one step (gradient accumulation)."""


#: ``tick()``: a number larger than every earlier one, for when a call was made or first
#: reached by a backward pass (the engine refuses a step with a back-propagated call made
#: after a backward pass had reached another: two batches clipped as one).
tick = itertools.count().__next__


def birth() -> int | None:
    """When a layer call is made: ``tick()``, or None during a backward pass (activation
    checkpointing recomputes forward passes there; such calls may follow a backward pass)."""
    return tick() if torch._C._current_graph_task_id() == -1 else None


def reach(call) -> None:
    """Mark ``call`` (a layer call's record) as reached by the backward pass running, if no
    pass reached it before: when (``reached_at``, a :func:`tick`) and by which pass
    (``backward``, autograd's id of the graph task)."""
    if call.reached_at is None:
        call.reached_at, call.backward = tick(), torch._C._current_graph_task_id()


def first_reached(records):
    """Of a call's records (its maps' Uses), the one a backward pass reached first, or
    None."""
    return min((r for r in records if r.reached_at is not None), key=lambda r: r.reached_at,
               default=None)


def late_backward() -> AccumulationError:
    """For a backward pass through a call whose step was already taken or cleared."""
    return AccumulationError(
        "a backward pass reached a layer call whose inputs dpcore no longer keeps: its step "
        "was taken, or optimizer.zero_grad() was called after it was back-propagated (or "
        "twice since it was made). Run each step's forward pass after the previous step")


class Use:
    """One call of an instrumented layer in the current step: its input ``x``, the backprop
    ``g`` of its output (set by the backward pass, :meth:`arrive`), statistics ``aux``, a
    cache of materialised per-example gradients, when it was made and when and by which
    backward pass it was first reached."""

    __slots__ = ("x", "g", "aux", "cache", "born", "reached_at", "backward")

    def __init__(self, x, aux=None):
        self.x, self.g, self.aux, self.cache = x, None, aux, {}
        self.born, self.reached_at, self.backward = birth(), None, None

    def arrive(self, g) -> None:
        """Add the backprop ``g`` of this call's output, from a backward pass (several
        backward passes through one forward, e.g. one per loss term, add up). The
        independence check's backward pass is ignored."""
        if probing():
            return
        if self.x is None:
            raise late_backward()
        self.g = g if self.g is None else self.g + g
        reach(self)

    def release(self) -> None:
        """Drop the tensors (the autograd graph or the user may still hold this object)."""
        self.x = self.g = self.aux = None
        self.cache = {}

    def keep_rows(self, keep) -> None:
        """Set the rows of the examples where ``keep`` (B,) is False to 0 in every kept tensor,
        so that a dropped record's NaN or Inf cannot reach a sum as 0 * NaN = NaN."""
        self.x, self.g = keep_rows(self.x, keep), keep_rows(self.g, keep)
        if isinstance(self.aux, tuple):
            self.aux = tuple(keep_rows(t, keep) for t in self.aux)
        self.cache = {k: keep_rows(t, keep) for k, t in self.cache.items()}

    @property
    def batch_size(self) -> int:
        return self.x.shape[0]

    @property
    def reached(self) -> bool:
        """Whether the backward pass reached this call (else it contributes zero)."""
        return self.g is not None


# --------------------------------------------------------------------------- autograd functions
# Each returns the input's gradient only (None for parameters), and stores g in the Use.

class _Linear(torch.autograd.Function):
    """On x (B, ..., d_in), flattened to a matrix: the product is returned as the matrix it is
    and reshaped outside (F.linear would return a view made inside the function, which autograd
    forbids modifying in place, e.g. by a ReLU(inplace=True))."""

    @staticmethod
    def forward(ctx, use, x, weight, bias):
        ctx.use, ctx.shape = use, x.shape
        ctx.save_for_backward(weight, x)  # x: autograd's check that nothing changed it in place
        return F.linear(x if x.dim() == 2 else x.reshape(-1, x.shape[-1]), weight, bias)

    @staticmethod
    def backward(ctx, g):
        shape, (weight, _) = ctx.shape, ctx.saved_tensors
        if len(shape) != 2:
            g = g.reshape(*shape[:-1], g.shape[-1])
        ctx.use.arrive(cast_to(g, weight.dtype))
        gx = g.matmul(cast_to(weight, g.dtype)) if ctx.needs_input_grad[1] else None
        return None, gx, None, None


class _Conv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, use, x, weight, bias, stride, padding, dilation, groups):
        ctx.use, ctx.conf, ctx.shape = use, (stride, padding, dilation, groups), x.shape
        ctx.save_for_backward(weight, x)  # x: autograd's check that nothing changed it in place
        conv = F.conv1d if x.dim() == 3 else F.conv2d
        return conv(x, weight, bias, stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx, g):
        weight, _ = ctx.saved_tensors
        ctx.use.arrive(cast_to(g, weight.dtype))
        gx = None
        if ctx.needs_input_grad[1]:
            conv_input = conv1d_input if len(ctx.shape) == 3 else conv2d_input
            gx = conv_input(ctx.shape, cast_to(weight, g.dtype), g, *ctx.conf)
        return None, gx, None, None, None, None, None, None


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, use, indices, weight, padding_idx, max_norm, norm_type, sparse):
        ctx.use = use
        return F.embedding(indices, weight, padding_idx, max_norm, norm_type, False, sparse)

    @staticmethod
    def backward(ctx, g):
        ctx.use.arrive(g)
        return None, None, None, None, None, None, None


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, use, x, weight, bias, shape, eps):
        out, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
        use.aux = (mean, rstd)
        ctx.use, ctx.shape, ctx.dtype = use, shape, use.x.dtype
        ctx.save_for_backward(x, mean, rstd, weight, bias)
        return out

    @staticmethod
    def backward(ctx, g):
        ctx.use.arrive(cast_to(g, ctx.dtype))
        gx = None
        if ctx.needs_input_grad[1]:
            x, mean, rstd, weight, bias = ctx.saved_tensors
            gx = torch.ops.aten.native_layer_norm_backward(
                g.contiguous(), x, ctx.shape, mean, rstd, weight, bias, [True, False, False])[0]
        return None, gx, None, None, None, None


class _GroupNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, use, x, weight, bias, groups, eps):
        x = x.contiguous()  # the native kernel's layout (a transposed input is legal)
        n, c = x.shape[0], x.shape[1]
        hw = math.prod(x.shape[2:])
        out, mean, rstd = torch.native_group_norm(x, weight, bias, n, c, hw, groups, eps)
        use.aux = (mean, rstd)
        ctx.use, ctx.conf, ctx.dtype = use, (n, c, hw, groups), use.x.dtype
        ctx.save_for_backward(x, mean, rstd, weight)
        return out

    @staticmethod
    def backward(ctx, g):
        ctx.use.arrive(cast_to(g, ctx.dtype))
        gx = None
        if ctx.needs_input_grad[1]:
            x, mean, rstd, weight = ctx.saved_tensors
            gx = torch.ops.aten.native_group_norm_backward(
                g.contiguous(), x, mean, rstd, weight, *ctx.conf, [True, False, False])[0]
        return None, gx, None, None, None, None


# --------------------------------------------------------------------------- rules

def row_sq_norms(t):
    """Squared L2 norm of every row of t: (B, ...) -> (B,). A per-example tensor stored with
    its axes permuted (:meth:`ConvRule._shifted_rows_grad`) is read in place, not copied."""
    if t.dim() == 1:  # a scalar parameter's per-example gradients
        return t.square()
    if t.is_contiguous():  # one pass (einsum's batched dot products are 5-30x slower)
        return torch.linalg.vector_norm(t.flatten(1), dim=1).square_()
    stored = _as_stored(t)  # reduced in storage order, without a squared copy
    if stored is None:
        return torch.linalg.vector_norm(t, dim=tuple(range(1, t.dim()))).square_()
    return torch.linalg.vector_norm(stored[1], dim=(0, 2)).square_()


def _as_stored(t):
    """For ``t`` (B, ...) whose axes are a permutation of a contiguous array's: (order, view),
    ``order`` t's axes from the slowest-varying in memory on, ``view`` that array as
    (A, B, R), the examples on axis 1 (A is 1 when they vary slowest); None otherwise."""
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    stored = t.permute(order)
    if not stored.is_contiguous():
        return None
    k = order.index(0)
    return order, stored.reshape(math.prod(stored.shape[:k]), t.shape[0], -1)


def _wide(t):
    """``t`` in float32 at least: a 16-bit model's ghost norms would round too coarsely for
    their bound (its margin grows with the machine epsilon) to stay small."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


@contextlib.contextmanager
def full_precision():
    """float32 matrix products at full precision within the block: the rounding bound of
    :mod:`dpcore.rounding` is for products in their dtype, and
    ``torch.set_float32_matmul_precision("high" | "medium")`` lets them round their inputs
    to TensorFloat-32 or bfloat16 (oneDNN does on CPUs with bfloat16 units)."""
    before = torch.get_float32_matmul_precision()
    if before == "highest":
        yield
        return
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


@contextlib.contextmanager
def autocast_off():
    """Autocast off within the block, on the CPU and on CUDA: norms, clip factors and clipped
    sums formed under the caller's ``torch.autocast`` (a compiled step's forward runs in it)
    would take their products in bfloat16 or float16, and one record's contribution could
    exceed its clip (1.75 S measured for a LayerNorm group under bfloat16)."""
    on = [device for device in AUTOCAST_DEVICES if torch.is_autocast_enabled(device)]
    if not on:
        yield
        return
    with contextlib.ExitStack() as stack:
        for device in on:
            stack.enter_context(torch.autocast(device, enabled=False))
        yield


def ghost_sq_norms(x, g):
    """Squared norms (N,) of g_n^T x_n from x (N, T, d_in) and g (N, T, d_out) without forming
    it: the ghost identity sum_{t,s} (x_t . x_s)(g_t . g_s), in float32 at least with the Gram
    matrices at full precision, plus the bound on its rounding of :mod:`dpcore.rounding`, so
    never below the exact squared norms. Summed over s, then t."""
    x, g = _wide(x), _wide(g)
    with full_precision():
        products = torch.bmm(x, x.transpose(1, 2)).mul_(torch.bmm(g, g.transpose(1, 2)))
    bound = products.diagonal(dim1=1, dim2=2).sqrt().sum(1).square_()
    margin = ghost_margin(x.shape[2] + g.shape[2], x.shape[1], torch.finfo(x.dtype).eps)
    return products.sum(2).sum(1).add_(bound, alpha=margin)


PREFERENCES = ("memory", "time")


#: How :class:`ConvRule` forms per-example weight gradients of stride-1 convolutions:
#: ``"auto"`` (time both forms on the first use of each layer configuration), ``"shifted"``
#: or ``"convolution"`` (:meth:`ConvRule._form`).
CONV_FORM = "auto"
CONV_FORMS = ("auto", "shifted", "convolution")

#: Bytes of one chunk of records in :meth:`ConvRule._shifted_rows_grad`: about the share of
#: a core's L2 cache (2 MiB here) that keeps a chunk's input and backprop resident across the
#: kernel rows (MNIST conv2: 1.56 ms in chunks of 64 records, 1.70 in one of 256).
ROW_CHUNK_BYTES = 2 << 20


def use_ghost(t: int, ghost_width: int, size: int, prefer: str = "memory") -> bool:
    """Mixed ghost norm: per example, a layer with T positions has ghost-norm cost
    T^2 * ``ghost_width`` (d_in + d_out for Linear) and a materialised gradient of ``size``
    (d_in d_out) entries, which costs T * size to form and then makes the clipped sum a cheap
    contraction; the ghost norm needs the book-keeping sum (T * size) instead.

    ``prefer="time"``: ghost iff T^2 * width <= size (the cheaper norm when the materialised
    gradient is kept). ``prefer="memory"``: ghost iff T * width <= size, i.e. iff keeping the
    input and backprop (T * width values) takes no more memory than the gradient (size values);
    the ghost norm then also beats materialising a gradient that is not kept."""
    if prefer == "time":
        return t * t * ghost_width <= size
    return t * ghost_width <= size


def add_contraction(out, c, grads):
    """out += sum_i c_i grads_i (a permuted ``grads`` is contracted as it is stored)."""
    c = c.to(grads.dtype)
    stored = None if grads.is_contiguous() else _as_stored(grads)
    if stored is None:
        out.add_(torch.tensordot(c, grads, dims=1))
        return
    order, view = stored
    rest = [d for d in order if d]  # grads' other axes, in memory order
    summed = torch.matmul(c, view).reshape([grads.shape[d] for d in rest])
    out.add_(summed.permute(sorted(range(len(rest)), key=rest.__getitem__)))


class Rule:
    """How one layer type forms per-example gradients, norms and clipped sums.

    ``grad(module, use, name)`` is the per-example gradient of parameter ``name`` (B, *shape);
    ``sq_norm`` and ``add_weighted_sum`` (``out += sum_i c_i grad_i``) default to materialising
    it (cached in the Use) and are overridden where a cheaper identity exists."""

    subtree = False  # whether the rule forms the parameters of the layer's children too

    def check(self, module: nn.Module, name: str) -> None:
        """Raise if ``module``'s configuration makes per-example gradients undefined."""

    def knows(self, module: nn.Module, attrs) -> bool:
        """Whether parameters ``attrs`` of ``module`` are those the rule forms gradients of (a
        reparametrised layer, e.g. by the hook-based ``weight_norm``, has others)."""
        return set(attrs) <= {"weight", "bias"}

    def forward(self, module, use_list, args, kwargs):
        raise NotImplementedError

    def batch_outputs(self, module, out):
        """The outputs of a call that have the examples on axis 0 (all of them)."""
        return out

    def grad(self, module, use, name):
        raise NotImplementedError

    def cached_grad(self, module, use, name):
        if name not in use.cache:
            use.cache[name] = self.grad(module, use, name)
        return use.cache[name]

    def sq_norm(self, module, use, name, prefer="memory"):
        return row_sq_norms(self.cached_grad(module, use, name))

    def add_weighted_sum(self, module, use, name, c, out) -> None:
        add_contraction(out, c, self.cached_grad(module, use, name))


def _dtype(module):
    """The dtype of a norm layer's parameters (weight, or bias alone)."""
    return (module.weight if module.weight is not None else module.bias).dtype


def _record(use_list, x, dtype, aux=None) -> Use:
    """A new Use of x, kept in the dtype of parameter ``like`` (under autocast, a layer's
    input and backprop may be lower precision than its parameters: per-example gradients,
    norms and sums are formed in the parameters' precision)."""
    use = Use(cast_to(x.detach(), dtype), aux)
    use_list.append(use)
    return use


class LinearRule(Rule):
    @staticmethod
    def _xg(use):
        """x (B, T, d_in) and g (B, T, d_out), or (B, d_in) and (B, d_out) for vectors."""
        x, g = use.x, use.g
        if x.dim() == 2:
            return x, g
        b, t = x.shape[0], math.prod(x.shape[1:-1])
        return x.reshape(b, t, x.shape[-1]), g.reshape(b, t, g.shape[-1])

    def forward(self, module, use_list, args, kwargs):
        (x,) = args
        weight = module.weight
        out = _Linear.apply(_record(use_list, x, weight.dtype), x, weight, module.bias)
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])

    def grad(self, module, use, name):
        x, g = self._xg(use)
        if x.dim() == 2:
            return g if name == "bias" else g[:, :, None] * x[:, None, :]
        if name == "bias":
            return g.sum(1)
        return torch.bmm(g.transpose(1, 2), x)

    def sq_norm(self, module, use, name, prefer="memory"):
        x, g = use.x, use.g
        if x.dim() == 2:  # one position: ||g_i x_i^T||^2 = ||x_i||^2 ||g_i||^2
            g2 = use.cache.get("g2")
            if g2 is None:  # one norm op each (a product and a sum are two)
                g2 = use.cache["g2"] = torch.linalg.vector_norm(g, dim=1).square_()
            if name == "bias":
                return g2
            return torch.linalg.vector_norm(x, dim=1).square_().mul_(g2)
        if name == "bias":  # sum_t g_it, kept: the clipped sum contracts it
            return row_sq_norms(self.cached_grad(module, use, name))
        x, g = self._xg(use)
        t, d_in, d_out = x.shape[1], x.shape[2], g.shape[2]
        if use_ghost(t, d_in + d_out, d_in * d_out, prefer):
            return ghost_sq_norms(x, g)
        return super().sq_norm(module, use, name, prefer)

    def add_weighted_sum(self, module, use, name, c, out) -> None:
        if name in use.cache:
            return add_contraction(out, c, use.cache[name])
        x, g = self._xg(use)
        c = c if c.dtype == g.dtype else c.to(g.dtype)
        if name == "bias":
            out.addmv_((g if g.dim() == 2 else g.sum(1)).t(), c)
            return
        # scale the smaller of x and g by c_i; the product is one ordinary weight gradient
        c = c[:, None] if x.dim() == 2 else c[:, None, None]
        if x.shape[-1] <= g.shape[-1]:
            x = x * c
        else:
            g = g * c
        if x.dim() == 3:
            x, g = x.flatten(0, 1), g.flatten(0, 1)
        out.addmm_(g.t(), x)


class ConvRule(Rule):
    """Conv1d and Conv2d with zero padding of any size (other padding modes and asymmetric
    'same' padding are applied to the input first, as the module itself does)."""

    def __init__(self):
        self._faster: dict[tuple, str] = {}  # layer configuration -> faster form (_form)

    @staticmethod
    def _padding(module, spatial):
        """(explicit F.pad widths or None, symmetric padding for the convolution)."""
        k, d = module.kernel_size, module.dilation
        if isinstance(module.padding, str):
            if module.padding == "valid":
                sides = [(0, 0)] * len(k)
            else:  # "same": total d (k - 1), the extra one on the right as torch does
                sides = [(d_ * (k_ - 1) // 2, d_ * (k_ - 1) - d_ * (k_ - 1) // 2)
                         for k_, d_ in zip(k, d)]
        else:
            sides = [(p, p) for p in module.padding]
        if module.padding_mode == "zeros" and all(lo == hi for lo, hi in sides):
            return None, tuple(lo for lo, _ in sides)
        widths = [w for lo, hi in reversed(sides) for w in (lo, hi)]
        return widths, (0,) * len(k)

    def forward(self, module, use_list, args, kwargs):
        (x,) = args
        widths, padding = self._padding(module, x.dim() - 2)
        if widths is not None:
            mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
            x = F.pad(x, widths, mode=mode)
        use = _record(use_list, x, module.weight.dtype, aux=padding)
        return _Conv.apply(use, x, module.weight, module.bias, module.stride, padding,
                           module.dilation, module.groups)

    @staticmethod
    def _unfolded(module, use):
        """X (B, groups, D, L) and g (B, groups, O, L), D = in/groups * prod(kernel)."""
        x, g, padding = use.x, use.g, use.aux
        if x.dim() == 3:  # Conv1d as a 1-row Conv2d
            x = x.unsqueeze(2)
            conf = dict(kernel_size=(1, module.kernel_size[0]), dilation=(1, module.dilation[0]),
                        padding=(0, padding[0]), stride=(1, module.stride[0]))
        else:
            conf = dict(kernel_size=module.kernel_size, dilation=module.dilation,
                        padding=padding, stride=module.stride)
        b, groups, length = x.shape[0], module.groups, math.prod(g.shape[2:])
        cols = F.unfold(x, **conf).reshape(b, groups, x.shape[1] // groups * math.prod(
            conf["kernel_size"]), length)
        return cols, g.reshape(b, groups, g.shape[1] // groups, length)

    def grad(self, module, use, name):
        """Per-example gradients: the bias's by summing g over positions, the weight's by one
        of two forms (:meth:`_form`)."""
        x, g, w = use.x, use.g, module.weight
        b = x.shape[0]
        if name == "bias":
            return g.flatten(2).sum(-1)
        if b == 0:
            return w.new_zeros((0, *w.shape))
        form = self._form(module, use)
        if form == "shifted":
            return self._shifted_rows_grad(module, use)
        return self._convolution_grad(module, use)

    def _form(self, module, use):
        """``"shifted"`` (:meth:`_shifted_rows_grad`, stride 1 only) or ``"convolution"``
        (:meth:`_convolution_grad`) for this call: :data:`CONV_FORM`, or with ``"auto"`` on the
        CPU, whichever was faster the first time this layer configuration (all but the batch
        size) was seen; each form is timed on its second run, after its set-up. Neither form
        wins everywhere (oneDNN's grouped weight gradient is fast for 3x3 kernels with 8-64
        channels on 16x16 and larger images, shifted rows for 5x5 kernels, few input channels
        or small images: docs/benchmarks-history.md, eleventh session). Other devices take
        ``"convolution"`` under ``"auto"``, as does a traced step unless an eager step timed
        this configuration."""
        if CONV_FORM not in CONV_FORMS:
            raise ValueError(f"dpcore_torch.layers.CONV_FORM must be one of {CONV_FORMS}, "
                             f"got {CONV_FORM!r}")
        if any(s != 1 for s in module.stride):
            return "convolution"
        if CONV_FORM != "auto":
            return CONV_FORM
        if use.x.device.type != "cpu":
            return "convolution"
        key = (type(module), use.x.shape[1:], use.g.shape[1:], module.weight.shape,
               module.dilation, module.groups, use.x.dtype)
        form = self._faster.get(key)
        if form is None and tracing():  # fake tensors: nothing to time
            return "convolution"
        if form is None:
            timings = {}
            for name, make in (("shifted", self._shifted_rows_grad),
                               ("convolution", self._convolution_grad)):
                make(module, use)
                start = time.perf_counter()
                make(module, use)
                timings[name] = time.perf_counter() - start
            form = self._faster[key] = min(timings, key=timings.get)
        return form

    def _convolution_grad(self, module, use):
        """Per-example weight gradients as the weight gradient of one convolution with the
        examples as extra groups: input (1, B C_in, ...), backprop (1, B C_out, ...),
        groups B * groups, so output channel block i sees only example i (or, with one input
        channel, :meth:`_one_channel_grad`)."""
        x, g, w = use.x, use.g, module.weight
        b = x.shape[0]
        if module.groups == 1 and x.shape[1] == 1:
            return self._one_channel_grad(module, use)
        stacked = w.new_empty(1).expand(b * w.shape[0], *w.shape[1:])
        per = torch.ops.aten.convolution_backward(
            g.reshape(1, b * g.shape[1], *g.shape[2:]), x.reshape(1, b * x.shape[1], *x.shape[2:]),
            stacked, None, module.stride, use.aux, module.dilation, False,
            [0] * (x.dim() - 2), b * module.groups, (False, True, False))[1]
        return per.reshape(b, *w.shape)

    @staticmethod
    def _shifted_rows_grad(module, use):
        """Per-example weight gradients of a stride-1 convolution as batched matrix products,
        without unfolding the input. In 2-D with dilation (d_h, d_w), per group:

            grad_i[o, c, r, j] = sum_{p,q} g_i[o, p, q] x_i[c, p + r d_h, q + j d_w].

        The input is copied once shifted by each kernel column, S_i[c, j, u, q] =
        x_i[c, u, q + j d_w] (K_w H Q values per channel, against K_h K_w P Q for the unfolded
        input), and for kernel row r the positions (p, q) are then the rows of a plain matrix
        view of S_i, offset r d_h Q with unit stride: grad_i[:, :, r, :] = g_i S_i^(r), one
        ``bmm`` per kernel row over chunks of examples that fit in a core's cache. The result
        is stored kernel row first (a permuted tensor, which the norms and sums read in place).
        MNIST CNN, B = 256, on 2 Intel cores: conv1 (1 -> 10 channels, 5x5 on 28x28) 0.76 ms
        against 2.2 for the role-swapped convolution, conv2 (10 -> 20) 1.56 ms against 2.9
        for the grouped weight gradient (docs/benchmarks-history.md, eleventh session)."""
        x, g, w = use.x, use.g, module.weight
        if any(use.aux):  # the convolution's symmetric zero padding, made explicit
            x = F.pad(x, [p for p in reversed(use.aux) for _ in range(2)])
        if x.dim() == 3:  # Conv1d as a 2-D convolution with one row
            x, g, (d_h, d_w) = x.unsqueeze(2), g.unsqueeze(2), (1, module.dilation[0])
        else:
            d_h, d_w = module.dilation
        x, g = x.contiguous(), g.contiguous()
        b, c, h, width = x.shape
        o, p, q = g.shape[1:]
        k_h, k_w = (w.shape[2] if w.dim() == 4 else 1), w.shape[-1]
        n, cg, og = b * module.groups, c // module.groups, o // module.groups
        shifted = x.as_strided((b, c, k_w, h, q), (c * h * width, h * width, d_w, width, 1))
        shifted = shifted.contiguous()
        rows = g.reshape(n, og, p * q)
        out = x.new_empty((k_h, n, og, cg * k_w))
        per_record = og * p * q + cg * k_w * (h * q + og)
        chunk = max(1, ROW_CHUNK_BYTES // (per_record * x.element_size()))
        with torch.autocast(x.device.type, enabled=False):  # in x's precision
            for s in range(0, n, chunk):
                e = min(n, s + chunk)
                for r in range(k_h):
                    cols = shifted.as_strided((e - s, p * q, cg * k_w),
                                              (cg * k_w * h * q, 1, h * q),
                                              s * cg * k_w * h * q + r * d_h * q)
                    torch.bmm(rows[s:e], cols, out=out[r, s:e])
        if w.dim() == 3:
            return out[0].view(b, *w.shape)
        return out.view(k_h, b, o, cg, k_w).permute(1, 2, 3, 0, 4)

    @staticmethod
    def _one_channel_grad(module, use):
        """Per-example weight gradients of a convolution with one input channel, as one
        forward convolution with the roles swapped: the examples' inputs are the channels
        (x^T of shape (1, B, ...)), each example's backprop g_i the O filters of its group, the
        module's stride the dilation and its dilation the stride, so output position k is
        sum_l g_i[:, l] x_i[l s + k d - p] = grad_i[:, 0, k] (cropped to the kernel). On an
        Intel CPU with oneDNN this took 2.2 ms against 3.8 for the grouped weight gradient
        (MNIST conv1, B = 256; docs/benchmarks-history.md, ninth session); with more input
        channels the grouped form was faster."""
        x, g, w = use.x, use.g, module.weight
        b, o = x.shape[0], w.shape[0]
        conv = F.conv2d if x.dim() == 4 else F.conv1d
        with torch.autocast(x.device.type, enabled=False):  # in x's precision, not autocast's
            out = conv(x.transpose(0, 1), g.reshape(b * o, 1, *g.shape[2:]),
                       stride=module.dilation, padding=use.aux, dilation=module.stride, groups=b)
        crop = (Ellipsis, *(slice(0, k) for k in module.kernel_size))
        return out[crop].reshape(b, *w.shape)

    def sq_norm(self, module, use, name, prefer="memory"):
        if name == "weight":
            length = math.prod(use.g.shape[2:])
            d = module.in_channels // module.groups * math.prod(module.kernel_size)
            o = module.out_channels // module.groups
            if use_ghost(length, d + o, d * o, prefer):
                cols, g = self._unfolded(module, use)  # (B, G, D, L), (B, G, O, L)
                per_group = ghost_sq_norms(cols.flatten(0, 1).transpose(1, 2),
                                           g.flatten(0, 1).transpose(1, 2))
                return per_group.view(-1, module.groups).sum(1)
        return super().sq_norm(module, use, name, prefer)

    def add_weighted_sum(self, module, use, name, c, out) -> None:
        if name in use.cache:
            return add_contraction(out, c, use.cache[name])
        cg = use.g * c.to(use.g.dtype).reshape(-1, *([1] * (use.g.dim() - 1)))
        if name == "bias":
            out.add_(cg.flatten(2).sum((0, 2)))
            return
        out.add_(torch.ops.aten.convolution_backward(
            cg, use.x, module.weight, None, module.stride, use.aux, module.dilation, False,
            [0] * (use.x.dim() - 2), module.groups, (False, True, False))[1])


#: A 1-D index tensor 0, 1, ..., n - 1 with n at least this is taken for positions shared by
#: every example (n ids drawn uniformly from a vocabulary of at least n would be these with
#: probability at most n^-n, 6e-8 for n = 8).
SHARED_POSITIONS = 8


def check_lookup_table(module, name: str) -> None:
    """Refuse an ``nn.Embedding`` or ``nn.EmbeddingBag`` whose lookups are not per example."""
    kind = type(module).__name__
    if module.scale_grad_by_freq:
        raise ValueError(f"{kind} {name!r} has scale_grad_by_freq=True, which scales each "
                         f"row's gradient by its frequency in the whole batch, so gradients "
                         f"are not per example; construct it with scale_grad_by_freq=False")
    if module.max_norm is not None:
        raise ValueError(f"{kind} {name!r} has max_norm={module.max_norm}, which rescales "
                         f"the rows the batch looks up in place, without noise: the weights "
                         f"would show which ids the private batch held. Construct it with "
                         f"max_norm=None")


class EmbeddingRule(Rule):
    def check(self, module, name):
        check_lookup_table(module, name)

    def forward(self, module, use_list, args, kwargs):
        (indices,) = args
        if (indices.dim() == 1 and indices.numel() >= SHARED_POSITIONS and not tracing()
                and torch.equal(indices, torch.arange(indices.numel(), device=indices.device))):
            t = indices.numel()
            raise NotPerExampleError(
                f"{type(module).__name__} was called on torch.arange({t}), positions shared by "
                f"every example: added to a batch by broadcasting, its gradient is summed over "
                f"the examples, so it is not per example (and a batch of {t} examples would be "
                f"taken for {t} records). Call it on one row of positions per example, "
                f"torch.arange(T).expand(B, T)")
        use = _record(use_list, indices, module.weight.dtype)
        return _Embedding.apply(use, indices, module.weight, module.padding_idx,
                                module.max_norm, module.norm_type, module.sparse)

    @staticmethod
    def _kg(module, use):
        b, t = use.x.shape[0], math.prod(use.x.shape[1:])
        k = use.x.reshape(b, t)
        g = use.g.reshape(b, t, use.g.shape[-1])
        if module.padding_idx is not None:  # the padding row never receives a gradient
            g = g.masked_fill((k == module.padding_idx)[:, :, None], 0)
        return k, g

    def grad(self, module, use, name):
        k, g = self._kg(module, use)
        b, (vocab, d) = k.shape[0], module.weight.shape
        rows = (k + torch.arange(b, device=k.device)[:, None] * vocab).reshape(-1)
        out = torch.zeros(b * vocab, d, dtype=g.dtype, device=g.device)
        return out.index_add_(0, rows, g.reshape(-1, d)).reshape(b, vocab, d)

    def sq_norm(self, module, use, name, prefer="memory"):
        """Only the rows example i touches, ||G_i||^2 = sum_v ||sum_{t: k_t = v} g_t||^2: a
        row looked up once adds ||g_t||^2; the backprop rows of an index the example repeats
        (found by sorting each example's indices) are summed first. Work B T d plus a sort
        of B T indices, against B T^2 d for the ghost identity and B V d for the dense
        gradient; the sums cover only the repeated lookups."""
        k, g = self._kg(module, use)
        g = _wide(g)
        if tracing():
            return self._sorted_sq_norm(k, g)
        row_norms = torch.linalg.vector_norm(g, dim=2)  # (B, T)
        row_sq = row_norms.square()
        ordered, order = k.sort(1)
        repeat = ordered[:, 1:] == ordered[:, :-1]
        if not bool(repeat.any()):
            return row_sq.sum(1)
        in_run = F.pad(repeat, (1, 0)) | F.pad(repeat, (0, 1))  # sorted positions
        repeated = torch.zeros_like(in_run).scatter_(1, order, in_run)  # lookup positions
        examples, positions = repeated.nonzero(as_tuple=True)
        vocab = module.weight.shape[0]
        distinct, which = torch.unique(examples * vocab + k[examples, positions],
                                       return_inverse=True)
        sums = g.new_zeros(distinct.shape[0], g.shape[-1]).index_add_(
            0, which, g[examples, positions])
        # the clipped sum adds these rows in another order: the norm of a sum of n rows gets
        # sum_margin(d, n) times the rows' summed norms (dpcore.rounding)
        norms = row_norms[examples, positions]
        spans = torch.zeros_like(sums[:, 0]).index_add_(0, which, norms)
        counts = torch.zeros_like(spans).index_add_(0, which, torch.ones_like(norms))
        margins = sum_margin(g.shape[-1], counts, torch.finfo(g.dtype).eps)
        bounded = torch.linalg.vector_norm(sums, dim=1).addcmul_(margins, spans).square_()
        once = row_sq.masked_fill_(repeated, 0).sum(1)
        return once.index_add_(0, distinct // vocab, bounded)

    @staticmethod
    def _sorted_sq_norm(k, g):
        """:meth:`sq_norm` in shapes that do not depend on the data (a traced step): each
        example's lookups sorted by index, the backprop rows of each run of equal indices
        summed into slot r of the run (B, T, d) by one scatter, the same margins on runs of
        two or more rows. Work B T d on every lookup, repeated or not."""
        b, t, d = g.shape
        ordered, order = k.sort(1)
        starts = torch.cat([torch.ones_like(ordered[:, :1], dtype=torch.bool),
                            ordered[:, 1:] != ordered[:, :-1]], 1)
        run = starts.long().cumsum(1) - 1  # (B, T): the run of each sorted lookup
        row_norms = torch.linalg.vector_norm(g, dim=2).gather(1, order)
        sums = torch.zeros_like(g).scatter_add_(
            1, run[:, :, None].expand(b, t, d), g.gather(1, order[:, :, None].expand(b, t, d)))
        spans = torch.zeros_like(row_norms).scatter_add_(1, run, row_norms)
        counts = torch.zeros_like(row_norms).scatter_add_(1, run, torch.ones_like(row_norms))
        margins = torch.where(counts > 1, sum_margin(d, counts, torch.finfo(g.dtype).eps), 0)
        return torch.linalg.vector_norm(sums, dim=2).addcmul_(margins, spans).square_().sum(1)

    def add_weighted_sum(self, module, use, name, c, out) -> None:
        if name in use.cache:
            return add_contraction(out, c, use.cache[name])
        k, g = self._kg(module, use)
        cg = (g * c.to(g.dtype)[:, None, None]).reshape(-1, g.shape[-1])
        out.index_add_(0, k.reshape(-1), cg)


class LayerNormRule(Rule):
    def forward(self, module, use_list, args, kwargs):
        (x,) = args
        if x.dim() <= len(module.normalized_shape):
            raise NotPerExampleError(
                f"LayerNorm{tuple(module.normalized_shape)} got an input of shape "
                f"{tuple(x.shape)}: it normalises over axis 0 too, so over the examples of the "
                f"batch; dpcore needs the examples on axis 0 and normalised axes after it")
        use = _record(use_list, x, _dtype(module))
        return _LayerNorm.apply(use, x, module.weight, module.bias,
                                list(module.normalized_shape), module.eps)

    def grad(self, module, use, name):
        g = use.g
        if name == "weight":  # g * xh, in one temporary
            mean, rstd = use.aux
            g = torch.sub(use.x, mean).mul_(rstd).mul_(g)
        inner = tuple(range(1, g.dim() - len(module.normalized_shape)))  # sequence axes
        return g.sum(inner) if inner else g


class GroupNormRule(Rule):
    def forward(self, module, use_list, args, kwargs):
        (x,) = args
        use = _record(use_list, x, _dtype(module))
        return _GroupNorm.apply(use, x, module.weight, module.bias, module.num_groups,
                                module.eps)

    def grad(self, module, use, name):
        g = use.g.reshape(*use.g.shape[:2], math.prod(use.g.shape[2:]))  # (N, C, L); (N, C): L 1
        if name == "bias":
            return g.sum(-1)
        mean, rstd = use.aux
        b, c, k = use.x.shape[0], use.x.shape[1], module.num_groups
        xh = (use.x.reshape(b, k, c // k * g.shape[2]) - mean[..., None]) * rstd[..., None]
        return (g * xh.reshape(g.shape)).sum(-1)


#: Exact module types with a rule (subclasses may override forward, so they take the fallback).
RULES: dict[type, Rule] = {
    nn.Linear: LinearRule(),
    nn.Conv1d: ConvRule(),
    nn.Conv2d: ConvRule(),
    nn.Embedding: EmbeddingRule(),
    nn.LayerNorm: LayerNormRule(),
    nn.GroupNorm: GroupNormRule(),
}
