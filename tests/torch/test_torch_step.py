"""The private step end to end: make_private, the optimizer wrapper, noise against the ledger,
Poisson loading, and the backend's registration and contract."""

import contextlib
import math
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import dpcore  # noqa: E402
from dpcore_torch import (PerExampleEngine, TorchBackend, make_private, poisson_loader,  # noqa: E402
                          private_grads)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def data(n=40):
    gen = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen))


def private_mlp(ds, batch_size, **options):
    """(model, private optimizer, parameters before any step) of the MLP made private with
    z = 1, S = 1 and a fixed seed."""
    model = mlp()
    model, opt, _ = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 DataLoader(ds, batch_size=batch_size), noise_multiplier=1.0,
                                 max_grad_norm=1.0, seed=0, **options)
    return model, opt, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("optim", [torch.optim.SGD, torch.optim.Adam])
def test_zero_noise_and_a_large_clip_give_the_non_private_step(reduction, optim):
    """With z = 0 and S above every norm, the private average sum_i grad_i / (q n) is the
    non-private mean gradient when the batch has exactly q n examples."""
    ds = data()
    model, twin = mlp(), mlp()
    opt = optim(model.parameters(), lr=0.1)
    twin_opt = optim(twin.parameters(), lr=0.1)
    loader = DataLoader(ds, batch_size=8)  # q = 8 / 40
    model, opt, _ = make_private(model, opt, loader, noise_multiplier=0.0, max_grad_norm=1e6,
                                 loss_reduction=reduction, seed=0)
    x, y = ds.tensors[0][:8], ds.tensors[1][:8]
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(model(x), y, reduction=reduction).backward()
        opt.step()
        twin_opt.zero_grad()
        F.cross_entropy(twin(x), y).backward()
        twin_opt.step()
    for p, t in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, t, rtol=1e-5, atol=1e-6)
    assert len(opt.ledger.steps()) == 1 and opt.ledger.steps()[0].count == 3


@pytest.mark.parametrize("clipping, width", [("flat", 64), ("per_layer", 64), ("flat", 300)])
def test_noise_std_of_zero_gradients_is_what_the_ledger_records(clipping, width):
    """Zero gradients (the loss ignores the output): the released average times q n is pure
    noise; its empirical std per leaf must equal alpha_j sigma~_g of the ledger's events.
    (Width 300: a leaf of 19,200 values, drawn on its own rather than in the shared draw of
    the small leaves, dpcore.noise.SHARED_DRAW.)

    Tolerance: for N i.i.d. N(0, s^2) draws the sample std has relative standard error
    1/sqrt(2N). With N >= 3 * 4,096 draws per leaf (three steps of a 64 x 64 weight), that is
    <= 0.64%; we allow 4 standard errors (<= 2.6%), so a 10% error (>= 15 SE) fails."""
    torch.manual_seed(0)
    model = nn.Linear(64, width, bias=False) if clipping == "flat" else nn.Sequential(
        nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ds = TensorDataset(torch.randn(50, 64))
    model, opt, _ = make_private(model, opt, DataLoader(ds, batch_size=10),
                                 noise_multiplier=1.3, max_grad_norm=0.7, clipping=clipping,
                                 seed=123)
    draws = {n: [] for n, _ in model.named_parameters()}
    for _ in range(3):
        opt.zero_grad()
        (model(ds.tensors[0][:10]) * 0).sum().backward()
        opt.step()
        for n, p in model.named_parameters():
            draws[n].append(p.grad.flatten() * opt.aggregator.expected_size)
    events = [e for e in opt.ledger.events if isinstance(e, dpcore.SumQueryEvent)]
    recorded = {e.group: e.noise_std for e in events}
    for n, chunks in draws.items():
        noise = torch.cat(chunks).double()
        group = opt.aggregator.mechanism.group_of(n)
        std = recorded[group.name] * group.scale(n)
        tolerance = 4 / math.sqrt(2 * noise.numel())
        empirical = noise.std().item()
        assert abs(empirical / std - 1) < tolerance, (n, empirical, std)
        assert abs(empirical / (1.1 * std) - 1) > tolerance  # a 10% error would fail
        assert abs(noise.mean().item()) < 4 * std / math.sqrt(noise.numel())


def test_empty_batch_still_adds_noise_and_writes_the_ledger():
    ds = data()
    model, opt, before = private_mlp(ds, 4)
    x, y = ds.tensors[0][:0], ds.tensors[1][:0]
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()  # nan loss: the mean of nothing
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    kinds = [type(e).__name__ for e in opt.ledger.events]
    assert kinds == ["SamplingEvent", "SumQueryEvent"]


def test_training_loop_with_the_poisson_loader_writes_one_step_per_batch(tmp_path):
    ds = data(60)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.6)
    sched = None
    model, opt, loader = make_private(model, opt, DataLoader(ds, batch_size=6),
                                      noise_multiplier=1.1, max_grad_norm=1.0,
                                      ledger=tmp_path / "run.jsonl", seed=4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    sizes = []
    for x, y in loader:
        sizes.append(len(x))
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
    assert len(sizes) == 10 and len(set(sizes)) > 1  # Poisson: sizes vary
    steps = dpcore.read_ledger(tmp_path / "run.jsonl").steps()
    assert steps == [dpcore.Step(q=0.1, noise_multiplier=pytest.approx(1.1), count=10)]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.25)


