"""The compiled private step (dpcore_torch.compiled) against a float64 oracle that clips the
gradients of one example at a time, and its noise, padding, ledger and refusals."""

import copy
import math

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import dpcore  # noqa: E402
from dpcore.aggregation import NonFiniteNormError  # noqa: E402
from dpcore_torch import CompiledPrivateStep, LeakedGradientError, NotPerExampleError  # noqa: E402
from test_torch_per_example import Seq  # noqa: E402  (Embedding, Conv1d, norms, Linear)
from clip_movement import group_moves  # noqa: E402

RTOL = 1e-6
LOSS = nn.CrossEntropyLoss(reduction="none")


class Image(nn.Module):
    """Conv2d with stride, groups and dilation, then a Linear layer."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(2, 4, 3, stride=2, padding=1)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1, groups=2)
        self.c3 = nn.Conv2d(4, 6, 3, dilation=2)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        x = torch.tanh(self.c2(torch.relu(self.c1(x))))
        return self.fc(torch.tanh(self.c3(x)).mean((2, 3)))


def mlp():
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def model_and_data(name, rows=10, seed=0):
    """(float64 model, inputs, targets) of ``rows`` examples."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    if name == "seq":
        x = torch.randint(0, 13, (rows, 6), generator=gen)
        x[0, :3] = 4  # a repeated token
        x[1, -1] = 0  # the padding row
        model = Seq()
    elif name == "image":
        x = torch.randn(rows, 2, 9, 9, generator=gen, dtype=torch.float64)
        model = Image()
    else:
        x = torch.randn(rows, 5, generator=gen, dtype=torch.float64)
        model = mlp()
    return model.double(), x, torch.randint(0, 3, (rows,), generator=gen)


def oracle(model, x, y, clip, expected_size):
    """sum_i min(1, S / ||g_i||) g_i / (q n) with the gradients g_i of one example at a time
    (float64 autograd)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    for i in range(x.shape[0]):
        loss = F.cross_entropy(model(x[i:i + 1]), y[i:i + 1], reduction="sum")
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params.values(), grads)]
        norm = math.sqrt(sum(float(g.square().sum()) for g in grads))
        factor = min(1.0, clip / norm) if norm > 0 else 1.0
        for n, g in zip(params, grads):
            total[n] += factor * g
    return {n: t / expected_size for n, t in total.items()}


def aggregator(model, *, z=0.0, clip=1.0, n=100, q=0.1, **options):
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return dpcore.PrivateAggregator(dpcore.flat(names, clip=clip, noise_multiplier=z), n=n,
                                    q=q, backend="torch", seed=0, **options)


def assert_close(got, expected):
    for name, e in expected.items():
        scale = max(float(e.abs().max()), 1e-300)
        assert float((got[name] - e).abs().max()) <= RTOL * scale, name


@pytest.mark.parametrize("name", ["mlp", "seq", "image"])
def test_compiled_steps_equal_the_clipped_oracle(name):
    """Every step, eager (the first two) and compiled (the rest, one program per bucket),
    releases sum_i clip(g_i) / (q n) for a clip that binds for some examples and not others,
    with the batch padded to its bucket (10 rows to 16)."""
    model, x, y = model_and_data(name)
    twin = copy.deepcopy(model)
    agg = aggregator(model, clip=0.05)
    step = CompiledPrivateStep(model, LOSS, agg, buckets=dpcore.Buckets(10, granularity=8))
    for t in range(4):
        got = step(x[t:], y[t:])  # 10, 9, 8 and 7 rows: buckets of 16 and 8
        expected = oracle(twin, x[t:], y[t:], 0.05, agg.expected_size)
        assert_close(got, expected)
        for n, p in model.named_parameters():
            assert p.grad is got[n]
    assert step.compiled_shapes() == 1  # steps 3 and 4, 8 and 7 rows, share a bucket
    assert agg.ledger.steps() == [dpcore.Step(q=0.1, noise_multiplier=0.0, count=4)]


def test_a_sample_of_any_size_padded_to_any_bucket_releases_the_same():
    """Padded rows change nothing: the same 6 records in buckets of 6, 8 and 12 rows, and an
    empty sample releases zeros (with z = 0: the noise alone otherwise)."""
    model, x, y = model_and_data("mlp", rows=6)
    releases = []
    for granularity in (6, 8, 12):
        agg = aggregator(model, clip=0.05)
        step = CompiledPrivateStep(model, LOSS, agg,
                                   buckets=dpcore.Buckets(6, granularity=granularity))
        releases.append([step(x, y) for _ in range(3)][-1])
        empty = step(x[:0], y[:0])
        assert all(float(g.abs().max()) == 0 for g in empty.values())
        step.detach()
    for other in releases[1:]:
        assert_close(other, releases[0])


class Normalising(nn.Module):
    """Each input row scaled to unit norm: a zero row (padding) gives NaN."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        return self.fc(x / x.norm(dim=1, keepdim=True))


