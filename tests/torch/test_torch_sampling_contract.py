"""What make_private's ledger says of each step must be what ran: one step per Poisson sample
of its loader, drawn from the records the user's loader would have drawn, releases with one
row per example, a calibration that covers a clip schedule, no optimizer that steps on
several gradients of one sample."""

import math

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import (DataLoader, SubsetRandomSampler, TensorDataset,  # noqa: E402
                              WeightedRandomSampler)

import dpcore  # noqa: E402
from dpcore_torch import make_private  # noqa: E402
from dpcore_torch.data import poisson_loader  # noqa: E402


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def data(n=100):
    gen = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen))


def private(loader=None, **options):
    model = mlp()
    options = {"noise_multiplier": 1.0, **options}
    return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                        loader or DataLoader(data(), batch_size=10), max_grad_norm=1.0, seed=0,
                        **options)


def test_a_second_step_on_one_batch_is_refused_before_anything_is_recorded():
    """Four steps a batch were recorded as four Poisson samples: epsilon 1.20 reported for
    6.48. A step that failed released nothing, so its batch may be stepped on again."""
    model, opt, loader = private()
    x, y = next(iter(loader))
    F.cross_entropy(model(x), y).backward()
    opt.step()
    before = list(opt.ledger.events)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="step 1 has no sample of its own"):
        opt.step()
    assert list(opt.ledger.events) == before
    x, y = next(iter(loader))  # the next sample: a step of its own
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert opt.ledger.samplings == 2


def test_steps_on_batches_of_another_loader_are_warned_of():
    model, opt, _ = private()
    x, y = data().tensors[0][:10], data().tensors[1][:10]
    with pytest.warns(RuntimeWarning, match="did not come from the loader make_private"):
        F.cross_entropy(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("sampler, message", [
    (SubsetRandomSampler(range(80)), "SubsetRandomSampler draws 80 of the dataset's 100"),
    (WeightedRandomSampler([1.0] * 100, 100), "WeightedRandomSampler would be dropped"),
])
def test_a_sampler_that_leaves_records_out_or_weights_them_is_refused(sampler, message):
    """It was dropped: the held-out records 80..99 were trained on, at n = 100."""
    with pytest.raises(ValueError, match=message):
        private(DataLoader(data(), batch_size=10, sampler=sampler))
    batches = [list(range(i, i + 10)) for i in range(0, 100, 10)]  # covers every record
    private(DataLoader(data(), batch_sampler=batches))


def test_an_optimizer_stepping_on_a_closure_is_refused():
    """L-BFGS: the release was recorded, then its step() failed without the closure."""
    model = mlp()
    with pytest.raises(TypeError, match="LBFGS.step needs a closure"):
        make_private(model, torch.optim.LBFGS(model.parameters()),
                     DataLoader(data(), batch_size=10), noise_multiplier=1.0,
                     max_grad_norm=1.0)


def test_a_release_with_rows_that_are_not_the_examples_is_refused():
    """Per-token values (B T rows) were clipped row by row: one example moved the release
    by T clips, priced as one."""
    metric = dpcore.Mechanism((dpcore.Group("acc", ("acc",), clip=1.0, noise_std=10.0),))
    model, opt, loader = private(metrics=[metric])
    x, y = next(iter(loader))
    F.cross_entropy(model(x), y).backward()
    opt.step()
    with pytest.raises(ValueError, match=rf"values have {4 * len(x)} rows and the loader's "
                                         rf"last sample {len(x)} records"):
        opt.release({"acc": torch.ones(4 * len(x), 1)}, metric)
    opt.release({"acc": torch.ones(len(x), 1)}, metric)


def test_target_epsilon_covers_a_clip_schedule_that_holds_the_noise():
    """z_t = z / factor(t): a warm-up to 2 C priced at the calibrated z spent 2.34 of 1."""
    schedule = dpcore.ClipSchedule(lambda t: 1.0 + t / 9)  # 1 C to 2 C over the 10 steps
    ds = data()
    model, opt, loader = private(DataLoader(ds, batch_size=10), noise_multiplier=None,
                                 target_epsilon=1.0, target_delta=1e-5, epochs=1,
                                 clip_policy=schedule)
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert opt.ledger.samplings == 10
    assert opt.epsilon(1e-5) <= 1.0


def test_an_empty_sample_of_per_example_tensors_is_an_empty_list():
    """A collate_fn listing variable-size images gave [images[0][:0]] for an empty sample:
    one example's width in a batch that looked like one example."""
    images = [torch.zeros(3, 17, 17 + i) for i in range(20)]

    def collate(examples):
        return [x for x, _ in examples], torch.tensor([y for _, y in examples])

    dataset = [(image, i % 3) for i, image in enumerate(images)]
    loader = poisson_loader(dataset, 1e-9, steps=1, seed=0, collate_fn=collate)
    batch, labels = next(iter(loader))
    assert batch == [] and labels.shape == (0,)
    assert math.isclose(loader.sample_rate, 1e-9)