def test_make_private_samples_with_the_registered_backends_sampler():
    """One run, one sampling stream: the loader draws from the aggregator's sampler, which the
    registered torch backend made (the sampler the conformance suite tests); a seed fixes it."""
    ds = data(50)

    def run(seed):
        model = mlp()
        model, opt, loader = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                          DataLoader(ds, batch_size=5), noise_multiplier=1.0,
                                          max_grad_norm=1.0, seed=seed)
        assert opt.aggregator.backend is dpcore.get_backend("torch")
        assert loader.batch_sampler.sampler is opt.aggregator.sampler
        return list(loader.batch_sampler)  # the index lists of one epoch

    assert run(3) == run(3) != run(4)
    with pytest.raises(ValueError, match="the loader needs n=50 at q=0.2"):
        poisson_loader(ds, 0.2, sampler=dpcore.PoissonSampler(40, 0.2))
    with pytest.raises(ValueError, match="give seed or sampler, not both"):
        poisson_loader(ds, 0.2, seed=1, sampler=dpcore.PoissonSampler(50, 0.2))


def test_make_private_keeps_the_loaders_worker_settings():
    """Everything of the DataLoader but its batching (which Poisson sampling replaces) is
    the private loader's too: workers, their seeding and start-up, pinning, timeouts."""
    def start(worker):
        pass

    settings = dict(num_workers=1, pin_memory=True, timeout=30.0, worker_init_fn=start,
                    multiprocessing_context="spawn", generator=torch.Generator(),
                    prefetch_factor=3, persistent_workers=True, in_order=False)
    model = mlp()
    _, opt, loader = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  DataLoader(data(), batch_size=5, **settings),
                                  noise_multiplier=1.0, max_grad_norm=1.0)
    for name, value in settings.items():
        kept = getattr(loader, name)
        assert (kept._name if name == "multiprocessing_context" else kept) == value, name


def test_poisson_loader_sizes_and_empty_batches():
    ds = data(20)
    loader = poisson_loader(ds, 0.05, steps=400, seed=0)
    sizes = [len(x) for x, _ in loader]
    assert 0 in sizes  # P(empty) = 0.95^20 = 0.36
    empty = next((x, y) for x, y in poisson_loader(ds, 0.01, steps=50, seed=1) if len(x) == 0)
    assert empty[0].shape == (0, 6) and empty[1].shape == (0,)
    mean = sum(sizes) / len(sizes)  # Binomial(20, 0.05): mean 1, sd of the mean 0.049
    assert abs(mean - 1.0) < 0.2


class Notes(torch.utils.data.Dataset):
    """Records with raw text: a dict (text, label), or a (features, text) pair."""

    def __init__(self, kind):
        self.kind = kind

    def __len__(self):
        return 3

    def __getitem__(self, i):
        text = ["alice's note", "bob's note", "carol's note"][i]
        return {"text": text, "label": i} if self.kind == "dict" else (torch.ones(2) * i, text)


@pytest.mark.parametrize("kind", ["dict", "pair"])
def test_an_empty_sample_carries_no_record(kind):
    """The empty batch is shaped like a collated record, but no value of that record (a
    string field would pass through as it is) reaches it: it was not sampled."""
    loader = poisson_loader(Notes(kind), 1e-9, steps=1, seed=0)
    (batch,) = list(loader)
    if kind == "dict":
        assert batch["text"] == [] and batch["label"].shape == (0,)
    else:
        assert batch[0].shape == (0, 2) and len(batch[1]) == 0  # default_collate: a tuple


def test_an_empty_sample_of_a_collate_fn_with_an_unknown_structure_is_refused():
    loader = poisson_loader(Notes("dict"), 1e-9, steps=1, seed=0,
                            collate_fn=lambda rows: " ".join(r["text"] for r in rows))
    with pytest.raises(TypeError, match="unsampled record"):
        list(loader)


