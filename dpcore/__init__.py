"""dpcore: differentially private averages and training from one framework-free core.

The core imports no framework; backends (``numpy`` here, ``torch``, ``jax``, ``tensorflow`` and
third parties') register through the ``dpcore`` entry points and are loaded on first use.
"""

import importlib

from .adaptive import QuantileClipping
from .aggregator import PrivateAggregator
from .allocation import flat, grouped, per_layer
from .backend import Backend
from .budget import BudgetExhaustedError, PrivacyBudget
from .ledger import Ledger, LedgerError, SamplingEvent, Step, SumQueryEvent, read_ledger
from .plugins import available_backends, get_backend
from .queries import Group, Mechanism, effective_noise_multiplier, noise_multiplier_left
from .sampling import Buckets, PoissonSampler, poisson_sample
from .schedules import ClipSchedule

__version__ = "0.1.0"

__all__ = [
    "Backend", "Buckets", "BudgetExhaustedError", "ClipSchedule", "Group", "Ledger", "LedgerError",
    "Mechanism", "PoissonSampler", "PrivacyBudget", "PrivateAggregator", "QuantileClipping",
    "SamplingEvent", "Step", "SumQueryEvent", "available_backends",
    "effective_noise_multiplier", "flat", "get_backend", "grouped", "noise_multiplier_left",
    "per_layer", "poisson_sample", "read_ledger",
]


def __getattr__(name: str):
    """``dpcore.accounting`` (which imports SciPy) is imported on first use."""
    if name == "accounting":
        return importlib.import_module(".accounting", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
