"""Budget-driven training (Algorithm 1 of Yu, Zhang, Chen): take steps until the next one would
push the ledger's guarantee past (target_epsilon, delta), then stop.

Pricing a long ledger at every step would cost more than the step, so the budget keeps a
*credit*: it prices the ledger once and asks the accountant how many more steps at the next
step's (q, z) fit (:func:`~dpcore.accounting.remaining_steps`); it then spends that credit while
the steps taken are no costlier (q no larger, z no smaller), and prices the ledger afresh when
the credit is spent or a costlier step comes. Every answer is therefore the accountant's own,
with every z rounded down onto its grid (which it does itself for a ledger of many distinct
z): so the finished ledger's epsilon is at most the target whether or not it is rounded.
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
        self.accountant = accountant
        self._credit: list | None = None  # [q, z, steps that fit, steps spent]

    def remaining(self, ledger: Ledger, q: float, noise_multiplier: float) -> int:
        """How many more steps at (q, z) fit in the budget after the steps in ``ledger``."""
        from .accounting import remaining_steps  # scipy.signal and .optimize load slowly

        # priced with every z rounded down onto the accountant's grid, as it prices a ledger
        # with many distinct z (a moving clip): the budget's view is then never below the
        # finished ledger's, and a step with z >= z_0 is never costlier than one at z_0
        return remaining_steps(ledger, q, noise_multiplier, self.target_epsilon, self.delta,
                               accountant=self.accountant, max_groups=0)

    def allows(self, ledger: Ledger, q: float, noise_multiplier: float) -> bool:
        """Whether one more step at (q, z) keeps ``ledger`` within the budget."""
        if not self._covers(q, noise_multiplier) or self._credit[3] >= self._credit[2]:
            self._credit = [q, noise_multiplier, self.remaining(ledger, q, noise_multiplier), 0]
        _, _, fits, spent = self._credit
        return spent < fits

    def spend(self, q: float, noise_multiplier: float) -> None:
        """Account for a step just taken at (q, z)."""
        if self._covers(q, noise_multiplier):
            self._credit[3] += 1
        else:
            self._credit = None

    def _covers(self, q: float, z: float) -> bool:
        return self._credit is not None and q <= self._credit[0] and z >= self._credit[1]