def test_functional_step_for_a_custom_loop():
    ds = data()
    model = mlp()
    engine = PerExampleEngine(model, loss_reduction="sum")
    mech = dpcore.per_layer(engine.leaf_sizes, 1.0, 1.0)
    agg = dpcore.PrivateAggregator(mech, n=40, q=0.25, backend="torch", seed=0)
    idx = torch.as_tensor(agg.sample())
    x, y = ds.tensors[0][idx], ds.tensors[1][idx]
    grads = private_grads(engine, agg, F.cross_entropy(model(x), y, reduction="sum"))
    assert set(grads) == set(engine.params)
    assert [type(e).__name__ for e in agg.ledger.events] == ["SamplingEvent"] + [
        "SumQueryEvent"] * 4


def test_optimizer_with_foreign_parameters_is_refused():
    model, other = mlp(), nn.Linear(2, 2)
    opt = torch.optim.SGD(list(model.parameters()) + list(other.parameters()), lr=0.1)
    with pytest.raises(ValueError, match="does not clip"):
        make_private(model, opt, DataLoader(data(), batch_size=4), noise_multiplier=1.0,
                     max_grad_norm=1.0)


def frozen_first_layer_made_private():
    """(model, private optimizer, x, y): the MLP with its first layer frozen (but in the
    optimizer) when made private."""
    model = mlp()
    model[0].requires_grad_(False)
    model, opt, _ = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 DataLoader(data(), batch_size=8), noise_multiplier=1.0,
                                 max_grad_norm=1.0, seed=0)
    return model, opt, *data().tensors


def test_a_parameter_unfrozen_after_make_private_is_refused_before_anything_is_recorded():
    """Its ordinary gradient would be applied unclipped and without noise."""
    model, opt, x, y = frozen_first_layer_made_private()
    model[0].requires_grad_(True)
    before = model[0].weight.detach().clone()
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(ValueError, match=r"does not clip: \['0.weight', '0.bias'\]"):
        opt.step()
    assert len(opt.ledger.events) == 0
    assert torch.equal(model[0].weight, before)
    model[0].requires_grad_(False)  # frozen again: private steps resume
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert torch.equal(model[0].weight, before) and len(opt.ledger.events) > 0


def test_a_weight_unfrozen_in_a_layer_with_a_trainable_bias_is_refused_too():
    """The layer's rule forms no gradient for it, so no ordinary gradient gave it away: it
    stayed untrained without a word."""
    model = mlp()
    model[0].weight.requires_grad_(False)
    model, opt, _ = make_private(model, torch.optim.SGD(model.parameters(), lr=0.5),
                                 DataLoader(data(), batch_size=8), noise_multiplier=1.0,
                                 max_grad_norm=1.0, seed=0)
    model[0].weight.requires_grad_(True)
    x, y = data().tensors
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(ValueError, match=r"does not clip: \['0.weight'\]"):
        opt.step()
    assert len(opt.ledger.events) == 0


def test_a_parameter_group_the_engine_does_not_clip_is_refused():
    model = mlp()
    model[0].requires_grad_(False)
    model, opt, _ = make_private(model, torch.optim.SGD(model[2].parameters(), lr=0.1),
                                 DataLoader(data(), batch_size=8), noise_multiplier=1.0,
                                 max_grad_norm=1.0, seed=0)
    model[0].requires_grad_(True)
    with pytest.raises(ValueError, match="does not clip"):
        opt.add_param_group({"params": model[0].weight})
    assert len(opt.param_groups) == 1
    model[0].requires_grad_(False)
    opt.add_param_group({"params": iter([model[0].bias]), "lr": 0.5})  # frozen: allowed
    assert len(opt.original_optimizer.param_groups) == 2


def test_a_parameter_frozen_after_make_private_is_not_updated():
    """Its release (noise, accounted) is dropped: post-processing."""
    model = mlp()
    model, opt, _ = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 DataLoader(data(), batch_size=8), noise_multiplier=1.0,
                                 max_grad_norm=1.0, seed=0)
    x, y = data().tensors
    model[2].requires_grad_(False)
    frozen = [p.detach().clone() for p in model[2].parameters()]
    first = model[0].weight.detach().clone()
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert all(torch.equal(p, f) for p, f in zip(model[2].parameters(), frozen))
    assert not torch.equal(model[0].weight, first)


