"""nn.RNN, nn.GRU, nn.LSTM and their cells: per-example gradients through their Linear maps.

``torch.func`` cannot vmap PyTorch's fused recurrent kernels, so the recurrent rule runs the
layer's recurrence itself, with the module's own parameters and PyTorch's cell formulas, and
every parameter enters through a Linear map (a PackedSequence is padded first and each
example's steps are masked to its length):

    input map       a_t = W_ih x_t + b_ih        (all t at once: a sequence Linear)
    recurrent map   r_t = W_hh h_{t-1} + b_hh    (one step at a time)
    projection      h_t = W_hr m_t               (LSTM with ``proj_size``)

    RNN   h_t = act(a_t + r_t)
    LSTM  i, f, u, o = sigma, sigma, tanh, sigma of the four chunks of a_t + r_t;
          c_t = f c_{t-1} + i u;  m_t = o tanh(c_t);  h_t = m_t, or W_hr m_t
    GRU   (a^r, a^z, a^n), (r^r, r^z, r^n) the chunks of a_t, r_t;  s = sigma(a^r + r^r),
          z = sigma(a^z + r^z), n = tanh(a^n + s r^n);  h_t = (1 - z) n + z h_{t-1}

Each map keeps its inputs and, from the one ordinary backward pass, the backprops of its
outputs, stacked over the T steps: per example a Linear over T positions, so its per-example
gradient sum_t g_t u_t^T, its (ghost) norm and its book-keeping sum are those of
:class:`dpcore_torch.layers.LinearRule`. The recurrent map needs no backprop of its own: r_t
enters the cell only through a_t + r_t, except the GRU's candidate chunk, which enters as
s r^n, so

    d loss / d r_t = d loss / d a_t           (RNN, LSTM, and the GRU's r and z chunks)
    d loss / d r^n_t = s_t * d loss / d a^n_t  (the GRU's candidate chunk),

and r_t is a plain F.linear on the detached parameters (the input map's backprop, kept once
for all steps, gives the recurrent map's); only the states h_{t-1} (and the GRU's s_t) are
kept per step. A layer with L layers and D directions has L D input
maps, L D recurrent maps and, with ``proj_size``, L D projections; parameter
``weight_hh_l1_reverse`` is the weight of map ``hh_l1_reverse``. A cell (nn.RNNCell, nn.GRUCell,
nn.LSTMCell) is one step with maps ``ih`` and ``hh``; called at every step of a loop, it is a
layer used several times, whose per-example gradient the engine sums over the calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from .independence import probing
from .layers import LinearRule, Rule, Use, _Linear, birth, cast_to, first_reached, reach

_LINEAR = LinearRule()


class _Steps:
    """A Linear map applied one step at a time: the inputs of each step and, once the backward
    pass has reached them, the backprops of its outputs (the LSTM's projection)."""

    __slots__ = ("xs", "gs", "reached_at", "backward")

    def __init__(self):
        self.xs, self.gs, self.reached_at, self.backward = [], [], None, None

    def apply(self, u, weight, bias):
        self.xs.append(cast_to(u.detach(), weight.dtype))
        self.gs.append(None)
        return _StepLinear.apply(self, len(self.xs) - 1, u, weight, bias)

    def stacked(self) -> Use:
        """One :class:`Use` with x (B, T, d_in) and g (B, T, d_out); steps the backward pass
        did not reach contribute zero backprop; g is None if it reached none."""
        use = Use(torch.stack(self.xs, 1))
        use.reached_at, use.backward = self.reached_at, self.backward
        reached = [g for g in self.gs if g is not None]
        if reached:
            zero = torch.zeros_like(reached[0])
            use.g = torch.stack([zero if g is None else g for g in self.gs], 1)
        return use


class _Recurrence:
    """The recurrent map r_t = W_hh h_{t-1} + b_hh of one layer and direction (``steps``
    steps) or of one cell call (``steps`` None): its inputs h_{t-1} by step, and its backprop
    taken from the input map's ``source`` Use (times the GRU's reset gates s_t on the
    candidate chunk, see the module docstring)."""

    __slots__ = ("source", "xs", "gates")

    def __init__(self, source: Use, steps: int | None = None):
        self.source, self.xs, self.gates = source, [None] * (steps or 1), None

    def apply(self, t: int, h, weight, bias):
        """r_t from h = h_{t-1}, autograd reaching h only (the parameters are detached)."""
        self.xs[t] = cast_to(h.detach(), weight.dtype)
        return F.linear(h, weight.detach(), None if bias is None else bias.detach())

    def gate(self, t: int, s) -> None:
        """Record the GRU's reset gate s_t of step t."""
        if self.gates is None:
            self.gates = [None] * len(self.xs)
        self.gates[t] = s.detach()

    @property
    def reached_at(self) -> int | None:
        return self.source.reached_at

    @property
    def backward(self) -> int | None:
        return self.source.backward

    def stacked(self) -> Use:
        """One :class:`Use`: x (B, T, h) (a cell: (B, h)) and g from the input map's."""
        cell = self.source.x.dim() == 2
        use = Use(self.xs[0] if cell else torch.stack(self.xs, 1))
        use.reached_at, g = self.source.reached_at, self.source.g
        if g is not None and self.gates is not None:  # GRU: s_t on the candidate chunk
            s = self.gates[0] if cell else torch.stack(self.gates, 1)
            n = s.shape[-1]
            g = torch.cat([g[..., :-n], g[..., -n:] * cast_to(s, g.dtype)], -1)
        use.g = g
        return use


class _StepLinear(torch.autograd.Function):
    """F.linear for one step; its backward stores the step's backprop and returns the input's
    gradient only (None for the parameters, as every instrumented layer does)."""

    @staticmethod
    def forward(ctx, steps, k, u, weight, bias):
        ctx.steps, ctx.k = steps, k
        ctx.save_for_backward(weight)
        return F.linear(u, weight, bias)

    @staticmethod
    def backward(ctx, g):
        weight = ctx.saved_tensors[0]
        steps, g_w = ctx.steps, cast_to(g, weight.dtype)
        if not probing():
            steps.gs[ctx.k] = g_w if steps.gs[ctx.k] is None else steps.gs[ctx.k] + g_w
            reach(steps)
        gu = g.matmul(cast_to(weight, g.dtype)) if ctx.needs_input_grad[2] else None
        return None, None, gu, None, None


class RecurrentCall:
    """One call of a recurrent layer: its maps by name (``ih_l0``, ``hh_l0``, ...), each a
    :class:`Use` (input maps), or a :class:`_Recurrence` or :class:`_Steps` (stacked into a
    Use on first read)."""

    __slots__ = ("maps", "batch", "born")

    def __init__(self, batch: int):
        self.maps, self.batch, self.born = {}, batch, birth()

    def part(self, name: str) -> Use:
        use = self.maps[name]
        if isinstance(use, (_Steps, _Recurrence)):
            use = self.maps[name] = use.stacked()
        return use

    def release(self) -> None:
        for use in self.maps.values():
            if isinstance(use, Use):
                use.release()
        self.maps = {}

    def keep_rows(self, keep) -> None:
        for name in list(self.maps):
            self.part(name).keep_rows(keep)

    @property
    def batch_size(self) -> int:
        return self.batch

    @property
    def reached_at(self) -> int | None:
        """When the backward pass first reached one of the maps (None: never)."""
        first = first_reached(self.maps.values())
        return None if first is None else first.reached_at

    @property
    def backward(self) -> int | None:
        """The backward pass that reached one of the maps first."""
        first = first_reached(self.maps.values())
        return None if first is None else first.backward

    @property
    def reached(self) -> bool:
        return self.reached_at is not None


class RecurrentRule(Rule):
    """nn.RNN, nn.GRU and nn.LSTM (``batch_first=True``) on (B, T, d) tensors or packed
    sequences, and their cells on (B, d); parameter ``weight_hh_l0_reverse`` is the weight of
    map ``hh_l0_reverse``."""

    def knows(self, module, attrs):
        names = getattr(module, "_flat_weights_names",
                        ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))
        return set(attrs) <= set(names)

    def forward(self, module, use_list, args, kwargs):
        cell = isinstance(module, nn.RNNCellBase)
        x, hx = _inputs(module, args, kwargs, 2 if cell else 3)
        packed = lengths = None
        if isinstance(x, PackedSequence):
            packed, (x, lengths) = x, pad_packed_sequence(x, batch_first=True)
        call = RecurrentCall(x.shape[0])
        use_list.append(call)
        if cell:
            return _step(module, call, x, hx)
        out, state = _run(module, call, x, hx, lengths)
        return (out if packed is None else _repacked(out, lengths, packed)), state

    def batch_outputs(self, module, out):
        """A cell's outputs; a layer's output sequence unless packed (the hidden states have
        the examples on axis 1, a packed sequence's data has them on none)."""
        if isinstance(module, nn.RNNCellBase):
            return out
        return out[0] if isinstance(out[0], torch.Tensor) else ()

    @staticmethod
    def _part(use, attr):
        """(``weight`` or ``bias``, the map's Use) of parameter ``attr``."""
        kind, name = attr.split("_", 1)
        return kind, use.part(name)

    def grad(self, module, use, name):
        kind, part = self._part(use, name)
        if part.g is None:
            p = getattr(module, name)
            return p.new_zeros((use.batch, *p.shape))
        return _LINEAR.grad(module, part, kind)

    def cached_grad(self, module, use, name):
        kind, part = self._part(use, name)
        if part.g is None:
            return self.grad(module, use, name)
        return _LINEAR.cached_grad(module, part, kind)

    def sq_norm(self, module, use, name, prefer="memory"):
        kind, part = self._part(use, name)
        if part.g is None:
            return getattr(module, name).new_zeros(use.batch)
        return _LINEAR.sq_norm(module, part, kind, prefer)

    def add_weighted_sum(self, module, use, name, c, out) -> None:
        kind, part = self._part(use, name)
        if part.g is not None:
            _LINEAR.add_weighted_sum(module, part, kind, c, out)