def test_padded_rows_whose_values_are_nan_reach_no_sum():
    """Zero padding rows that a model turns into NaN are zeroed before the sums (0 * NaN
    would be NaN): the release of 7 records in a bucket of 8 is the oracle's."""
    torch.manual_seed(0)
    model = Normalising().double()
    twin = copy.deepcopy(model)
    x = torch.randn(7, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (7,))
    agg = aggregator(model, clip=0.05)
    step = CompiledPrivateStep(model, LOSS, agg, buckets=dpcore.Buckets(7, granularity=8))
    for _ in range(3):
        assert_close(step(x, y), oracle(twin, x, y, 0.05, agg.expected_size))


def test_the_noise_has_the_std_the_ledger_records():
    """Zero gradients (the loss ignores the output): the release times q n is the noise, whose
    empirical std per leaf must be z S. 64 x 64 + 64 values per step, three compiled steps: the
    sample std's relative standard error is 1/sqrt(2N) <= 0.7%; a 10% error fails (4 SE
    allowed, 2.8%)."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64).double()
    agg = aggregator(model, z=1.5, clip=2.0, n=200)
    step = CompiledPrivateStep(model, lambda out, y: (out * 0).sum(1), agg)
    x = torch.randn(20, 64, dtype=torch.float64)
    draws = {"weight": [], "bias": []}
    for _ in range(5):
        released = step(x, x)
        for name in draws:
            draws[name].append(released[name].flatten() * agg.expected_size)
    assert step.compiled_shapes() == 1
    for name, values in draws.items():
        values = torch.cat(values[2:])  # the compiled steps
        assert abs(float(values.std()) / 3.0 - 1) < 4 / math.sqrt(2 * values.numel()), name
        assert abs(float(values.mean())) < 4 * 3.0 / math.sqrt(values.numel())
    assert agg.ledger.steps() == [dpcore.Step(q=0.1, noise_multiplier=1.5, count=5)]
    assert [e.noise_std for e in agg.ledger.events
            if isinstance(e, dpcore.SumQueryEvent)] == [3.0] * 5


def test_the_static_embedding_norms_equal_the_dense_gradients_norms():
    """The sorted, static-shape embedding norms of a traced step against the squared norms of
    the dense per-example gradients (float64), on indices with many repeats; the margins for
    summed runs are below 1e-12 in float64."""
    from dpcore_torch.layers import EmbeddingRule

    gen = torch.Generator().manual_seed(3)
    k = torch.randint(0, 5, (7, 12), generator=gen)
    g = torch.randn(7, 12, 4, generator=gen, dtype=torch.float64)
    dense = torch.zeros(7, 5, 4, dtype=torch.float64).scatter_add_(
        1, k[:, :, None].expand(7, 12, 4), g)
    got = EmbeddingRule._sorted_sq_norm(k, g)
    torch.testing.assert_close(got, dense.square().sum((1, 2)), rtol=1e-12, atol=0)
    assert bool((got >= dense.square().sum((1, 2))).all())


def test_a_clip_schedule_moves_the_clip_without_a_new_program():
    model, x, y = model_and_data("mlp")
    twin = copy.deepcopy(model)
    agg = aggregator(model, clip=0.1, clipping=dpcore.ClipSchedule(lambda t: 1 / (1 + t)))
    step = CompiledPrivateStep(model, LOSS, agg, buckets=dpcore.Buckets(10, granularity=10))
    for _ in range(4):
        got = step(x, y)
        assert_close(got, oracle(twin, x, y, agg.mechanism.groups[0].clip, agg.expected_size))
    assert step.compiled_shapes() == 1
    assert len({e.clip for e in agg.ledger.events if isinstance(e, dpcore.SumQueryEvent)}) == 4


@pytest.mark.parametrize("policy", ["raise", "drop"])
def test_a_nan_record_raises_before_any_release_or_is_dropped(policy):
    """A record whose gradient is NaN: "raise" releases nothing (the sampling event stays,
    no sum query is written); "drop" releases the others' clipped sum."""
    model, x, y = model_and_data("mlp")
    twin = copy.deepcopy(model)
    agg = aggregator(model, clip=0.05, on_nonfinite=policy)
    step = CompiledPrivateStep(model, LOSS, agg, buckets=dpcore.Buckets(10, granularity=10))
    bad = x.clone()
    bad[3, 0] = math.nan
    for t in range(4):  # eager, eager, compiled, compiled
        if policy == "raise":
            with pytest.raises(NonFiniteNormError, match=r"records \[3\]"):
                step(bad, y)
            assert agg.ledger.samplings == t + 1
            assert not [e for e in agg.ledger.events if isinstance(e, dpcore.SumQueryEvent)]
        else:
            keep = torch.arange(10) != 3
            assert_close(step(bad, y), oracle(twin, x[keep], y[keep], 0.05, agg.expected_size))