def test_registered_through_the_entry_point_without_importing_torch_early():
    assert isinstance(dpcore.get_backend("torch"), TorchBackend)
    code = ("import sys, dpcore_torch.plugin; "
            "assert 'torch' not in sys.modules, 'plugin imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_backend_contract():
    backend = dpcore.get_backend("torch")
    like = torch.zeros(3, dtype=torch.float64)
    a = backend.standard_normal(backend.rng(5), (1000,), like)[1]
    b = backend.standard_normal(backend.rng(5), (1000,), like)[1]
    c = backend.standard_normal(backend.rng(None), (1000,), like)[1]
    assert a.dtype == torch.float64 and torch.equal(a, b) and not torch.equal(a, c)
    assert backend.to_numpy(backend.asarray([1.0, 2.0], "float32")).dtype.name == "float32"
    w = torch.randn(3, 2, dtype=torch.float64)
    x = torch.randn(4, 3, dtype=torch.float64)

    def loss_fn(params, batch):
        return torch.tanh(batch @ params["w"]).sum(1)

    grads = backend.per_example_grads(loss_fn, {"w": w}, x)
    for i in range(4):
        wi = w.clone().requires_grad_()
        loss_fn({"w": wi}, x[i:i + 1]).sum().backward()
        torch.testing.assert_close(grads["w"][i], wi.grad, rtol=1e-12, atol=0)
    assert backend.per_example_grads(loss_fn, {"w": w}, x[:0])["w"].shape == (0, 3, 2)


def test_large_cpu_draws_come_from_one_stream_per_piece_whatever_the_threads():
    """Above STREAM_CHUNK values, piece k of the draw is torch.randn from a generator seeded
    (seed + k * golden) mod 2^63, drawn in parallel: the same values on 1 or 2 threads, and
    a standard normal law overall."""
    from dpcore_torch.backend import _GOLDEN, STREAM_CHUNK, _seed_mersenne_twister

    backend = dpcore.get_backend("torch")
    like = torch.zeros((), dtype=torch.float32)
    size = 2 * STREAM_CHUNK + 1001
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = backend.standard_normal(backend.rng(9), (size,), like)[1]
        torch.set_num_threads(1)
        one = backend.standard_normal(backend.rng(9), (size,), like)[1]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    for k, piece in enumerate(two.split(STREAM_CHUNK)):
        gen = torch.Generator()
        _seed_mersenne_twister(gen, (9 + k * _GOLDEN) % 2 ** 63)
        assert torch.equal(piece, torch.randn(piece.shape, generator=gen))
    assert abs(float(two.mean())) < 5 / math.sqrt(size)
    assert abs(float(two.std()) - 1) < 0.01
    rng = backend.rng(9)
    first, second = (backend.standard_normal(rng, (size,), like)[1] for _ in range(2))
    assert not torch.equal(first, second)  # every stream moves on


def test_cpu_noise_generators_take_all_the_seeds_bits():
    """torch's manual_seed keeps a seed's low 32 bits: seeds differing above bit 31 drew the
    same noise, and the 2^32 seeds of a run are searched in hours. The Mersenne Twister's
    624 words now come from numpy's SeedSequence of the whole seed: its outputs are numpy
    MT19937's from those words (random_() joins two 32-bit outputs into 63 bits)."""
    from dpcore_torch.backend import DeviceGenerators

    seed = 0x1234_5678_9ABC_DEF0 >> 1
    same_low_bits = seed ^ (0x7FFF_FFFF << 32)
    a, b = (DeviceGenerators(s).standard_normal((1000,), torch.float32, "cpu")
            for s in (seed, same_low_bits))
    assert not torch.equal(a, b)
    reference = np.random.MT19937()
    reference.state = {"bit_generator": "MT19937", "state": {
        "key": np.random.SeedSequence(seed).generate_state(624, np.uint32), "pos": 624}}
    raw = reference.random_raw(8).astype(np.uint64)
    expected = ((raw[0::2] << np.uint64(32)) | raw[1::2]) & np.uint64(2 ** 63 - 1)
    drawn = torch.empty(4, dtype=torch.int64).random_(generator=DeviceGenerators(seed).on("cpu"))
    assert drawn.tolist() == expected.tolist()


def test_target_epsilon_calibrates_the_noise_up_front():
    from dpcore import accounting

    ds = data(100)
    model = mlp()
    model, opt, loader = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      DataLoader(ds, batch_size=10), target_epsilon=2.0,
                                      target_delta=1e-5, epochs=3, max_grad_norm=1.0, seed=0)
    for _ in range(3):
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    assert len(opt.ledger.steps()) == 1 and opt.ledger.steps()[0].count == 30
    eps = opt.epsilon(1e-5)
    assert eps <= 2.0 and eps == pytest.approx(2.0, rel=1e-3)
    assert eps == accounting.epsilon(opt.ledger, 1e-5)
    with pytest.raises(ValueError, match="exactly one"):
        make_private(mlp(), torch.optim.SGD(mlp().parameters(), lr=0.1), DataLoader(ds),
                     max_grad_norm=1.0)
    for bad, error, message in [(dict(epochs=True), TypeError, "epochs must be an integer"),
                                (dict(epochs=1.5), TypeError, "epochs must be an integer"),
                                (dict(epochs=0), ValueError, "epochs must be an integer >= 1")]:
        with pytest.raises(error, match=message):
            make_private(mlp(), torch.optim.SGD(mlp().parameters(), lr=0.1), DataLoader(ds),
                         max_grad_norm=1.0, target_epsilon=2.0, target_delta=1e-5, **bad)
    with pytest.raises(ValueError, match="target_delta and epochs serve target_epsilon's"):
        make_private(mlp(), torch.optim.SGD(mlp().parameters(), lr=0.1), DataLoader(ds),
                     max_grad_norm=1.0, noise_multiplier=1.0, epochs=3)
    other = mlp()
    with pytest.warns(UserWarning, match=r"delta=0\.02 is not below 1/n = 0\.01 \(n=100"):
        make_private(other, torch.optim.SGD(other.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=10), target_epsilon=2.0, target_delta=0.02,
                     epochs=3, max_grad_norm=1.0)