def _inputs(module, args, kwargs, dims: int):
    """(x: (B, T, d) for a layer, ``dims`` = 3, or (B, d) for a cell, initial state or None)
    from the call's arguments."""
    names = ("input", "hx")
    bound = dict(zip(names, args), **kwargs)
    x, hx = bound.get("input"), bound.get("hx")
    kind = type(module).__name__
    if isinstance(x, PackedSequence) and dims == 3:
        return x, hx
    if not isinstance(x, torch.Tensor) or x.dim() != dims or (dims == 3 and x.shape[1] == 0):
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        want = "(batch, time, feature) tensor (batch_first=True) with at least one step" \
            if dims == 3 else "(batch, feature) tensor"
        raise ValueError(f"{kind} got input {shape}; dpcore needs a batched {want}, one "
                         f"example per row")
    return x, hx


def _repacked(out, lengths, like: PackedSequence) -> PackedSequence:
    """Padded ``out`` (B, T, h) packed as ``like`` is: same batch sizes and example order."""
    order = like.sorted_indices
    if order is not None:
        out, lengths = out.index_select(0, order), lengths[order.cpu()]
    data = pack_padded_sequence(out, lengths, batch_first=True).data
    return PackedSequence(data, like.batch_sizes, like.sorted_indices, like.unsorted_indices)


