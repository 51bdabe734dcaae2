"""The hand-written DP step that ``benchmarks/torch_floor.py`` times as dpcore's lower bound
computes the same private gradient as dpcore (noise 0, a clip that binds for most examples):
a floor that did less work would make the comparison meaningless."""

import copy
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from dpcore_torch import make_private  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "benchmarks"))
from torch_floor import hand_written_dp_step  # noqa: E402
from torch_models import workload  # noqa: E402


def test_the_floor_releases_dpcores_gradient():
    model, x, y = workload("mlp")
    x, y = x[:64], y[:64]
    twin = copy.deepcopy(model)
    clip = 0.05
    floor_opt = torch.optim.SGD(model.parameters(), lr=0.0)
    hand_written_dp_step(model, x, y, floor_opt, torch.Generator().manual_seed(0), clip=clip,
                         noise_multiplier=0.0)
    opt = torch.optim.SGD(twin.parameters(), lr=0.0)
    twin, opt, _ = make_private(twin, opt, DataLoader(TensorDataset(x, y), batch_size=len(x)),
                                noise_multiplier=0.0, max_grad_norm=clip, seed=0)
    opt.zero_grad()
    F.cross_entropy(twin(x), y).backward()
    per_example = opt.engine.per_example_grads().values()
    norms = torch.cat([g.flatten(1) for g in per_example], 1).norm(dim=1)
    assert (norms > clip).float().mean() > 0.5  # the clip binds: the factors are tested
    opt.step()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