class Mixing(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        h = self.fc(x)
        return h - h.mean(0)  # a statistic of the batch


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 5)

    def forward(self, x):
        return F.linear(torch.tanh(self.fc(x)), self.fc.weight)[:, :3]  # the weight reused


class Branching(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        h = self.fc(x)
        return h if bool(h.sum() > 0) else -h  # a branch on the batch's values


@pytest.mark.parametrize("module, error, match, begun", [
    (Mixing, NotPerExampleError, "mix", 1),
    (Tied, LeakedGradientError, r"\['fc.weight'\]", 1),
    (Branching, RuntimeError, "could not be traced", 0),
])
def test_what_cannot_be_a_private_compiled_step_is_refused_before_a_release(module, error,
                                                                            match, begun):
    """Mixing examples is found by the eager steps' check, a weight used outside its layer by
    its leaf's gradient (both within a step: its sampling event is written), a branch on
    values at tracing (step 3), before the step begins; nothing is released."""
    torch.manual_seed(0)
    model = module().double()
    agg = aggregator(model)
    step = CompiledPrivateStep(model, LOSS, agg)
    x = torch.randn(10, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (10,))
    with pytest.raises(error, match=match):
        for _ in range(3):
            step(x, y)
    released = len([e for e in agg.ledger.events if isinstance(e, dpcore.SumQueryEvent)])
    assert released == agg.ledger.samplings - begun


def test_bad_arguments_are_refused():
    model, x, y = model_and_data("mlp")
    with pytest.raises(ValueError, match="adaptive clipping's counts"):
        CompiledPrivateStep(model, LOSS, aggregator(model, z=1.0, n=1000,
                                                     clipping=dpcore.QuantileClipping()))
    with pytest.raises(TypeError, match="torch backend"):
        names = [n for n, _ in model.named_parameters()]
        CompiledPrivateStep(model, LOSS, dpcore.PrivateAggregator(
            dpcore.flat(names, clip=1.0, noise_multiplier=1.0), n=100, q=0.1))
    step = CompiledPrivateStep(model, nn.CrossEntropyLoss(), aggregator(model))
    with pytest.raises(ValueError, match=r"one loss per example, shape \(10,\)"):
        step(x, y)
    with pytest.raises(ValueError, match="examples on axis 0"):
        step(x, y[:5])


def test_a_secure_aggregator_draws_the_noise_from_the_csprng():
    model, x, y = model_and_data("mlp")
    names = [n for n, _ in model.named_parameters()]
    agg = dpcore.PrivateAggregator(dpcore.flat(names, clip=1.0, noise_multiplier=1.0), n=100,
                                   q=0.1, backend="torch", secure=True)
    step = CompiledPrivateStep(model, LOSS, agg)
    first, second = [step(x, y) for _ in range(3)][1:]
    assert all(float((first[n] - second[n]).abs().min()) > 0 for n in first)


def test_a_training_loop_over_the_poisson_loader_writes_one_step_per_batch(tmp_path):
    """docs/torch.md's loop: samples of varying size (empty ones included) from the
    aggregator's sampler, any optimizer; one program for the one bucket they fit."""
    from torch.utils.data import TensorDataset

    from dpcore_torch import poisson_loader

    model, x, y = model_and_data("mlp", rows=40)
    agg = aggregator(model, z=1.0, n=40, q=0.2, ledger=tmp_path / "run.jsonl")
    step = CompiledPrivateStep(model, LOSS, agg, buckets=dpcore.Buckets(8, granularity=24))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    before = [p.detach().clone() for p in model.parameters()]
    loader = poisson_loader(TensorDataset(x, y), 0.2, sampler=agg.sampler, steps=12)
    sizes = []
    for xb, yb in loader:
        optimizer.zero_grad()
        step(xb, yb)
        optimizer.step()
        sizes.append(len(xb))
    assert step.compiled_shapes() == 1 and min(sizes) < 8 < max(sizes)
    assert dpcore.read_ledger(tmp_path / "run.jsonl").steps() == [
        dpcore.Step(q=0.2, noise_multiplier=1.0, count=12)]
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


class ScaledDropout(nn.Module):
    """No rule: the engine's fallback replays it per example (torch.func), dropout inside."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 7))

    def forward(self, h):
        return F.dropout(h * self.scale, 0.5, self.training)


def test_dropout_replayed_in_the_program_uses_the_forward_passes_masks():
    """Random masks drawn in the traced forward pass (Inductor drawing them with ATen's
    generator, fallback_random) are the ones the replay of the fallback unit and the
    book-keeping use: every step equals the eager engine's on the same global seed."""
    from dpcore_torch import PerExampleEngine, private_grads

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), ScaledDropout(), nn.Dropout(0.3),
                             nn.Linear(7, 3)).double()

    model, twin = make(), make()
    x = torch.randn(8, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (8,))
    agg, twin_agg = aggregator(model, clip=0.05), aggregator(twin, clip=0.05)
    step = CompiledPrivateStep(model, LOSS, agg, buckets=dpcore.Buckets(8, granularity=8))
    engine = PerExampleEngine(twin, loss_reduction="sum", check_independence=False)
    with torch._inductor.config.patch(fallback_random=True):
        for t in range(4):
            torch.manual_seed(100 + t)
            got = step(x, y)
            torch.manual_seed(100 + t)
            twin_agg.begin_step()
            expected = private_grads(engine, twin_agg,
                                     F.cross_entropy(twin(x), y, reduction="sum"))
            assert_close(got, expected)
    assert step.compiled_shapes() == 1