def test_a_mechanism_of_ones_own_keeps_its_allocation_and_meets_the_target():
    """clipping=Mechanism with target_epsilon: its groups' noise scaled to the calibrated z
    (the clips and the ratio of the noises kept), the run spending the target; with
    noise_multiplier, scaled to it; with neither, as given; with both, refused."""
    ds = data(100)
    model = mlp()
    names = [n for n, _ in model.named_parameters()]
    mechanism = dpcore.Mechanism((dpcore.Group("first", tuple(names[:2]), 0.5, 0.3),
                                  dpcore.Group("rest", tuple(names[2:]), 1.0, 0.9)))

    def private(**options):
        return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            DataLoader(ds, batch_size=10), max_grad_norm=1.0, seed=0,
                            clipping=mechanism, **options)

    _, opt, loader = private(target_epsilon=2.0, target_delta=1e-5, epochs=2)
    first, rest = opt.aggregator.mechanism.groups
    assert (first.clip, rest.clip) == (0.5, 1.0)
    assert rest.noise_std / first.noise_std == pytest.approx(3.0)
    for _ in range(2):
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    assert opt.epsilon(1e-5) == pytest.approx(2.0, rel=1e-3) and opt.epsilon(1e-5) <= 2.0
    opt.engine.detach()
    _, opt, _ = private(noise_multiplier=1.5)
    assert opt.noise_multiplier == pytest.approx(1.5)
    assert opt.aggregator.mechanism.groups[1].noise_std / \
        opt.aggregator.mechanism.groups[0].noise_std == pytest.approx(3.0)
    opt.engine.detach()
    _, opt, _ = private()
    assert opt.aggregator.mechanism == mechanism
    opt.engine.detach()
    with pytest.raises(ValueError, match="at most one"):
        private(noise_multiplier=1.0, target_epsilon=2.0, target_delta=1e-5, epochs=1)
    with pytest.raises(ValueError, match="no scaling of its noise"):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(ds, batch_size=10), max_grad_norm=1.0,
                     clipping=mechanism.with_noise([0.0, 0.9]), noise_multiplier=1.0)


def test_the_main_job_runs(tmp_path, capsys, load_example):
    from dpcore import accounting

    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    digits = load_example("digits")
    ledger, plot = tmp_path / "ledger.jsonl", tmp_path / "eps.png"
    digits.main(["--epochs", "2", "--epsilon", "4", "--ledger", str(ledger), "--plot", str(plot)])
    out = capsys.readouterr().out
    assert "test accuracy" in out and "non-private" in out and "(private)" in out
    assert plot.stat().st_size > 0
    read = dpcore.read_ledger(ledger)
    steps = read.steps()
    assert sum(s.count for s in steps) == 2 * 22  # round(1437 / 64) steps per epoch
    # the loss shown is a query of every step, and the target covers it
    assert sum(getattr(e, "group", "") == "loss" for e in read.events) == 2 * 22
    assert accounting.epsilon(read, 1e-5) == pytest.approx(4.0, rel=2e-3)


@pytest.mark.parametrize("policy", ["raise", "drop"])
def test_make_private_raises_on_or_drops_a_nan_record(policy):
    from dpcore.aggregation import NonFiniteNormError

    ds = data()
    x, y = ds.tensors[0][:8].clone(), ds.tensors[1][:8]
    x[3, 2] = math.nan
    model, opt, before = private_mlp(ds, 8, on_nonfinite=policy)
    F.cross_entropy(model(x), y).backward()
    if policy == "raise":
        with pytest.raises(NonFiniteNormError, match=r"records \[3\]"):
            opt.step()
        assert [type(e).__name__ for e in opt.ledger.events] == ["SamplingEvent"]
        return
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any((p != b).any() for p, b in zip(model.parameters(), before))


