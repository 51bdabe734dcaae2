"""Privacy accounting: from a ledger (or a list of steps) to an (epsilon, delta) guarantee.

Conventions shared by every function here (see ``docs/accounting.md``):

* neighbouring relation: add or remove one record; sampling: Poisson with rate q;
* a step (q, z) is one Gaussian sum query of noise multiplier z on a Poisson sample
  (several queries on one sample are one query with Eq. (1)'s z; the ledger does that);
* q = 0 and z = inf cost nothing; z = 0 (noiseless) makes epsilon infinite;
* the reported epsilon (delta) is an upper bound on the exact one, never below it.
"""

from .calibrate import calibrate_noise_multiplier, calibrate_sampling_rate, calibrate_steps
from .composition import (advanced_composition, amplify_by_subsampling, basic_composition,
                          best_composition)
from .guarantee import (ACCOUNTANTS, Guarantee, delta_for_epsilon, epsilon, guarantee,
                        make_accountant, remaining_steps)
from .pld import PLDAccountant
from .rdp import RDPAccountant, delta_from_rdp, epsilon_from_rdp, rdp_subsampled_gaussian

__all__ = [
    "ACCOUNTANTS", "Guarantee", "PLDAccountant", "RDPAccountant",
    "advanced_composition", "amplify_by_subsampling", "basic_composition", "best_composition",
    "calibrate_noise_multiplier", "calibrate_sampling_rate", "calibrate_steps",
    "delta_for_epsilon", "delta_from_rdp", "epsilon", "epsilon_from_rdp", "guarantee",
    "make_accountant", "rdp_subsampled_gaussian", "remaining_steps",
]