class AttentionLSTM(nn.Module):
    """Embedding, MultiheadAttention (its rule), LSTM (its rule), Linear."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.lstm = nn.LSTM(8, 6, batch_first=True)
        self.fc = nn.Linear(6, 3)

    def forward(self, k):
        h = self.emb(k)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.fc(self.lstm(h)[0][:, -1])


def test_attention_and_recurrent_rules_compile_to_the_eager_engines_step():
    """The layers with rules of their own, traced: every step equals the eager engine's
    (whose rules are tested against the per-example oracle) in float64."""
    from dpcore_torch import PerExampleEngine, private_grads

    torch.manual_seed(0)
    model = AttentionLSTM().double()
    twin = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(0, 11, (6, 4), generator=gen)
    y = torch.randint(0, 3, (6,), generator=gen)
    agg, twin_agg = aggregator(model, clip=0.05), aggregator(twin, clip=0.05)
    step = CompiledPrivateStep(model, LOSS, agg, buckets=dpcore.Buckets(6, granularity=8))
    engine = PerExampleEngine(twin, loss_reduction="sum", check_independence=False)
    for _ in range(3):
        twin_agg.begin_step()
        expected = private_grads(engine, twin_agg, F.cross_entropy(twin(x), y, reduction="sum"))
        assert_close(step(x, y), expected)
    assert step.compiled_shapes() == 1


class Norm(nn.Module):
    """Linear, LayerNorm, tanh, Linear: the LayerNorm bias's group is where bfloat16 sums
    showed (one record moved it by 1.75 clips)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.ln, self.fc2 = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.ln(self.fc1(x))))


