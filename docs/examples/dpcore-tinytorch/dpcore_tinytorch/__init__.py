"""dpcore-tinytorch: a minimal third-party dpcore backend on torch.func.

The backend lives in :mod:`dpcore_tinytorch.backend`; this package imports no torch, so that
listing dpcore's backends stays cheap.
"""
