"""A check, on the model's first two training forward passes (the second with the weights the
first step moved: mixing behind a zero-initialised head does nothing at first), that it keeps
the examples of the batch apart.

The engine forms example i's gradient from the input x_i and the backprop g_i that reach row
i of each instrumented layer. That is example i's own gradient only if neither depends on
another example: x_i on example i's data alone, and g_i = sum_j d l_j / d out_i on example
i's loss alone. A statistic of the batch (``h - h.mean(0)``, detached or not, a BatchNorm
written by hand, inputs normalised by the batch), a reference row (``h - h[:1]``), a
reordering or pairing of the batch, a hook or custom autograd Function that moves gradient
rows or scales them by a batch statistic, a straight-through term ``h + (m - m.detach())``,
or a layer applied to B rows that are not the examples, breaks this: each example's
"gradient" would carry other records' data, and clipping would not bound any one record's
influence.

Rows are compared through statistics (:mod:`dpcore_torch.row_statistics`): per row of a
tensor, its projection on a fixed pseudo-random direction and its norm (float64). The check
has two parts:

1. *Backward*, at the end of the pass. With u(v) = J^T v the gradient that a cotangent v on
   the model's outputs sends to a layer's output, the model keeps the examples apart iff
   u(c v) = c u(v) row by row for every per-row scaling c (row j of u depends on row j of v
   alone). A random v is sent back through the retained graph, then twice more scaled by
   random powers of two per row (exact in floating point); each row's statistics must scale
   by its own factor (to 1e-6 of the row's norm). Mixing between rows i and j passes a
   scaling only if c_i = c_j: for one pair of rows, with 17 factors and two scalings, in
   1 / 289 of the cases; for anything that touches many rows, essentially never.
2. *Rerun*, when the engine is next cleared (the private optimizer and
   :func:`dpcore_torch.step.private_grads` clear it once the step's sums are formed, before
   anything is released; the pass's graph and the step's kept tensors are freed by then,
   so the rerun's graph is the only one held). The rows are split at random into two halves,
   SPLITS times; for each half, the pass runs again (same parameters, random state, buffers,
   generators held by the modules, training modes and autocast; inputs as passed) with
   every row of the other half given the input of one row of this half (floating inputs
   times FACTORS[split]: a copy changes no statistic every row shares, such as a maximum
   each image reaches). In this half's rows
   every layer's input and output (what its per-example gradient reads: a layer whose weight
   is zero shows mixing in its input only) and the model's outputs must be unchanged (to
   1e-5 of the row's norm on the CPU, whose kernels repeat a row exactly; two ulps of 16-bit
   floats elsewhere), and, in the first split, u(v). This sees what carries no gradient
   (detached statistics, inputs normalised by the batch) and backward passes that scale
   rows by statistics of others. One pair of rows mixed without gradient goes unseen when
   the two rows fall in the same half in every split: for a given model and batch size (the
   splits are fixed), 1 pair in 16; mixing of more rows, essentially never. If a rerun
   leaves the buffers otherwise than the pass did (a statistic of the batch kept in state),
   the batch runs once more from each: what it computes must not change, or later steps
   would read this batch's records (a running mean read before its update); a statistic
   that no pass reads passes.

Rows whose norm is below row_statistics.FLOOR of the largest are compared against it (gradients that
underflow); float16 tensors to float16's precision (gradients scaled by 2^-8 reach its
subnormals).

Gradients are read by hooks on the layers' outputs, only their row statistics kept, so the
check holds no more than a backward pass does. The engine's book-keeping ignores its
backward passes (:func:`probing`) and drops the rerun's layer calls; the recording of a
fallback call around the first part does not see it (:mod:`dpcore_torch.draws`); its random
numbers come from a generator of its own, so the user's random streams are unchanged. Not
seen: mixing inside the loss (the model's outputs are probed; the loss is the user's), and
mixing that only later batches or weights trigger.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from .draws import unobserved
from .row_statistics import (PassStatistics, batch_tensors, changed_buffers, deviating,
                             has_reentrant_checkpoint, row_statistics, tensor_leaves,
                             tolerance_for)
from .snapshot import Snapshot, buffers

BACKWARD_TOLERANCE = 1e-6
RERUN_TOLERANCE = 1e-5
SCALINGS = 2  # scaled backward passes; factors 2^e, e uniform in -8..8
SPLITS = 4  # random splits of the batch into halves for the rerun
FACTORS = (1.0, 2.0, -1.0, 0.5)  # per split: the replaced rows' floating inputs, source times
BATCHES = 2  # checked passes: the first, and the next with the weights the first step moved
_active = False
_rerunning = False


class NotPerExampleError(ValueError):
    """The model contains a layer whose output for one example depends on other examples."""


def probing() -> bool:
    """Whether the backward pass running is the check's (book-keeping must ignore it)."""
    return _active