def test_under_autocast_one_record_moves_each_group_by_at_most_its_clip():
    """A step called under bfloat16 autocast (its forward runs in it) forms norms, clip
    factors and sums in float32, eagerly and compiled: adding one more of B identical records
    (B = 40..60, one bucket of 64, per-layer clipping, z = 0; B = 40, 41 eager, the rest
    compiled) moves each group's sum by at most its clip. Before, Inductor compiled the
    program under the caller's autocast, whose decompositions rounded the sums to bfloat16:
    they moved by up to 1.75 clips."""
    torch.manual_seed(0)
    model = Norm()
    mech = dpcore.per_layer({n: p.numel() for n, p in model.named_parameters()},
                            total_clip=1.0, noise_multiplier=0.0)
    agg = dpcore.PrivateAggregator(mech, n=2000, q=0.05, backend="torch", seed=0)
    step = CompiledPrivateStep(model, LOSS, agg, buckets=dpcore.Buckets(64, granularity=64),
                               check_independence=False)
    x = (3 * torch.randn(1, 8, generator=torch.Generator().manual_seed(1))).expand(64, 8)
    y = torch.ones(64, dtype=torch.long)
    worst = {g.name: 0.0 for g in mech.groups}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        last = None
        for b in range(40, 61):  # steps 1 and 2 eager, then compiled
            out = {k: v.double() * agg.expected_size for k, v in step(x[:b], y[:b]).items()}
            if last is not None and b != 42:  # 41 -> 42: eager, then compiled (other
                # roundings of the bfloat16 forward: not two inputs of one mechanism)
                for name, moved in group_moves(mech, out, last).items():
                    worst[name] = max(worst[name], moved)
            last = out
    assert step.compiled_shapes() == 1
    assert max(worst.values()) <= 1 + 1e-4, worst
    assert worst["fc2.weight"] > 0.99  # the test's records are clipped: it has teeth


class Frozen(nn.Module):
    """A frozen Linear before a trainable one, and a trainable Linear the forward never uses."""

    def __init__(self):
        super().__init__()
        self.frozen, self.fc, self.unused = nn.Linear(5, 5), nn.Linear(5, 3), nn.Linear(2, 2)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.fc(torch.tanh(self.frozen(x)))


