"""Privacy accounting: from a ledger (or a list of steps) to an (epsilon, delta) guarantee."""

from .rdp import RDPAccountant, rdp_subsampled_gaussian, epsilon_from_rdp, delta_from_rdp

__all__ = ["RDPAccountant", "rdp_subsampled_gaussian", "epsilon_from_rdp", "delta_from_rdp"]
