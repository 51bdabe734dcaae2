"""Reference problems in float64 NumPy with analytic per-example gradients.

Each problem gives parameters, a batch, ``loss(xp)`` (a per-example loss ``loss_fn(params,
batch) -> (B,)`` written on the backend's array namespace, for the backend to differentiate)
and ``grads(params, batch)``, the exact per-example gradients computed by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class Problem:
    name: str
    params: dict[str, np.ndarray]
    batch: tuple[np.ndarray, ...]
    loss: Callable  # xp -> loss_fn(params, batch) -> (B,)
    grads: Callable  # (params, batch) -> {leaf: (B, *shape)}

    def take(self, rows) -> "Problem":
        """The same problem on a subset (or repetition) of the batch rows."""
        return Problem(self.name, self.params, tuple(a[rows] for a in self.batch), self.loss,
                       self.grads)


def linear_regression(batch: int = 8, dim: int = 5, seed: int = 0) -> Problem:
    """loss_i = (x_i . w + b - y_i)^2 / 2; grad_w = r_i x_i, grad_b = r_i with r_i the residual."""
    rng = np.random.default_rng(seed)
    params = {"w": rng.normal(size=dim), "b": np.array([0.3])}
    x = rng.normal(size=(batch, dim))
    y = rng.normal(size=batch)

    def loss(xp):
        def loss_fn(p, data):
            x, y = data
            r = xp.matmul(x, p["w"]) + p["b"][0] - y
            return 0.5 * r * r
        return loss_fn

    def grads(p, data):
        x, y = data
        r = x @ p["w"] + p["b"][0] - y
        return {"w": r[:, None] * x, "b": r[:, None]}

    return Problem("linear_regression", params, (x, y), loss, grads)


def logistic_regression(batch: int = 8, dim: int = 5, seed: int = 1) -> Problem:
    """Labels y in {-1, 1}, s_i = x_i . w + b, loss_i = log(1 + exp(-y_i s_i));
    grad = -y_i sigmoid(-y_i s_i) (x_i, 1)."""
    rng = np.random.default_rng(seed)
    params = {"w": rng.normal(size=dim) * 0.5, "b": np.array([-0.2])}
    x = rng.normal(size=(batch, dim))
    y = np.where(rng.random(batch) < 0.5, -1.0, 1.0)

    def loss(xp):
        def loss_fn(p, data):
            x, y = data
            return xp.log(1.0 + xp.exp(-y * (xp.matmul(x, p["w"]) + p["b"][0])))
        return loss_fn

    def grads(p, data):
        x, y = data
        m = -y * (x @ p["w"] + p["b"][0])
        coef = -y / (1.0 + np.exp(-m))
        return {"w": coef[:, None] * x, "b": coef[:, None]}

    return Problem("logistic_regression", params, (x, y), loss, grads)


def tanh_mlp(batch: int = 8, dim: int = 4, hidden: int = 6, seed: int = 2) -> Problem:
    """h = tanh(x W1 + b1), s = h . w2 + b2, loss_i = (s_i - y_i)^2 / 2; with r = s - y:
    grad_w2 = r h, grad_b2 = r, delta = r w2 (1 - h^2), grad_W1 = x delta^T, grad_b1 = delta."""
    rng = np.random.default_rng(seed)
    params = {"W1": rng.normal(size=(dim, hidden)) / np.sqrt(dim), "b1": rng.normal(size=hidden) * 0.1,
              "w2": rng.normal(size=hidden) / np.sqrt(hidden), "b2": np.array([0.1])}
    x = rng.normal(size=(batch, dim))
    y = rng.normal(size=batch)

    def loss(xp):
        def loss_fn(p, data):
            x, y = data
            h = xp.tanh(xp.matmul(x, p["W1"]) + p["b1"])
            r = xp.matmul(h, p["w2"]) + p["b2"][0] - y
            return 0.5 * r * r
        return loss_fn

    def grads(p, data):
        x, y = data
        h = np.tanh(x @ p["W1"] + p["b1"])
        r = h @ p["w2"] + p["b2"][0] - y
        delta = r[:, None] * p["w2"][None, :] * (1 - h ** 2)
        return {"W1": x[:, :, None] * delta[:, None, :], "b1": delta,
                "w2": r[:, None] * h, "b2": r[:, None]}

    return Problem("tanh_mlp", params, (x, y), loss, grads)


def scalar_leaves(batch: int = 8, leaves: int = 48, seed: int = 3) -> Problem:
    """One-value leaves, alternately of shape () and (1,): s_i = sum_k x_ik w_k,
    loss_i = (s_i - y_i)^2 / 2; grad_{w_k} = (s_i - y_i) x_ik."""
    rng = np.random.default_rng(seed)
    params = {f"w{k:02d}": rng.normal(size=() if k % 2 == 0 else (1,)) / np.sqrt(leaves)
              for k in range(leaves)}
    x = rng.normal(size=(batch, leaves))
    y = rng.normal(size=batch)

    def loss(xp):
        def loss_fn(p, data):
            x, y = data
            r = -y
            for k, w in enumerate(p.values()):
                r = r + x[:, k] * w
            return 0.5 * r * r
        return loss_fn

    def grads(p, data):
        x, y = data
        r = sum(x[:, k] * w for k, w in enumerate(p.values())).reshape(-1) - y
        return {leaf: (r * x[:, k]).reshape(-1, *np.shape(w))
                for k, (leaf, w) in enumerate(p.items())}

    return Problem("scalar_leaves", params, (x, y), loss, grads)


class ScaledModel:
    """A model whose loss is a bound method reading an attribute: ``model.loss`` is a new
    object at every access, equal to the last, and a backend that traces a loss must read
    ``scale`` as it is at the call, not as it was when an equal loss was first traced."""

    def __init__(self, loss_fn: Callable, scale: float = 1.0):
        self.loss_fn, self.scale = loss_fn, scale

    def loss(self, params, batch):
        return self.scale * self.loss_fn(params, batch)


PROBLEMS = (linear_regression, logistic_regression, tanh_mlp, scalar_leaves)
