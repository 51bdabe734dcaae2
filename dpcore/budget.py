"""Budget-driven training (Algorithm 1 of Yu, Zhang, Chen): take steps until the next one would
push the ledger's guarantee past (target_epsilon, delta), then stop.

Pricing a long ledger at every step would cost more than the step, so the budget keeps a
*credit*: it prices the ledger once and asks the accountant how many more steps at the next
step's (q, z) fit (:func:`~dpcore.accounting.remaining_steps`); it then spends that credit while
the steps taken are no costlier (q no larger, z no smaller), and prices the ledger afresh when
the credit is spent or a costlier step comes. Every answer is therefore the accountant's own.
A ledger of more than ``DEFAULT_MAX_GROUPS`` (256) distinct (q, z) (a clip that moves at every step)
is priced with every z rounded down onto the accountant's grid: from the step that takes the
ledger there, the budget prices with that rounding too (a step with z >= z_0 then still costs
no more than one at z_0), so the finished ledger's epsilon is at most the target either way.
"""

from __future__ import annotations

from . import _validation as check
from .ledger import Ledger


class BudgetExhaustedError(RuntimeError):
    """The next step would exceed the privacy budget; nothing of it was recorded or released."""


class PrivacyBudget:
    """A target (epsilon, delta) for one run's ledger, priced by ``accountant`` ("pld", "rdp").

    Use one budget per ledger, and tell it of every step taken (:meth:`spend`); the
    :class:`~dpcore.PrivateAggregator` does both when given ``budget=``.
    """

    def __init__(self, target_epsilon: float, delta: float, *, accountant: str = "pld"):
        self.target_epsilon = check.non_negative("target_epsilon", target_epsilon)
        self.delta = check.delta("delta", delta)
        if accountant not in ("pld", "rdp"):  # dpcore.accounting's, not imported here: slow
            raise ValueError(f"accountant must be 'pld' or 'rdp', got {accountant!r}")
        self.accountant = accountant
        self._credit: list | None = None  # [q, z, steps that fit, steps spent, rounded]
        self._seen: set = set()  # the distinct (q, z) of the ledger's finished steps
        self._read = 0  # the index of the ledger's first event not yet read into _seen

    def remaining(self, ledger: Ledger, q: float, noise_multiplier: float, *,
                  rounded: bool = False) -> int:
        """How many more steps at (q, z) fit in the budget after the steps in ``ledger``
        (``rounded``: with every z rounded down onto the accountant's grid)."""
        from .accounting import remaining_steps  # scipy.signal and .optimize load slowly
        from .accounting.rdp import DEFAULT_MAX_GROUPS

        return remaining_steps(ledger, q, noise_multiplier, self.target_epsilon, self.delta,
                               accountant=self.accountant,
                               max_groups=0 if rounded else DEFAULT_MAX_GROUPS)

    def allows(self, ledger: Ledger, q: float, noise_multiplier: float) -> bool:
        """Whether one more step at (q, z) keeps ``ledger`` within the budget."""
        from .accounting.rdp import DEFAULT_MAX_GROUPS
        from .accounting.steps import check_step

        step = check_step(q, noise_multiplier)
        q, noise_multiplier = step.q, step.noise_multiplier
        # the (q, z) the ledger holds, a resumed ledger's too: a step may release fewer
        # groups than it was priced with (an extra mechanism every other step), and so have
        # a larger z; the step in progress and this one may each add one more
        steps, self._read = ledger.steps_from(self._read)
        self._seen.update((s.q, s.noise_multiplier) for s in steps)
        rounded = len(self._seen) + 2 > DEFAULT_MAX_GROUPS
        if (not self._covers(q, noise_multiplier) or self._credit[3] >= self._credit[2]
                or rounded > self._credit[4]):
            fits = self.remaining(ledger, q, noise_multiplier, rounded=rounded)
            self._credit = [q, noise_multiplier, fits, 0, rounded]
        _, _, fits, spent, _ = self._credit
        return spent < fits

    def spend(self, q: float, noise_multiplier: float) -> None:
        """Account for a step just taken at (q, z)."""
        from .accounting.steps import check_step

        step = check_step(q, noise_multiplier)
        q, noise_multiplier = step.q, step.noise_multiplier
        if self._covers(q, noise_multiplier):
            self._credit[3] += 1
        else:
            self._credit = None

    def _covers(self, q: float, z: float) -> bool:
        return self._credit is not None and q <= self._credit[0] and z >= self._credit[1]