def _run(module, call: RecurrentCall, x, hx, lengths=None):
    """The module's forward, (output, h_n) or (output, (h_n, c_n)), through recorded maps.
    With ``lengths`` (B,) (a packed input, padded), example i's state stops changing after
    its last step (forward) or starts changing at it (reverse), as PyTorch's packed kernels
    do; its padded steps get no backprop, so they add nothing to its gradients."""
    lstm, gru = _kind(module)
    layers, dirs = module.num_layers, 2 if module.bidirectional else 1
    b, steps = x.shape[0], x.shape[1]
    proj = getattr(module, "proj_size", 0)
    if hx is None:
        h0 = x.new_zeros(layers * dirs, b, proj or module.hidden_size)
        c0 = x.new_zeros(layers * dirs, b, module.hidden_size) if lstm else None
    else:
        h0, c0 = hx if lstm else (hx, None)
    live = None if lengths is None else (
        torch.arange(steps)[None, :] < lengths[:, None]).to(x.device)
    h_n, c_n = [], []
    for layer in range(layers):
        outputs = []
        for direction in range(dirs):
            suffix = f"_l{layer}" + ("_reverse" if direction else "")
            param = lambda name: getattr(module, name + suffix, None)  # noqa: E731
            w_ih = param("weight_ih")
            use = call.maps["ih" + suffix] = Use(cast_to(x.detach(), w_ih.dtype))
            a = _Linear.apply(use, x, w_ih, param("bias_ih")).reshape(b, steps, w_ih.shape[0])
            hh = call.maps["hh" + suffix] = _Recurrence(use, steps)
            hr = None
            if proj:
                hr = call.maps["hr" + suffix] = _Steps()
            state = h0[layer * dirs + direction], (c0[layer * dirs + direction] if lstm else None)
            ys = [None] * steps
            a_t = a.unbind(1)  # one backward node for all steps (a[:, t] would be one each)
            w_hh, b_hh, w_hr = param("weight_hh"), param("bias_hh"), param("weight_hr")
            for t in (reversed(range(steps)) if direction else range(steps)):
                new, gate = _cell(module, a_t[t], hh.apply(t, state[0], w_hh, b_hh), state,
                                  lstm, gru)
                if gate is not None:
                    hh.gate(t, gate)
                if hr is not None:
                    new = hr.apply(new[0], w_hr, None), new[1]
                if live is not None:
                    new = tuple(None if n is None else torch.where(live[:, t, None], n, s)
                                for n, s in zip(new, state))
                state = new
                ys[t] = state[0]
            outputs.append(torch.stack(ys))
            h_n.append(state[0])
            c_n.append(state[1])
        # (B, T, d) with PyTorch's layout, (T, B, d) in memory, so that dropout (between
        # layers, or the user's after the layer) draws the masks PyTorch's own run would
        x = (outputs[0] if dirs == 1 else torch.cat(outputs, 2)).transpose(0, 1)
        if module.dropout and module.training and layer < layers - 1:
            x = F.dropout(x, module.dropout, training=True)
    h_n = torch.stack(h_n)
    return x, ((h_n, torch.stack(c_n)) if lstm else h_n)


