"""Row statistics of tensors with the examples on axis 0, and their comparison: what the
independence check (:mod:`dpcore_torch.independence`) keeps of a pass instead of its tensors.
Per row, the projection on a fixed pseudo-random direction and the norm, in float64; rows
whose norm is below FLOOR of the largest are compared against it (gradients that underflow).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_flatten

FLOOR = 1e-6  # rows with norms below this fraction of the largest are compared to it
_ROOT_SEEDS = 1 << 20  # the model's outputs' directions (a layer's output's: its index)
_INPUT_SEEDS = 1 << 21  # the layers' inputs' directions


def tensor_leaves(out) -> list:
    """The leaves of ``out``, dataclasses (a model's output class) opened; a PackedSequence
    left out (its rows are time steps, and its sorting indices a permutation of the batch,
    not rows of examples)."""
    leaves = []
    for leaf in tree_flatten(out, is_leaf=lambda o: isinstance(o, PackedSequence))[0]:
        if isinstance(leaf, PackedSequence):
            continue
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            leaves += tensor_leaves([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])
        else:
            leaves.append(leaf)
    return leaves


def batch_tensors(out, b: int) -> list[torch.Tensor]:
    """The floating-point tensors of ``out`` with gradients and the b examples on axis 0."""
    return [t for t in tensor_leaves(out)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
            and t.dim() > 0 and t.shape[0] == b]


def has_reentrant_checkpoint(roots) -> bool:
    """Whether the graph holds a reentrant ``torch.utils.checkpoint`` (which refuses
    ``torch.autograd.grad``)."""
    seen, stack = set(), [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CheckpointFunctionBackward":
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


def row_statistics(t: torch.Tensor, seed: int) -> torch.Tensor:
    """(B, 2) float64: each row's projection on a fixed pseudo-random direction (``seed``)
    and its norm. Scaling a row by a power of two scales both exactly."""
    flat = t.detach().reshape(t.shape[0], -1).double()
    direction = torch.randn(flat.shape[1], generator=torch.Generator().manual_seed(seed),
                            dtype=torch.float64).to(flat.device)
    return torch.stack([flat @ direction, flat.norm(dim=1)], 1).cpu()


def deviating(got, want, tolerance: float):
    """Rows where statistics ``got`` differ from ``want`` (B, 2) by more than ``tolerance``
    of the row's norm, raised to FLOOR of the largest (rows near zero underflow); a NaN where
    the other has none differs; (rows, worst, its norm)."""
    both_nan = got.isnan() & want.isnan()
    deviation = torch.where(both_nan | (got == want), 0, (got - want).abs()).amax(1)
    norms = want[:, 1].nan_to_num(0)
    norms = norms.clamp(min=FLOOR * float(norms.max())) if norms.numel() else norms
    bad = ~(deviation <= tolerance * norms)
    if not bool(bad.any()):
        return None
    worst = int(torch.where(bad, deviation.nan_to_num(float("inf")), -1).argmax())
    return bad.nonzero()[:, 0].tolist(), float(deviation[worst]), float(norms[worst])


def changed_buffers(left: dict, after: dict) -> list:
    """The keys of the buffers in ``after`` that differ from ``left``'s at all (reruns from
    one snapshot repeat bit for bit on the CPU; a count beside a mean must not hide it)."""
    changed = []
    for key, got in after.items():
        want = left.get(key)
        if got is None or want is None:
            continue
        if got.shape != want.shape or not (
                torch.equal(got, want) or got.is_floating_point()
                and torch.allclose(got, want, rtol=0, atol=0, equal_nan=True)):
            changed.append(key)
    return changed


def tolerance_for(tolerance: float, t: torch.Tensor) -> float:
    """``tolerance``, or float16's precision for its tensors (its narrow range: gradients
    scaled by 2^-8 fall into its subnormals)."""
    return max(tolerance, torch.finfo(torch.float16).eps) if t.dtype == torch.float16 \
        else tolerance


class PassStatistics:
    """What a pass gave: its course (which units had inputs and outputs of which shapes) and
    the row statistics of the layers' inputs and outputs and of the model's outputs (not the
    tensors, which the first pass must not keep alive until the rerun)."""

    def __init__(self, roots, layers, inputs):
        self.course = ([(id(unit), t.shape) for unit, t in layers], [t.shape for t in roots],
                       [(id(unit), t.shape, t.dtype) for unit, t in inputs])
        self.inputs = [row_statistics(t, _INPUT_SEEDS + k) for k, (_, t) in enumerate(inputs)]
        self.layers = [row_statistics(t, k) for k, (_, t) in enumerate(layers)]
        self.roots = [row_statistics(t, _ROOT_SEEDS + k) for k, t in enumerate(roots)]
        self.grads = None  # u(v) at the layers' outputs
