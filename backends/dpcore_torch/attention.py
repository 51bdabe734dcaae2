"""nn.MultiheadAttention (``batch_first=True``): per-example gradients through its Linear maps.

The ``torch.func`` fallback would replay the whole layer per example (its dropout with the
draws of the forward pass, :mod:`dpcore_torch.draws`). The attention rule instead runs the
layer's forward itself, with the formulas of
``F.multi_head_attention_forward``, every parameter entering through a Linear map:

    in-projection   q = x_q W_q^T + b_q,  k = x_k W_k^T + b_k,  v = x_v W_v^T + b_v
    attention       o = softmax(q k^T / sqrt(d_head) + mask) v, per head (dropout on the weights)
    out-projection  y = o W_o^T + b_o

W_q, W_k, W_v are the row blocks of ``in_proj_weight`` (or ``q_proj_weight``, ... when
``kdim``/``vdim`` differ) and b_q, b_k, b_v those of ``in_proj_bias``; blocks applied to one
tensor (self-attention: query, key and value are one tensor) form one map. Each map is a
Linear over an example's positions, so its per-example gradient, (ghost) norm and book-keeping
sum are :class:`dpcore_torch.layers.LinearRule`'s. A parameter of several maps has their blocks
of rows side by side, so its squared norm is the sum of the blocks'. Masks, dropout and the
attention itself are ordinary autograd between the maps. A layer with ``bias_k``/``bias_v`` or
``add_zero_attn`` takes the ``torch.func`` fallback.
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F
from torch import nn

from .layers import (LinearRule, Rule, Use, _Linear, birth, cast_to, first_reached, keep_rows,
                     parameter)

_LINEAR = LinearRule()
_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)
_ALL = slice(None)


class _Map:
    """One Linear map of a call: its Use, and the (parameter, rows) of its weight and of its
    bias (None without one)."""

    __slots__ = ("use", "weight", "bias")

    def __init__(self, use: Use, weight: tuple, bias: tuple | None):
        self.use, self.weight, self.bias = use, weight, bias


class AttentionCall:
    """One call of a MultiheadAttention layer: its in- and out-projection maps."""

    __slots__ = ("maps", "batch", "born", "cache")

    def __init__(self, batch: int):
        self.maps: list[_Map] = []
        self.batch, self.born, self.cache = batch, birth(), {}

    def pieces(self, parameter) -> list:
        """(``"weight"`` or ``"bias"``, rows, Use) of every map the backward pass reached
        that uses ``parameter`` (a map not reached contributes zero)."""
        return [(kind, at[1], m.use) for m in self.maps if m.use.g is not None
                for kind, at in (("weight", m.weight), ("bias", m.bias))
                if at is not None and at[0] is parameter]

    def release(self) -> None:
        for m in self.maps:
            m.use.release()
        self.maps, self.cache = [], {}

    def keep_rows(self, keep) -> None:
        for m in self.maps:
            m.use.keep_rows(keep)
        self.cache = {k: keep_rows(t, keep) for k, t in self.cache.items()}

    @property
    def batch_size(self) -> int:
        return self.batch

    @property
    def reached_at(self) -> int | None:
        first = first_reached(m.use for m in self.maps)
        return None if first is None else first.reached_at

    @property
    def backward(self) -> int | None:
        """The backward pass that reached one of the maps first."""
        first = first_reached(m.use for m in self.maps)
        return None if first is None else first.backward

    @property
    def reached(self) -> bool:
        return self.reached_at is not None


def _project(call: AttentionCall, x, weight, weight_at, bias, bias_at):
    """x W^T + b through a recorded Linear map; x (B, T, d_in) -> (B, T, d_out)."""
    use = Use(cast_to(x.detach(), weight.dtype))
    call.maps.append(_Map(use, weight_at, bias_at))
    return _Linear.apply(use, x, weight, bias).reshape(*x.shape[:-1], weight.shape[0])


def _in_projection(module, call, inputs):
    """(q, k, v) of ``inputs`` (query, key, value), one map per run of blocks applied to one
    tensor (of one packed weight)."""
    e, packed = module.embed_dim, module._qkv_same_embed_dim
    names = ("in_proj_weight",) * 3 if packed else ("q_proj_weight", "k_proj_weight",
                                                     "v_proj_weight")
    runs: list[list[int]] = []
    for j in range(3):
        if runs and packed and inputs[j] is inputs[runs[-1][-1]]:
            runs[-1].append(j)
        else:
            runs.append([j])
    out = []
    for run in runs:
        lo, hi = run[0] * e, (run[-1] + 1) * e
        weight = parameter(module, names[run[0]])
        w_rows = slice(lo, hi) if packed else _ALL
        bias, bias_at = module.in_proj_bias, None
        if bias is not None:
            bias, bias_at = bias[lo:hi], (bias, slice(lo, hi))
        y = _project(call, inputs[run[0]], weight[w_rows], (weight, w_rows), bias, bias_at)
        out += y.split(e, dim=-1)
    return out


def _mask(attn_mask, key_padding_mask, b, h, t, s):
    """The additive mask (broadcastable to (B, H, T, S)) of canonical (float) masks, or None;
    shapes as PyTorch checks them."""
    mask = None
    if attn_mask is not None:
        if attn_mask.dim() == 2 and tuple(attn_mask.shape) == (t, s):
            mask = attn_mask
        elif attn_mask.dim() == 3 and tuple(attn_mask.shape) == (b * h, t, s):
            mask = attn_mask.view(b, h, t, s)
        else:
            raise RuntimeError(f"attn_mask of shape {tuple(attn_mask.shape)}: expected "
                               f"({t}, {s}) or ({b * h}, {t}, {s})")
    if key_padding_mask is not None:
        if tuple(key_padding_mask.shape) != (b, s):
            raise RuntimeError(f"key_padding_mask of shape {tuple(key_padding_mask.shape)}: "
                               f"expected ({b}, {s})")
        padding = key_padding_mask.view(b, 1, 1, s)
        mask = padding if mask is None else mask + padding
    return mask


def _attend(module, call, query, key, value, key_padding_mask, need_weights, attn_mask,
            average_attn_weights, is_causal):
    """MultiheadAttention's forward on batch-first inputs (``F.multi_head_attention_forward``
    with the layer's options), through recorded maps."""
    (b, t, e), s, h = query.shape, key.shape[1], module.num_heads
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask, mask_name="key_padding_mask",
        other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
        target_type=query.dtype)
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint (PyTorch's rule)")
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None
    else:
        attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None,
                                      other_name="", target_type=query.dtype,
                                      check_other=False)
        is_causal = is_causal and key_padding_mask is None
    q, k, v = _in_projection(module, call, (query, key, value))
    mask = _mask(attn_mask, key_padding_mask, b, h, t, s)
    d = e // h
    q, k, v = (z.reshape(b, n, h, d).transpose(1, 2) for z, n in ((q, t), (k, s), (v, s)))
    p = module.dropout if module.training else 0.0
    weights = None
    if need_weights:
        scores = torch.matmul(q * math.sqrt(1.0 / d), k.transpose(-2, -1))
        weights = torch.softmax(scores if mask is None else scores + mask, dim=-1)
        if p > 0.0:
            weights = F.dropout(weights, p=p)
        o = torch.matmul(weights, v)
        if average_attn_weights:
            weights = weights.mean(dim=1)
    else:
        o = F.scaled_dot_product_attention(q, k, v, mask, p, is_causal)
    o = o.transpose(1, 2).reshape(b, t, e)
    out = module.out_proj
    bias_at = None if out.bias is None else (out.bias, _ALL)
    y = _project(call, o, out.weight, (out.weight, _ALL), out.bias, bias_at)
    # laid out as PyTorch's layer returns it (sequence-major, transposed), so that a dropout
    # drawn on it afterwards (nn.TransformerEncoderLayer's) draws the same mask
    return y.transpose(0, 1).contiguous().transpose(0, 1), weights