def _kind(module) -> tuple[bool, bool]:
    """(is an LSTM, is a GRU), for layers and cells."""
    return isinstance(module, (nn.LSTM, nn.LSTMCell)), isinstance(module, (nn.GRU, nn.GRUCell))


def _step(module, call: RecurrentCall, x, hx):
    """A cell's forward, h or (h, c), through recorded maps ``ih`` and ``hh``."""
    lstm, gru = _kind(module)
    if hx is None:
        h = x.new_zeros(x.shape[0], module.hidden_size)
        c = h if lstm else None
    else:
        h, c = hx if lstm else (hx, None)
    ih = call.maps["ih"] = Use(cast_to(x.detach(), module.weight_ih.dtype))
    hh = call.maps["hh"] = _Recurrence(ih)
    a = _Linear.apply(ih, x, module.weight_ih, module.bias_ih)
    (h, c), gate = _cell(module, a, hh.apply(0, h, module.weight_hh, module.bias_hh), (h, c),
                         lstm, gru)
    if gate is not None:
        hh.gate(0, gate)
    return (h, c) if lstm else h


def _cell(module, a, r, state, lstm, gru):
    """One step of PyTorch's cell: ((h, c), s) from the input and recurrent maps' outputs,
    s the GRU's reset gate (None for the others)."""
    h, c = state
    if lstm:
        i, f, u, o = (a + r).chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(u)
        return (torch.sigmoid(o) * torch.tanh(c), c), None
    if gru:
        (ar, az, an), (rr, rz, rn) = a.chunk(3, 1), r.chunk(3, 1)
        s, z = torch.sigmoid(ar + rr), torch.sigmoid(az + rz)
        n = torch.tanh(an + s * rn)
        return ((1 - z) * n + z * h, None), s
    act = torch.tanh if module.nonlinearity == "tanh" else torch.relu
    return (act(a + r), None), None


#: Exact module types with the recurrent rule.
RECURRENT_RULES: dict[type, Rule] = {
    kind: RecurrentRule() for kind in (nn.RNN, nn.GRU, nn.LSTM, nn.RNNCell, nn.GRUCell,
                                       nn.LSTMCell)}
