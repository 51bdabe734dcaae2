"""Taps on Keras layers: during the DP step's forward pass, supported layers save what
:mod:`.layer_grads` needs (their input in canonical form) and expose their pre-activation
output z to the tape, so one backward pass yields g = dL/dz for every tapped layer.

A tap replaces ``layer.call`` (the instance attribute, for the duration of one trace) by a
function computing the same output with the same Keras ops, plus the record. Supported:
``Dense``, ``EinsumDense`` (batch axis first, every axis a batch, position, contracted or
output axis), ``Conv1D``/``Conv2D`` (``groups=1``), ``Embedding``, ``LayerNormalization``
(normalised axes trailing). Subclasses that override ``call``, LoRA and quantized layers are
not tapped: their variables take the vectorized fallback. A layer called several times
contributes all its calls, concatenated along the position axis (sum_t covers every call).
"""

from __future__ import annotations

import abc
import contextlib
import math
from typing import Callable

import keras
import tensorflow as tf
from keras import layers, ops

from . import layer_grads as lg


class CrossExampleLayerError(ValueError):
    """A layer mixes examples of a batch, so per-example gradients are not defined."""


def check_per_example(model: keras.layers.Layer) -> None:
    """Raise :class:`CrossExampleLayerError` for a BatchNormalization layer that trains."""
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if isinstance(layer, layers.BatchNormalization) and layer.trainable:
            raise CrossExampleLayerError(
                f"layer {layer.name!r} (BatchNormalization) normalises with statistics of the "
                f"whole batch, so an example's gradient depends on the other examples and "
                f"clipping it bounds nothing. Replace it with LayerNormalization or "
                f"GroupNormalization, or freeze it (layer.trainable = False runs it in "
                f"inference mode with fixed statistics).")


def check_no_grouped_convolutions(model: keras.layers.Layer) -> None:
    """Raise for a trainable convolution with ``groups`` > 1: no tap takes it, and the
    vectorized fallback cannot either (TensorFlow's pfor has no batched filter gradient of
    a grouped convolution: the step failed after its ledger events were written)."""
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if getattr(layer, "groups", 1) > 1 and layer.trainable_weights and isinstance(
                layer, layers.Conv1D | layers.Conv2D | layers.Conv3D):
            raise ValueError(f"layer {layer.name!r} is a grouped convolution (groups="
                             f"{layer.groups}), whose per-example gradients TensorFlow cannot "
                             f"vectorise: use groups=1, or a DepthwiseConv2D for groups equal "
                             f"to the channels")


def check_no_regularizers(model: keras.layers.Layer) -> None:
    """Raise for layers with regularizers (a layer's ``*_regularizer`` attributes, or a
    weight's own, from ``add_weight``): the DP step differentiates only the per-example
    losses, so a regularization loss would be silently left out."""
    for layer in model._flatten_layers(include_self=True, recursive=True):
        found = [name for name, value in vars(layer).items()
                 if name.endswith("regularizer") and value is not None]
        found += [f"a regularizer on its weight {v.path!r} (add_weight(regularizer=...))"
                  for v in layer._trainable_variables
                  if getattr(v, "regularizer", None) is not None]
        if found:
            raise ValueError(f"layer {layer.name!r} has {', '.join(sorted(found))}; the DP step "
                             f"clips per-example losses only and would ignore it. Remove it "
                             f"(weight decay on the optimizer, e.g. SGD(weight_decay=...), is "
                             f"applied after the private gradient and costs no privacy)")