def test_frozen_and_unused_parameters_compile():
    """A frozen parameter is an input of the program (its current value is read: moving it
    between steps moves the gradient), an unused trainable one gets zero norms and sums;
    compiled steps equal the oracle, and every step releases."""
    torch.manual_seed(0)
    model = Frozen().double()
    twin = copy.deepcopy(model)
    agg = aggregator(model, clip=0.05)
    step = CompiledPrivateStep(model, LOSS, agg)
    x = torch.randn(10, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (10,))
    for t in range(4):
        if t == 3:
            with torch.no_grad():
                for m in (model, twin):
                    m.frozen.weight.mul_(2.0)
        got = step(x, y)
        expected = oracle(twin, x, y, 0.05, agg.expected_size)
        assert_close(got, expected)
        assert float(got["unused.weight"].abs().max()) == 0
    assert step.compiled_shapes() == 1
    assert agg.ledger.steps() == [dpcore.Step(q=0.1, noise_multiplier=0.0, count=4)]


def test_the_program_waits_for_the_independence_check():
    """Empty Poisson samples in the first steps leave the check that the model keeps the
    examples apart to a later step: the steps stay eager until it is made (tracing had run
    the waiting check on fake tensors, and failed at every step)."""
    model, x, y = model_and_data("mlp")
    agg = aggregator(model, clip=0.05)
    step = CompiledPrivateStep(model, LOSS, agg, buckets=dpcore.Buckets(10, granularity=16))
    for rows in (0, 0, 0, 10):
        step(x[:rows], y[:rows])
        assert step.compiled_shapes() == 0
    assert not step.engine.check_pending()
    for rows in (10, 7):
        step(x[:rows], y[:rows])
    assert step.compiled_shapes() == 1
    assert agg.ledger.samplings == 6 and len(agg.ledger.steps()) == 1


def test_parameters_replaced_or_frozen_after_the_step_was_built_are_refused():
    """A parameter replaced by a new object (the step read the old one) or frozen since the
    step was built (its noised gradient would still be set) is refused before the step
    begins; a value changed in place is read."""
    model, x, y = model_and_data("mlp")
    agg = aggregator(model, clip=0.05)
    step = CompiledPrivateStep(model, LOSS, agg)
    step(x, y)
    model[2].weight = nn.Parameter(model[2].weight.detach().clone())
    with pytest.raises(ValueError, match=r"\['2.weight'\] replaced"):
        step(x, y)
    model, x, y = model_and_data("mlp")
    agg = aggregator(model, clip=0.05)
    step = CompiledPrivateStep(model, LOSS, agg)
    model[0].requires_grad_(False)
    with pytest.raises(ValueError, match=r"\['0.weight', '0.bias'\] frozen or unfrozen"):
        step(x, y)
    assert agg.ledger.samplings == 0


def test_a_program_is_traced_for_each_training_mode():
    """Dropout traced in training mode is not applied once the model is in eval mode (a new
    program is traced for it): the release then equals the oracle of the model without
    dropout, and two steps on one batch release the same."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Dropout(0.5), nn.Tanh(), nn.Linear(7, 3)).double()
    twin = copy.deepcopy(model).eval()
    x = torch.randn(10, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (10,))
    agg = aggregator(model, clip=0.05)
    step = CompiledPrivateStep(model, LOSS, agg)
    for _ in range(3):
        step(x, y)
    model.eval()
    first, second = step(x, y), step(x, y)
    assert step.compiled_shapes() == 2
    assert_close(first, oracle(twin, x, y, 0.05, agg.expected_size))
    assert_close(second, first)


def test_a_non_contiguous_batch_that_fills_its_bucket_runs():
    """A transposed batch of exactly the bucket's size reaches the program contiguous (it
    asserts the strides it was traced with)."""
    model, x, y = model_and_data("mlp", rows=8)
    agg = aggregator(model, clip=0.05)
    step = CompiledPrivateStep(model, LOSS, agg, buckets=dpcore.Buckets(8, granularity=8))
    xt = x.t().contiguous().t()  # the same values, other strides
    for _ in range(3):
        step(x, y)
    assert_close(step(xt, y), step(x, y))