def test_two_backward_passes_in_one_step_are_refused_before_any_release():
    """Gradient accumulation over two batches would pair row i of each as one record (twice
    the sensitivity): the step refuses before any sum is released or recorded."""
    from dpcore_torch import AccumulationError

    ds = data()
    model, opt, before = private_mlp(ds, 8)
    x, y = ds.tensors
    for rows in (slice(0, 8), slice(8, 16)):
        F.cross_entropy(model(x[rows]), y[rows]).backward()
    with pytest.raises(AccumulationError, match="optimizer.step"):
        opt.step()
    assert [type(e).__name__ for e in opt.ledger.events] == ["SamplingEvent"]
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    opt.zero_grad()  # the next step works
    F.cross_entropy(model(x[:8]), y[:8]).backward()
    opt.step()
    assert len(opt.ledger.steps()) == 2


def two_towers():
    """Two Linear towers on the two halves of the input's features."""
    class Towers(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x, tower):
            return self.a(x[:, :3]) if tower == "a" else self.b(x[:, 3:])

    return Towers()


def test_two_backward_passes_through_different_layers_are_refused_too():
    """Batch A through tower a, batch B through tower b, one step: no layer saw two batches,
    yet row i of A and of B would be clipped as one record."""
    from dpcore_torch import AccumulationError

    ds = data()
    model = two_towers()
    model, opt, _ = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 DataLoader(ds, batch_size=8), noise_multiplier=1.0,
                                 max_grad_norm=1.0, seed=0)
    x, y = ds.tensors
    F.cross_entropy(model(x[:8], "a"), y[:8]).backward()
    F.cross_entropy(model(x[8:16], "b"), y[8:16]).backward()
    with pytest.raises(AccumulationError, match="Linear"):
        opt.step()
    assert [type(e).__name__ for e in opt.ledger.events] == ["SamplingEvent"]


@pytest.mark.parametrize("towers", [False, True])
def test_two_forward_passes_then_two_backward_passes_are_refused(towers):
    """Both batches' forward passes first, then a backward pass each: no call was made after a
    backward pass, yet row i of A and of B would be clipped as one record (the audit's
    release equalled the pair-clipped sum). Refused before anything is released."""
    from dpcore_torch import AccumulationError

    ds = data()
    model = two_towers() if towers else mlp()
    model, opt, _ = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 DataLoader(ds, batch_size=8), noise_multiplier=1.0,
                                 max_grad_norm=1.0, seed=0)
    x, y = ds.tensors
    args = ("a", "b") if towers else ((), ())
    out_a = model(x[:8], *args[0])
    out_b = model(x[8:16], *args[1])
    F.cross_entropy(out_a, y[:8]).backward()
    F.cross_entropy(out_b, y[8:16]).backward()
    with pytest.raises(AccumulationError, match="2 forward passes"):
        opt.step()
    assert [type(e).__name__ for e in opt.ledger.events] == ["SamplingEvent"]


def oracle_steps(loop, steps=3):
    """Parameters after ``steps`` steps of ``loop(model, opt, x, y)`` on the private MLP (zero
    noise, a binding clip), and after the same steps in the usual order."""
    ds = data()
    x, y = ds.tensors[0][:8], ds.tensors[1][:8]
    results = []
    for body in (loop, None):
        model = mlp()
        model, opt, _ = make_private(model, torch.optim.SGD(model.parameters(), lr=0.5),
                                     DataLoader(ds, batch_size=8), noise_multiplier=0.0,
                                     max_grad_norm=0.1, seed=0)
        for _ in range(steps):
            if body is None:
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
            else:
                body(model, opt, x, y)
            opt.step()
        assert [type(e).__name__ for e in opt.ledger.events].count("SamplingEvent") == steps
        results.append([p.detach().clone() for p in model.parameters()])
    return results