class AttentionRule(Rule):
    """nn.MultiheadAttention with ``batch_first=True`` on batched (B, T, E) inputs; its unit
    holds the layer's parameters and ``out_proj``'s."""

    subtree = True
    PARAMETERS = {"in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight",
                  "v_proj_weight", "out_proj.weight", "out_proj.bias"}

    def knows(self, module, attrs):
        return (module.bias_k is None and module.bias_v is None and not module.add_zero_attn
                and set(attrs) <= self.PARAMETERS)

    def forward(self, module, use_list, args, kwargs):
        bound = _SIGNATURE.bind(module, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        query, key, value = a["query"], a["key"], a["value"]
        if not all(isinstance(x, torch.Tensor) and x.dim() == 3 for x in (query, key, value)):
            raise ValueError("MultiheadAttention got unbatched inputs; dpcore needs batched "
                             "(batch, sequence, feature) tensors, one example per row")
        call = AttentionCall(query.shape[0])
        use_list.append(call)
        return _attend(module, call, query, key, value, a["key_padding_mask"],
                       a["need_weights"], a["attn_mask"], a["average_attn_weights"],
                       a["is_causal"])

    @staticmethod
    def _pieces(module, call, name):
        """(parameter, its pieces, whether their rows are disjoint). Rows used by two maps
        (a parameter tied within the layer: ``k_proj_weight = q_proj_weight``) add up
        their gradients, so their norms do not add."""
        p = parameter(module, name)
        pieces = call.pieces(p)
        spans = sorted(rows.indices(p.shape[0])[:2] for _, rows, _ in pieces)
        return p, pieces, all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))

    def grad(self, module, call, name):
        p, pieces, _ = self._pieces(module, call, name)
        out = p.new_zeros((call.batch, *p.shape))
        for kind, rows, use in pieces:
            out[:, rows] += _LINEAR.grad(module, use, kind)
        return out

    def sq_norm(self, module, call, name, prefer="memory"):
        p, pieces, disjoint = self._pieces(module, call, name)
        if not disjoint:
            return super().sq_norm(module, call, name, prefer)
        total = p.new_zeros(call.batch)
        for kind, _, use in pieces:  # blocks of distinct rows: norms add
            total = total + _LINEAR.sq_norm(module, use, kind, prefer)
        return total

    def add_weighted_sum(self, module, call, name, c, out) -> None:
        _, pieces, disjoint = self._pieces(module, call, name)
        if not disjoint:
            return super().add_weighted_sum(module, call, name, c, out)
        for kind, rows, use in pieces:
            _LINEAR.add_weighted_sum(module, use, kind, c, out[rows])


#: Exact module types with the attention rule.
ATTENTION_RULES: dict[type, Rule] = {nn.MultiheadAttention: AttentionRule()}