def rerunning() -> bool:
    """Whether the check is running the model again on a changed batch (a layer that
    releases statistics of the step's batch must reuse them, not release again)."""
    return _rerunning


@contextlib.contextmanager
def _running_again():
    global _rerunning
    previous, _rerunning = _rerunning, True
    try:
        yield
    finally:
        _rerunning = previous


@contextlib.contextmanager
def _probing():
    global _active
    previous, _active = _active, True
    try:
        yield
    finally:
        _active = previous


def _forward_unchecked(module, reason: str, stacklevel: int) -> None:
    """Warn that the check of ``module`` saw its gradients only, for ``reason``."""
    warnings.warn(f"dpcore could check only the gradients of {type(module).__name__} for "
                  f"mixing of the examples, not its forward pass: {reason}. Make sure nothing "
                  f"in the model computes statistics of the batch", stacklevel=stacklevel + 1)


class Probe:
    """Waits on the engine's model for a forward pass with gradients and a batch of at least
    two examples, and checks that one (see the module docstring). ``units`` and ``leaves``
    (the trainable parameters) are the engine's; ``names`` maps a unit's module to its name
    in the model; ``recording()`` tells whether the engine records the calls made now (not in
    a replay, gradients on)."""

    def __init__(self, units, leaves, names: dict[int, str], recording):
        self.units, self.leaves, self.names, self.recording = units, leaves, names, recording
        # waiting -> capturing -> waiting, pending (a rerun to make) or done; rerun within
        self.state = "waiting"
        self._captured: list = []  # (unit, args, kwargs, output) in call order
        self._hooks: list = []
        self._counts: dict[int, int] = {}
        self._before: Snapshot | None = None
        self._first: PassStatistics | None = None
        self._batch = 0
        self._cotangents: list = []
        self._rerun_output = None
        self._rng = torch.Generator().manual_seed(0)
        self.checked = 0  # passes checked
        self._left = None  # (buffers the pass left, others a rerun left, the keys changed)
        self._checked_at = None  # the parameters' versions when the first check was made

    # ------------------------------------------------------------------ capture
    def start(self, module, args, kwargs) -> None:
        """Root forward pre-hook: keep the pass's inputs and state, capture every unit call's
        inputs and outputs."""
        if self.state == "capturing":  # a pass that raised (or a nested call): start again
            self._remove()
            self.state = "waiting"
        if self.state != "waiting" or not self.recording() or self._unmoved():
            return
        with torch._C.DisableTorchFunction():  # unseen by a recording fallback call around it
            self._before = Snapshot(module, args, kwargs)
        self._capture_calls(module)
        self.state = "capturing"

    def _versions(self) -> tuple:
        return tuple(p._version for p in self.leaves)

    def _unmoved(self) -> bool:
        """Whether no parameter has changed since the first check (a micro-batch of the same
        step): the second is made with the weights the first step moved."""
        return self._checked_at is not None and self._versions() == self._checked_at

    def _capture_calls(self, root) -> None:
        """Capture the inputs and outputs of every unit's calls but the model's own."""
        self._captured = []
        self._counts = {id(unit): len(unit.calls) for unit in self.units}
        for unit in self.units:
            if unit.module is not root:
                self._hooks.append(unit.module.register_forward_hook(self._capture(unit),
                                                                     with_kwargs=True))

    def _capture(self, unit):
        @torch.compiler.disable  # not traced into a compiled module's call
        def capture(module, args, kwargs, out):
            self._captured.append((unit, args, kwargs, out))
        return capture

    def _remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _outputs(self, module, output, b: int):
        """The model's outputs, [(unit, a layer's output)] and [(unit, a layer's input)] (any
        tensor, what its per-example gradient reads) with the b examples on axis 0."""
        captured, self._captured = self._captured, []
        root = next((unit for unit in self.units if unit.module is module), None)
        roots = batch_tensors(output if root is None else root.batch_outputs(output), b)
        layers = [(unit, t) for unit, _, _, out in captured
                  for t in batch_tensors(unit.batch_outputs(out), b)]
        inputs = [(unit, t) for unit, args, kwargs, _ in captured
                  for t in tensor_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == b]
        return roots, layers, inputs

    def finish(self, module, args, kwargs, output) -> None:
        """Root forward hook: check this pass if it can be, else wait for the next. In the
        rerun, keep its output as the hooks before this one left it, as in the pass."""
        if self.state == "rerun":
            self._rerun_output = output
        if self.state != "capturing":
            return
        self._remove()
        self.state = "waiting"
        # unseen by a recording fallback call around it (the model's own, say)
        with torch._C.DisableTorchFunction(), unobserved():
            self._before.keep_changed_parameters()
            sizes = {call.batch_size for unit in self.units
                     for call in unit.calls[self._counts[id(unit)]:]}
            if len(sizes) != 1 or next(iter(sizes)) < 2:
                self._captured, self._before = [], None
                return  # no layer call, batches of several sizes (the engine refuses), B < 2
            self.state = "done"
            try:
                self._check_backward(module, output, sizes.pop())
            finally:
                if self.state != "pending":
                    self._before, self._cotangents = None, []

    # ------------------------------------------------------------------ part 1
    def _check_backward(self, module, output, b: int) -> None:
        roots, layers, inputs = self._outputs(module, output, b)
        if not roots:
            warnings.warn(
                f"dpcore could not check that {type(module).__name__} keeps the examples of a "
                f"batch apart: none of its outputs is a tensor with the batch's {b} examples "
                f"on axis 0 (a model that returns only its loss, say). Make sure nothing in "
                f"the model mixes examples (statistics of the batch)", stacklevel=3)
            return
        if has_reentrant_checkpoint(roots):
            return
        self._batch = b
        self._cotangents = [torch.randn(t.shape, generator=self._rng, dtype=t.dtype).to(t.device)
                            for t in roots]
        try:
            grads = self._backprops(roots, layers, retain=True)
        except RuntimeError as error:
            if "donated buffer" not in str(error):
                raise
            if not self.checked:
                raise RuntimeError(
                    f"dpcore cannot check that the compiled {type(module).__name__} keeps the "
                    f"examples apart: its compiled backward donates buffers the check's "
                    f"backward passes need. Set torch._functorch.config.donated_buffer = "
                    f"False before compiling, or pass check_independence=False") from error
            warnings.warn(f"dpcore checked the compiled {type(module).__name__} on its first "
                          f"pass only: the backward compiled for this pass donates buffers the "
                          f"check needs", stacklevel=3)
            return
        for _ in range(SCALINGS):
            scale = torch.randint(-8, 9, (b,), generator=self._rng).double().exp2()
            scaled = self._backprops(roots, layers, retain=True, scale=scale)
            mixed = None
            for (unit, t), got, want in zip(layers, scaled, grads):  # the last: nearest
                if got is not None and want is not None:
                    found = deviating(got, want * scale[:, None],
                                      tolerance_for(BACKWARD_TOLERANCE, t))
                    if found is not None:
                        mixed = unit, found
            if mixed is not None:
                unit, (rows, deviation, norm) = mixed
                raise self._error(
                    f"the gradient reaching the output of {self._name(unit)} (the last layer "
                    f"to show it) does not scale with each example's own gradient at the "
                    f"model's outputs: rows {rows[:8]} of {b} receive gradient from other "
                    f"rows (by {deviation:.3g}, against {norm:.3g}); something after that "
                    f"layer moves gradient between examples")
        self._first = PassStatistics(roots, layers, inputs)
        self._first.grads = grads
        self.state = "pending"

    def _backprops(self, roots, layers, *, retain: bool, scale=None) -> list:
        """Row statistics of u(v) at each layer output, its rows scaled by ``scale`` (None
        where the outputs do not depend on it), read by hooks."""
        found = [None] * len(layers)

        def reader(k):
            def read(g):
                found[k] = row_statistics(g, k)
            return read

        leaves = [p for p in self.leaves if p.requires_grad]  # (some frozen since)
        if not leaves:
            return found
        cotangents = self._cotangents if scale is None else [
            v * scale.to(v.device, v.dtype).reshape(-1, *[1] * (v.dim() - 1))
            for v in self._cotangents]
        handles = [t.register_hook(reader(k)) for k, (_, t) in enumerate(layers)]
        try:
            with _probing():  # through every unit to its parameters; nothing is returned
                torch.autograd.grad(roots, leaves, cotangents, retain_graph=retain,
                                    allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        return found

    # ------------------------------------------------------------------ part 2
    def rerun_if_pending(self, module) -> None:
        """Make the pending reruns (the engine's ``clear``). Nothing they record stays."""
        if self.state != "pending":
            return
        before, first, self._before, self._first = self._before, self._first, None, None
        self.state = "done"
        try:
            reason = before.unrestorable()
            if reason is not None:
                _forward_unchecked(module, f"{reason}, so it cannot be run again from where it "
                                   f"began", stacklevel=3)
                return
            self._left = None
            for split in range(SPLITS):
                if not self._rerun_split(module, before, first, split):
                    return
            self._check_state_read(module, before)
            self.checked += 1
            if self.checked < BATCHES:
                self.state, self._checked_at = "waiting", self._versions()
        finally:
            self._cotangents, self._left = [], None

    def _rerun_split(self, module, before: Snapshot, first: PassStatistics, split: int) -> bool:
        """The reruns of one random split of the batch into halves (the gradients compared
        in the first split only); whether there is something to replace."""
        b = self._batch
        order = torch.randperm(b, generator=self._rng).tolist()
        halves = [sorted(order[:(b + 1) // 2]), sorted(order[(b + 1) // 2:])]
        inputs, found = zip(*[before.replaced(b, kept, FACTORS[split]) for kept in halves])
        if split == 0:
            if not any(found):
                _forward_unchecked(module, f"none of its inputs is a tensor or list with the "
                                   f"batch's {b} examples on axis 0 (a time-major tensor, or "
                                   f"an object dpcore cannot rebuild, say)", stacklevel=5)
                return False
            if all(i is None for i in inputs):  # the rows are all alike: the next pass
                self.state = "waiting"
                return False
        for kept, replaced in zip(halves, inputs):
            if replaced is None:
                continue
            try:
                try:
                    self._rerun(module, before, first, replaced, kept, gradients=split == 0,
                                factor=FACTORS[split])
                except NotPerExampleError:
                    raise
                except Exception:  # scaled inputs the model refuses (indices kept in floats)
                    copies = before.replaced(b, kept)[0]
                    if FACTORS[split] == 1 or copies is None:
                        raise
                    self._rerun(module, before, first, copies, kept, gradients=False,
                                factor=1.0)
            except NotPerExampleError:
                raise
            except Exception as error:  # the model refuses copies of its own rows
                _forward_unchecked(module, f"it raised {type(error).__name__} "
                                   f"({str(error)[:200]}) on the batch with some examples "
                                   f"replaced by copies of others", stacklevel=5)
                return False
        return True

    @contextlib.contextmanager
    def _again(self, module, before: Snapshot, inputs, start: dict | None = None):
        """Run the pass again on ``inputs`` (args, kwargs) from ``before`` (its buffers
        ``start`` if given); yields (PassStatistics, roots, layers, inputs, the buffers it leaves)
        while its graph lives. Nothing it records stays."""
        args, kwargs = inputs
        self.state = "rerun"
        self._capture_calls(module)
        try:
            with before.restored(module, start):
                try:
                    with _running_again():
                        module(*args, **kwargs)
                finally:
                    self._remove()
                output, self._rerun_output = self._rerun_output, None
                roots, layers, found = self._outputs(module, output, self._batch)
                yield PassStatistics(roots, layers, found), roots, layers, found, buffers(module)
        finally:
            self.state = "done"
            for unit in self.units:  # the rerun's calls: not part of any step
                new, unit.calls[self._counts[id(unit)]:] = unit.calls[self._counts[id(unit)]:], []
                for call in new:
                    call.release()

    def _rerun(self, module, before: Snapshot, first: PassStatistics, replaced, kept, *,
               gradients: bool, factor: float) -> None:
        """Run the pass again with the ``replaced`` (args, kwargs); the rows ``kept`` must
        not change. Keep the first buffers a rerun leaves otherwise than the pass."""
        b = self._batch
        left = buffers(module)  # as the pass left them
        with self._again(module, before, replaced) as (again, roots, layers, inputs, after):
            replacement = "a copy of" if factor == 1 else f"{factor} times"
            when = (f"when the examples other than {kept[:8]} of {b} were replaced (by "
                    f"{replacement} one of them)")
            if first.course != again.course:
                raise self._error(f"the forward pass took another course (other layer calls "
                                  f"or shapes) {when}; if a shape follows the batch (padding "
                                  f"to its longest sequence), pad to a fixed length, e.g. "
                                  f"pad_packed_sequence(..., total_length=T)")
            self._compare(first.inputs, again.inputs, inputs, kept, when, "the input of",
                          " (the first layer input to change)")
            self._compare(first.layers, again.layers, layers, kept, when, "the output of",
                          " (the first layer output to change)")
            self._compare(first.roots, again.roots, [(None, t) for t in roots], kept, when,
                          "the model's output")
            if gradients:
                self._compare(first.grads, self._backprops(roots, layers, retain=False),
                              layers, kept, when, "the gradient reaching the output of",
                              " (the last to change)", last=True)
            changed = changed_buffers(left, after)
            if changed and self._left is None:
                self._left = (left, {key: t.clone() for key, t in after.items()
                                     if t is not None}, changed)

    def _check_state_read(self, module, before: Snapshot) -> None:
        """If a rerun left buffers otherwise than the pass (a statistic of the batch), run
        the batch again from each: what it computes must not change (a running mean read by
        later steps would carry this batch's records into them)."""
        if self._left is None:
            return
        left, other, changed = self._left
        names = {id(m): name for name, m in module.named_modules()}
        state = [f"{names.get(key, '?')}.{name}" for key, name in changed][:4]
        with self._again(module, before, before.copied(), left) as (want, roots, layers, *_):
            grads = self._backprops(roots, layers, retain=False)
        with self._again(module, before, before.copied(), other) as (got, roots, layers,
                                                                     inputs, _):
            every = list(range(self._batch))
            when = (f"when the batch ran again from the buffers {state} that a batch with "
                    f"other records left (a statistic of the batch kept for later steps)")
            self._compare(want.inputs, got.inputs, inputs, every, when, "the input of")
            self._compare(want.layers, got.layers, layers, every, when, "the output of")
            self._compare(want.roots, got.roots, [(None, t) for t in roots], every, when,
                          "the model's output")
            self._compare(grads, self._backprops(roots, layers, retain=False), layers, every,
                          when, "the gradient reaching the output of", last=True)

    def _compare(self, first, second, entries, kept, when: str, what: str, which: str = "",
                 *, last: bool = False) -> None:
        """Raise if the statistics ``second`` of the rerun's ``entries`` ((unit, tensor); unit
        None for the model's outputs) differ from ``first``'s in rows ``kept``, naming the
        first that does (the ``last``)."""
        changed = None
        for want, got, (unit, t) in zip(first, second, entries):
            if want is None or got is None:
                continue
            tolerance = tolerance_for(RERUN_TOLERANCE, t) if t.device.type == "cpu" else max(
                RERUN_TOLERANCE, 2 * torch.finfo(t.dtype).eps)
            found = deviating(got[kept], want[kept], tolerance)
            if found is not None:
                changed = unit, found
                if not last:
                    break
        if changed is not None:
            unit, (rows, deviation, norm) = changed
            where = what if unit is None else f"{what} {self._name(unit)}{which}"
            raise self._error(
                f"{where} changed in the rows of examples {[kept[r] for r in rows][:8]} of "
                f"{self._batch} by {deviation:.3g} (against a norm of {norm:.3g}) {when}")

    def _name(self, unit) -> str:
        return f"{type(unit.module).__name__} {self.names.get(id(unit.module), '?')!r}"

    @staticmethod
    def _error(finding: str) -> NotPerExampleError:
        return NotPerExampleError(
            f"the model mixes the examples of a batch: {finding}. The cause may be a "
            f"statistic of the batch (h - h.mean(0), detached or not, inputs normalised by the "
            f"batch), a reference row, a reordering or pairing of the batch, a hook or "
            f"autograd Function that moves or rescales gradient rows, a layer applied to a "
            f"tensor whose rows are not the examples, or a statistic of the batch kept in a "
            f"buffer (a running mean) that later steps read. Each example's gradient would "
            f"depend on other records, and clipping would not bound it. Remove the mixing; if "
            f"the model's inputs or outputs have B rows that are not the examples, or the "
            f"statistic is kept for monitoring only, pass check_independence=False")