def test_zero_grad_between_the_forward_and_the_backward_pass_is_the_same_step():
    """out = model(x); opt.zero_grad(); loss.backward(): a common loop order."""
    def loop(model, opt, x, y):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()

    got, want = oracle_steps(loop)
    assert not torch.equal(got[0], mlp()[0].weight)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_backward_pass_per_loss_term_through_one_forward_adds_up():
    """loss1.backward(retain_graph=True); loss2.backward(): the per-example gradient is that of
    loss1 + loss2 (here half the loss twice)."""
    def loop(model, opt, x, y):
        opt.zero_grad()
        out = model(x)
        F.cross_entropy(out, y).mul(0.5).backward(retain_graph=True)
        F.cross_entropy(out, y).mul(0.5).backward()

    for a, b in zip(*oracle_steps(loop)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_backward_pass_through_a_forward_whose_inputs_were_released_is_refused():
    """Back-propagated, then zero_grad(): the kept inputs are gone; a second backward pass
    through the (retained) graph cannot be clipped."""
    from dpcore_torch import AccumulationError

    ds = data()
    model, opt, _ = private_mlp(ds, 8)
    loss = F.cross_entropy(model(ds.tensors[0][:8]), ds.tensors[1][:8])
    loss.backward(retain_graph=True)
    opt.zero_grad()
    with pytest.raises(AccumulationError, match="no longer keeps"):
        loss.backward()


def test_a_forward_after_the_backward_that_is_never_back_propagated_changes_nothing():
    ds = data()
    x, y = ds.tensors[0][:8], ds.tensors[1][:8]
    results = []
    for evaluate in (False, True):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt, _ = make_private(model, opt, DataLoader(ds, batch_size=8),
                                     noise_multiplier=0.0, max_grad_norm=1.0, seed=0)
        F.cross_entropy(model(x), y).backward()
        if evaluate:  # e.g. a metric on other data, gradients still enabled
            F.cross_entropy(model(ds.tensors[0][8:]), ds.tensors[1][8:])
        opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("policy", [None, "adaptive"])
@pytest.mark.parametrize("last", ["in step()", "accumulated too"])
def test_a_sample_accumulated_over_micro_batches_is_the_same_step(policy, last):
    """Micro-batches of 3, 3 and 2 rows of one sample of 8, each clipped into the step by
    accumulate() (the last one by step() itself, or accumulated too), then step(): the same
    update as the sample in one batch, with the noise drawn once (same seed), one sampling
    event and one release in the ledger, and (adaptive clipping) the same count query, so
    the same next clip."""
    ds = data()
    x, y = ds.tensors[0][:8], ds.tensors[1][:8]
    runs = []
    for split in ([8], [3, 3, 2]):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt, _ = make_private(model, opt, DataLoader(ds, batch_size=8),
                                     noise_multiplier=0.6, max_grad_norm=2.0, seed=0,
                                     clip_policy=policy)
        for _ in range(2):
            for rows in torch.arange(8).split(split):
                opt.zero_grad()
                F.cross_entropy(model(x[rows]), y[rows]).backward()
                if rows[-1] != 7 or last == "accumulated too":
                    opt.accumulate()
            opt.step()
        kinds = [type(e).__name__ for e in opt.ledger.events]
        runs.append(([p.detach().clone() for p in model.parameters()], kinds,
                     opt.aggregator.mechanism.groups[0].clip))
    (one, kinds_one, clip_one), (micro, kinds_micro, clip_micro) = runs
    for a, b in zip(one, micro):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert kinds_one == kinds_micro and kinds_one.count("SamplingEvent") == 2
    assert clip_one == pytest.approx(clip_micro, rel=1e-9)


def test_a_step_left_by_a_skipped_batch_is_abandoned_not_merged_into_the_next():
    """A loop that skips the rest of a sample after an error in one of its micro-batches
    (out of memory, say) has accumulated part of it: the next batch of the loader begins a
    new step, with a warning, and the abandoned part is not released with it (a record in
    both samples would count twice in one release priced once). Same parameters as a run
    that skipped that batch before accumulating anything; the ledger's abandoned step has
    its sampling event and no release."""
    ds = data()
    results = []
    for skip_after in (1, 0):  # micro-batches accumulated before the error
        model = mlp()
        model, opt, loader = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                          DataLoader(ds, batch_size=12), noise_multiplier=0.0,
                                          max_grad_norm=0.5, seed=3)
        with pytest.warns(RuntimeWarning, match="never taken by step") if skip_after else (
                contextlib.nullcontext()):
            for batch, (x, y) in enumerate(loader):
                for k, rows in enumerate(torch.arange(len(x)).split(4)):
                    if batch == 0 and k == skip_after:
                        break  # the error: the rest of this sample is skipped
                    opt.zero_grad()
                    F.cross_entropy(model(x[rows]), y[rows]).backward()
                    opt.accumulate()
                else:
                    opt.step()
        kinds = [type(e).__name__ for e in opt.ledger.events]
        results.append(([p.detach().clone() for p in model.parameters()], kinds))
    (skipped, kinds), (reference, reference_kinds) = results
    for a, b in zip(skipped, reference):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert kinds == ["SamplingEvent"] + reference_kinds