def _rows(x: tf.Tensor, width: int) -> tf.Tensor:
    """(B, ..., width) -> (B, T, width), the trailing axes of size ``width`` in all (one
    axis, or the several a LayerNormalization normalises), with T static when the other
    axes are."""
    rest = x.shape[1:]
    if all(d is not None for d in rest):
        return tf.reshape(x, [-1, math.prod(rest) // width, width])
    return tf.reshape(x, [tf.shape(x)[0], -1, width])


def grouped_filter_grads(dtype) -> bool:
    """Whether to fold the batch into groups of TensorFlow's filter-gradient op: its oneDNN
    kernel (on by default on many x86 CPUs, though not on the AMD EPYC of the 2026-11-23
    measurements; forced with ``TF_ENABLE_ONEDNN_OPTS=1``, off with ``=0``) runs grouped float32
    convolutions; TensorFlow's own CPU kernels reject groups, and XLA's CPU grouped
    convolutions took 26 s (not ms) per step for the MNIST CNN."""
    try:  # a private module: without it take the portable per-offset path
        from tensorflow.python.util._pywrap_util_port import IsMklEnabled
    except ImportError:  # pragma: no cover
        return False
    return tf.as_dtype(dtype) == tf.float32 and bool(IsMklEnabled()) and not lg.in_xla()


def _activate(layer, z):
    return layer.activation(z) if layer.activation is not None else z


class Recorder:
    """What the tapped layers saved during one forward pass, by layer: their inputs and
    outputs z, and the values they read their variables as.

    A tapped call reads each variable as ``stop_gradient`` of its value, watched by the tape:
    the taps form the gradient of that use per example, so a gradient that reaches the
    variable itself comes from a use outside its layer's call (a weight tied by an op on
    ``layer.embeddings``), which the engine then finds and forms by the fallback; and a
    layer whose calls cannot be tapped (see ``bookkeeping._unfed``) is differentiated through
    the values it read."""

    def __init__(self, tape: tf.GradientTape):
        self.tape = tape
        self.saved: dict[int, list[tuple[object, tf.Tensor]]] = {}
        self.reads: dict[int, list[tuple[object, tf.Tensor]]] = {}

    def add(self, layer, saved, z: tf.Tensor) -> tf.Tensor:
        self.tape.watch(z)
        self.saved.setdefault(id(layer), []).append((saved, z))
        return z

    def read(self, layer, variable) -> tf.Tensor | None:
        """``variable``'s value (as the layer's autocast gives it) for this call, with the
        gradient stopped and the value watched; None stays None."""
        if variable is None:
            return None
        value = tf.stop_gradient(ops.convert_to_tensor(variable))
        self.tape.watch(value)
        self.reads.setdefault(id(layer), []).append((variable, value))
        return value


def _plain(layer, cls) -> bool:
    return (type(layer).call is cls.call and not getattr(layer, "lora_enabled", False)
            and getattr(layer, "quantization_mode", None) is None)


class _Tap(abc.ABC):
    """How one layer type is tapped and how its variables' gradients follow from the tap."""

    cls: type

    def accepts(self, layer) -> bool:
        return isinstance(layer, self.cls) and _plain(layer, self.cls)

    @abc.abstractmethod
    def variables(self, layer) -> list:
        """The layer's trainable variables this tap computes gradients for."""

    @abc.abstractmethod
    def call(self, layer, recorder: Recorder) -> Callable:
        """The replacement of ``layer.call``: the same output, recorded."""

    @abc.abstractmethod
    def grads(self, layer, saved: list, gs: list, mode: str) -> dict:
        """{variable path: gradient object} from the saved inputs and output gradients."""


def _trainable(*variables):
    return [v for v in variables if v is not None and v.trainable]


class DenseTap(_Tap):
    cls = layers.Dense

    def variables(self, layer):
        return _trainable(layer.kernel, layer.bias)

    def call(self, layer, recorder):
        def call(inputs, training=None):
            kernel, bias = recorder.read(layer, layer.kernel), recorder.read(layer, layer.bias)
            z = ops.matmul(inputs, kernel)
            if bias is not None:
                z = ops.add(z, bias)
            return _activate(layer, recorder.add(layer, inputs, z))
        return call

    def grads(self, layer, saved, gs, mode):
        d_in, d_out = layer.kernel.shape
        a = tf.concat([_rows(x, d_in) for x in saved], axis=1)
        g = tf.concat([_rows(gz, d_out) for gz in gs], axis=1)
        if g.shape[1] == 1:  # T = 1: the bias rows are g; one norm and one c_i g_i for both
            bias_rows = tf.reshape(g, [-1, d_out])
            g_sq = lg.row_sq_norms(bias_rows)
        else:
            bias_rows, g_sq = tf.reduce_sum(g, axis=1), None
        out = {}
        if layer.kernel.trainable:
            out[layer.kernel.path] = lg.DenseKernel(a, g, layer.kernel.shape, mode=mode, g_sq=g_sq)
        if layer.bias is not None and layer.bias.trainable:
            out[layer.bias.path] = lg.Materialised(bias_rows, layer.bias.shape, g_sq)
        return out


class EinsumDenseTap(_Tap):
    """``x[b, T..., C...] kernel[C..., O...] -> z[b, T..., O...]`` in any axis order."""

    cls = layers.EinsumDense

    @staticmethod
    def _specs(layer, rank: int | None):
        """Input, kernel and output specs, an ellipsis spelled out for inputs of ``rank``
        (``None``: as one axis, enough to classify the axes)."""
        inputs, output = layer.equation.split("->")
        x_spec, k_spec = inputs.split(",")
        if "..." in x_spec:
            count = 1 if rank is None else rank - len(x_spec.replace("...", ""))
            letters = lg.einsum_letters(count, layer.equation)
            x_spec, output = x_spec.replace("...", letters), output.replace("...", letters)
        return x_spec, k_spec, output

    @staticmethod
    def _structure(x_spec, k_spec, out):
        """(batch, positions, contracted, outputs) letters, or None if the equation has
        another form (e.g. a kernel axis shared with the batch or position axes)."""
        if "..." in k_spec or not x_spec or x_spec[0] != out[0] or x_spec[0] in k_spec:
            return None
        batch = x_spec[0]
        positions = "".join(c for c in x_spec[1:] if c in out and c not in k_spec)
        contracted = "".join(c for c in k_spec if c in x_spec and c not in out)
        outputs = "".join(c for c in k_spec if c in out and c not in x_spec)
        if (set(k_spec) != set(contracted + outputs)
                or set(out) != set(batch + positions + outputs)):
            return None
        return batch, positions, contracted, outputs

    def accepts(self, layer):
        if not super().accepts(layer):
            return False
        return self._structure(*self._specs(layer, None)) is not None

    def variables(self, layer):
        return _trainable(layer.kernel, layer.bias)

    def call(self, layer, recorder):
        def call(inputs, training=None):
            kernel, bias = recorder.read(layer, layer.kernel), recorder.read(layer, layer.bias)
            z = ops.einsum(layer.equation, inputs, kernel)
            if bias is not None:
                z = ops.add(z, bias)
            return _activate(layer, recorder.add(layer, inputs, z))
        return call

    def grads(self, layer, saved, gs, mode):
        x_spec, k_spec, out = self._specs(layer, saved[0].shape.rank)
        batch, positions, contracted, outputs = self._structure(x_spec, k_spec, out)
        size = dict(zip(k_spec, layer.kernel.shape))
        d_in = math.prod(size[c] for c in contracted)
        d_out = math.prod(size[c] for c in outputs)
        a = tf.concat([tf.reshape(tf.einsum(f"{x_spec}->{batch}{positions}{contracted}", x),
                                  [tf.shape(x)[0], -1, d_in]) for x in saved], axis=1)
        g = tf.concat([tf.reshape(tf.einsum(f"{out}->{batch}{positions}{outputs}", gz),
                                  [tf.shape(gz)[0], -1, d_out]) for gz in gs], axis=1)
        result = {}
        if layer.kernel.trainable:
            order = contracted + outputs
            result[layer.kernel.path] = lg.DenseKernel(
                a, g, [size[c] for c in order], perm=[order.index(c) for c in k_spec], mode=mode)
        if layer.bias is not None and layer.bias.trainable:
            bias_letters = out[len(out) - len(layer.bias.shape):]
            kept = "".join(c for c, d in zip(bias_letters, layer.bias.shape) if d != 1)
            rows = tf.add_n([tf.einsum(f"{out}->{batch}{kept}", gz) for gz in gs])
            result[layer.bias.path] = lg.Materialised(rows, layer.bias.shape)
        return result


class ConvTap(_Tap):
    """Conv1D/Conv2D. Materialised per-example kernel gradients (the cheaper choice when T is
    large, as for the MNIST CNN) come from TensorFlow's filter-gradient op with the batch
    folded into channel groups where oneDNN runs it (:func:`grouped_filter_grads`), else from
    one batched matmul per kernel offset (:meth:`_per_offset`). Ghost norms use the layer as
    a matmul of image patches (B, T = output pixels, k_h k_w C_in) with the kernel reshaped
    to (k_h k_w C_in, C_out), formed after the backward pass."""

    cls = (layers.Conv1D, layers.Conv2D)

    def accepts(self, layer):
        return (isinstance(layer, self.cls) and _plain(layer, type(layer))
                and type(layer) in (layers.Conv1D, layers.Conv2D) and layer.groups == 1)

    def variables(self, layer):
        return _trainable(layer.kernel, layer.bias)

    @staticmethod
    def _channels_last(layer, x):
        if layer.data_format == "channels_last":
            return x
        return tf.transpose(x, [0] + list(range(2, x.shape.rank)) + [1])

    def call(self, layer, recorder):
        def call(inputs):
            padding = layer.padding
            if padding == "causal":
                inputs = ops.pad(inputs, layer._compute_causal_padding())
                padding = "valid"
            kernel = recorder.read(layer, layer.kernel)
            z = ops.conv(inputs, kernel, strides=list(layer.strides), padding=padding,
                         dilation_rate=layer.dilation_rate, data_format=layer.data_format)
            if layer.use_bias:
                shape = ((1,) * (layer.rank + 1) + (layer.filters,)
                         if layer.data_format == "channels_last"
                         else (1, layer.filters) + (1,) * layer.rank)
                z = ops.add(z, ops.reshape(recorder.read(layer, layer.bias), shape))
            return _activate(layer, recorder.add(layer, (inputs, padding), z))
        return call

    def _windows(self, layer, x, padding, out_size):
        """The k_h k_w input windows, each (B, T, C_in): x at kernel offset (i, j) for every
        output position, in kernel order (im2col by strided slices; tf.image.extract_patches
        was 10x slower)."""
        x = self._channels_last(layer, x)
        sizes, strides, rates = layer.kernel_size, layer.strides, layer.dilation_rate
        if layer.rank == 1:
            x, sizes, strides, rates = x[:, None], (1, *sizes), (1, *strides), (1, *rates)
            out_size = (1, *out_size)
        if padding == "same":
            pads = [[0, 0]]
            for n, o, k, s, r in zip(x.shape[1:3], out_size, sizes, strides, rates):
                total = max((o - 1) * s + (k - 1) * r + 1 - n, 0)
                pads.append([total // 2, total - total // 2])
            x = tf.pad(x, pads + [[0, 0]])
        batch, channels = tf.shape(x)[0], x.shape[-1]
        windows = []
        for i in range(sizes[0]):
            for j in range(sizes[1]):
                top, left = i * rates[0], j * rates[1]
                window = x[:, top:top + (out_size[0] - 1) * strides[0] + 1:strides[0],
                           left:left + (out_size[1] - 1) * strides[1] + 1:strides[1], :]
                windows.append(tf.reshape(window, [batch, -1, channels]))
        return windows

    def _per_offset(self, layer, x, padding, g):
        """(B, k_h k_w C_in, C_out): the call's per-example kernel gradients as one batched
        (C_in, T) x (T, C_out) matmul per kernel offset, window^T g. For the MNIST CNN's two
        convolutions at B = 256 without oneDNN (2 cores): 9.9 and 9.9 ms, against 38 and 37 ms
        for concatenated windows and one batched matmul, and 18 and 13 ms for TensorFlow's
        own (non-private, summed) filter gradients."""
        windows = self._windows(layer, x, padding, g.shape[1:-1])
        g = _rows(g, layer.filters)
        rows = tf.stack([tf.matmul(w, g, transpose_a=True) for w in windows], axis=1)
        return tf.reshape(rows, [tf.shape(g)[0], -1, layer.filters])

    def _per_example(self, layer, x, padding, g):
        """(k_h k_w C_in, B, C_out): the call's per-example kernel gradients by one filter-gradient
        op, the batch folded into channel groups: input (1, H, W, B C_in), output gradient
        (1, H', W', B C_out), group i = example i (for the MNIST CNN 1.2-1.9x faster than
        im2col and a batched matmul, docs/benchmarks-history.md)."""
        x, g = self._channels_last(layer, x), self._channels_last(layer, g)
        sizes, strides, rates = layer.kernel_size, layer.strides, layer.dilation_rate
        if layer.rank == 1:
            x, g, sizes = x[:, None], g[:, None], (1, *sizes)
            strides, rates = (1, *strides), (1, *rates)
        batch, c_in = tf.shape(x)[0], x.shape[-1]

        def fold(t):  # (B, H, W, C) -> (1, H, W, B C)
            shape = tf.shape(t)
            return tf.reshape(tf.transpose(t, [1, 2, 0, 3]), [1, shape[1], shape[2], -1])

        grads = tf.raw_ops.Conv2DBackpropFilter(
            input=fold(x), filter_sizes=tf.stack([*sizes, c_in, batch * layer.filters]),
            out_backprop=fold(g), strides=[1, *strides, 1], padding=padding.upper(),
            dilations=[1, *rates, 1])
        return tf.reshape(grads, [math.prod(sizes) * c_in, batch, layer.filters])

    def grads(self, layer, saved, gs, mode):
        g_calls = [self._channels_last(layer, gz) for gz in gs]
        g = tf.concat([_rows(gz, layer.filters) for gz in g_calls], axis=1)
        out = {}
        kernel = layer.kernel
        if kernel.trainable:
            d_in = math.prod(kernel.shape[:-1])
            ghost = mode == "ghost" or (mode == "auto" and lg.ghost_is_cheaper(
                g.shape[1], d_in, layer.filters))
            if ghost:
                patches = tf.concat([tf.concat(self._windows(layer, x, padding, gz.shape[1:-1]), -1)
                                     for (x, padding), gz in zip(saved, g_calls)], axis=1)
                out[kernel.path] = lg.DenseKernel(patches, g, kernel.shape, mode="ghost")
            elif not grouped_filter_grads(g.dtype):
                rows = tf.add_n([self._per_offset(layer, x, padding, gz)
                                 for (x, padding), gz in zip(saved, g_calls)])
                out[kernel.path] = lg.Materialised(rows, kernel.shape)
            else:
                rows = tf.add_n([self._per_example(layer, x, padding, gz)
                                 for (x, padding), gz in zip(saved, gs)])
                out[kernel.path] = lg.ConvKernel(rows, kernel.shape)
        if layer.use_bias and layer.bias.trainable:
            out[layer.bias.path] = lg.Materialised(tf.reduce_sum(g, axis=1), layer.bias.shape)
        return out


class EmbeddingTap(_Tap):
    cls = layers.Embedding

    def variables(self, layer):
        return _trainable(layer.embeddings)

    def call(self, layer, recorder):
        def call(inputs):
            ids = inputs if inputs.dtype in ("int32", "int64") else ops.cast(inputs, "int32")
            table = recorder.read(layer, layer.embeddings)
            z = ops.cast(ops.take(table, ids, axis=0), layer.compute_dtype)
            return recorder.add(layer, ids, z)
        return call

    def grads(self, layer, saved, gs, mode):
        ids = tf.concat([tf.reshape(i, [tf.shape(i)[0], -1]) for i in saved], axis=1)
        # id -k is row V - k, as Keras's take reads it (the sums by id would drop it)
        ids = tf.where(ids < 0, ids + layer.input_dim, ids)
        g = tf.concat([_rows(gz, layer.output_dim) for gz in gs], axis=1)
        table = layer.embeddings
        return {table.path: lg.EmbeddingTable(ids, g, layer.input_dim, mode=mode)}


class LayerNormalizationTap(_Tap):
    """y = xhat * gamma + beta with xhat = (x - mean) / sqrt(var + eps) over the normalised
    (trailing) axes; with ``rms_scaling`` Keras uses xhat = x / sqrt(var + eps) and no beta."""

    cls = layers.LayerNormalization

    def variables(self, layer):
        return _trainable(layer.gamma, layer.beta)

    @staticmethod
    def _axes(layer, rank):
        axes = sorted(a % rank for a in ([layer.axis] if isinstance(layer.axis, int)
                                         else layer.axis))
        if axes != list(range(rank - len(axes), rank)):
            raise ValueError(f"layer {layer.name!r}: LayerNormalization over axes {layer.axis} "
                             f"of rank-{rank} inputs; DP clipping supports trailing axes only "
                             f"(e.g. axis=-1); use mode='vectorized' for this model")
        return axes

    def call(self, layer, recorder):
        def call(inputs):
            x = ops.cast(inputs, "float32") if inputs.dtype in ("float16", "bfloat16") else inputs
            axes = self._axes(layer, x.shape.rank)
            mean, var = tf.nn.moments(x, axes=axes, keepdims=True)
            inv = tf.math.rsqrt(var + layer.epsilon)
            xhat = x * inv if layer.rms_scaling else (x - mean) * inv
            gamma, beta = recorder.read(layer, layer.gamma), recorder.read(layer, layer.beta)
            y = xhat if gamma is None else xhat * tf.cast(
                tf.reshape(gamma, x.shape[axes[0]:]), x.dtype)
            if beta is not None and not layer.rms_scaling:
                y = y + tf.cast(tf.reshape(beta, x.shape[axes[0]:]), x.dtype)
            return ops.cast(recorder.add(layer, (xhat, len(axes)), y), layer.compute_dtype)
        return call

    def grads(self, layer, saved, gs, mode):
        width = math.prod((layer.gamma if layer.gamma is not None else layer.beta).shape)
        xhat = tf.concat([_rows(x, width) for x, _ in saved], axis=1)
        g = tf.concat([_rows(gz, width) for gz in gs], axis=1)
        out = {}
        if layer.gamma is not None and layer.gamma.trainable:
            out[layer.gamma.path] = lg.Materialised(tf.reduce_sum(xhat * g, axis=1),
                                                    layer.gamma.shape)
        if layer.beta is not None and layer.beta.trainable:
            offset = tf.reduce_sum(g, axis=1)  # rms_scaling ignores beta: its gradient is 0
            out[layer.beta.path] = lg.Materialised(
                tf.zeros_like(offset) if layer.rms_scaling else offset, layer.beta.shape)
        return out


TAPS = (DenseTap(), EinsumDenseTap(), ConvTap(), EmbeddingTap(), LayerNormalizationTap())


def tap_for(layer) -> _Tap | None:
    """The tap of a supported layer that owns trainable variables, else None."""
    for tap in TAPS:
        if tap.accepts(layer) and tap.variables(layer):
            return tap
    return None


@contextlib.contextmanager
def tapped(plan: dict, recorder: Recorder):
    """Replace ``call`` of every layer in ``plan`` (layer id -> (layer, tap)) for the block."""
    try:
        for layer, tap in plan.values():
            layer.__dict__["call"] = tap.call(layer, recorder)
        yield recorder
    finally:
        for layer, _ in plan.values():
            layer.__dict__.pop("call", None)