def test_the_rest_of_a_sample_after_a_failed_micro_batch_is_dropped_not_released():
    """A NaN record makes its micro-batch's accumulate() raise; a loop that goes on with the
    sample's later micro-batches had them released as a step of their own, a sample the
    ledger does not describe (whether the first ones were in it depended on that record).
    They are dropped, step() raises the error again, and the next sample is a step as usual."""
    from dpcore.aggregation import NonFiniteNormError

    ds = data()
    model = mlp()
    model, opt, loader = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      DataLoader(ds, batch_size=40), noise_multiplier=0.0,
                                      max_grad_norm=1.0, seed=0)
    x, y = ds.tensors[0].clone(), ds.tensors[1]
    x[5] = math.nan
    before = [p.detach().clone() for p in model.parameters()]
    outcomes = []
    for rows in torch.arange(12).split(4):
        opt.zero_grad()
        F.cross_entropy(model(x[rows]), y[rows]).backward()
        try:
            opt.accumulate()
            outcomes.append("ok")
        except NonFiniteNormError:
            outcomes.append("raised")
    assert outcomes == ["ok", "raised", "ok"]
    with pytest.raises(NonFiniteNormError, match="record"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert [type(e).__name__ for e in opt.ledger.events] == ["SamplingEvent"]
    opt.zero_grad()
    F.cross_entropy(model(x[12:20]), y[12:20]).backward()
    opt.step()
    assert [type(e).__name__ for e in opt.ledger.events] == [
        "SamplingEvent", "SamplingEvent", "SumQueryEvent"]


def test_adversarial_inputs_from_autograd_grad_then_zero_grad_train_on_them_alone():
    """A backward pass that only makes inputs (FGSM) reaches the layers too; zero_grad()
    between it and the training forward leaves the step exactly the one on the new inputs."""
    from dpcore_torch import AccumulationError

    ds = data()
    x, y = ds.tensors[0][:8], ds.tensors[1][:8]
    adversarial = None
    results = []
    for route in ("fgsm", "direct"):
        model, opt, _ = private_mlp(ds, 8)
        if route == "fgsm":
            x_in = x.clone().requires_grad_(True)
            (grad_x,) = torch.autograd.grad(F.cross_entropy(model(x_in), y), x_in)
            adversarial = (x + 0.1 * grad_x.sign()).detach()
            F.cross_entropy(model(adversarial), y).backward()
            with pytest.raises(AccumulationError, match="zero_grad"):
                opt.step()
            opt.zero_grad()
            x_in = x.clone().requires_grad_(True)
            torch.autograd.grad(F.cross_entropy(model(x_in), y), x_in)
            opt.zero_grad()
        F.cross_entropy(model(adversarial), y).backward()
        opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("compile_first", [True, False])
def test_a_compiled_model_takes_the_same_private_steps(compile_first):
    """torch.compile before or after make_private (dynamo only: the eager backend) changes
    nothing: with a binding clip and noise from the same seed, three steps give the same
    parameters as the uncompiled model's."""
    ds = data()
    x, y = ds.tensors[0][:8], ds.tensors[1][:8]
    trained = []
    for compiled in (False, True):
        model = mlp()
        if compiled and compile_first:
            model = torch.compile(model, backend="eager")
        model, opt, _ = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     DataLoader(ds, batch_size=8), noise_multiplier=1.0,
                                     max_grad_norm=0.1, seed=0)
        if compiled and not compile_first:
            model = torch.compile(model, backend="eager")
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        trained.append([p.detach().clone() for p in model.parameters()])
    for eager, compiled in zip(*trained):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)


def test_secure_noise_has_the_std_the_ledger_records():
    """make_private(secure=True): sampling and noise from the system's CSPRNG. Zero gradients:
    the update is the noise, lr sigma~ N(0, I) / (q n), with sigma~ from the ledger (a 10%
    error fails); a seed is refused, and leaves the model as it was."""
    data = TensorDataset(torch.randn(1000, 400), torch.zeros(1000, 50))
    model = nn.Linear(400, 50)
    with pytest.raises(ValueError, match="takes no seed"):
        make_private(model, torch.optim.SGD(model.parameters(), lr=1.0),
                     DataLoader(data, batch_size=100), noise_multiplier=2.0,
                     max_grad_norm=0.5, secure=True, seed=0)
    model, optimizer, loader = make_private(
        model, torch.optim.SGD(model.parameters(), lr=1.0), DataLoader(data, batch_size=100),
        noise_multiplier=2.0, max_grad_norm=0.5, secure=True, check_independence=False)
    x, y = next(iter(loader))
    before = model.weight.detach().clone()
    (model(x) * 0).sum().backward()
    optimizer.step()
    event = next(e for e in optimizer.ledger.events if isinstance(e, dpcore.SumQueryEvent))
    std = float((model.weight.detach() - before).std()) * optimizer.aggregator.expected_size
    assert abs(std / event.noise_std - 1) < 0.03
