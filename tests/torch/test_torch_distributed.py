"""Private training over two processes (make_private(..., distributed=True), started by
torchrun with gloo on the CPU) against the same training in one process: the shards of one
Poisson sample, one noise draw, the same release and ledger; a failure in one process
raises in both."""

import math
import os
from dataclasses import astuple
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import dpcore  # noqa: E402
from dpcore_torch import PoissonBatchSampler, make_private  # noqa: E402
from dpcore_torch.data import sample_rate_of  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import distributed_run as run  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each of the two processes saw (distributed_run.py under torchrun)."""
    out = tmp_path_factory.mktemp("distributed")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         "2", str(Path(run.__file__)), str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-8000:]
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["world"] for r in results] == [2, 2]
    return out, results


def test_the_shards_make_the_one_process_sample_and_the_steps_its_release(ranks):
    """With one seed, the two processes' batches are the halves (even and odd records) of the
    sample one process draws with that seed, and five steps of noise 0.7 and clip 0.3 (most
    records clipped) leave the model where the one-process training leaves it: one noise
    draw (process 0's, the one process's), the clipped sums of the union, one division by q n.
    Process 1 started from other weights."""
    _, results = ranks
    model = run.mlp()
    model, opt, loader = make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.5),
        DataLoader(run.data(), batch_size=2 * run.BATCH), noise_multiplier=0.7,
        max_grad_norm=0.3, seed=5)
    seen = run.train(model, opt, loader)
    shards = [r["same_seed"]["seen"] for r in results]
    assert len(seen) == run.STEPS and all(len(s) == run.STEPS for s in shards)
    for step, whole in enumerate(seen):
        assert all(i % 2 == 0 for i in shards[0][step])
        assert all(i % 2 == 1 for i in shards[1][step])
        assert sorted(shards[0][step] + shards[1][step]) == whole
    assert results[0]["same_seed"]["q"] == opt.aggregator.q == 0.2
    for rank in results:
        for p, expected in zip(rank["same_seed"]["params"], model.parameters()):
            torch.testing.assert_close(p, expected.detach(), rtol=1e-5, atol=1e-6)
    assert results[0]["same_seed"]["events"] == list(opt.ledger.events)


def test_batch_norm_statistics_are_released_once_from_every_processs_records(ranks):
    """Each process releases its share's clipped statistics (process 0 with the noise) and
    the shares are added up: the released statistics, the ledger, the weights and the
    running statistics are the one-process run's with the same seed."""
    _, results = ranks
    one = run.batch_norm(2 * run.BATCH)
    for rank in results:
        got = rank["batch_norm"]
        assert len(got["released"]) == len(one["released"]) == run.STEPS
        for (mean, var), (want_mean, want_var) in zip(got["released"], one["released"]):
            torch.testing.assert_close(mean, want_mean, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(var, want_var, rtol=1e-5, atol=1e-6)
        assert got["events"] == one["events"]
        for p, want in zip(got["params"] + got["buffers"], one["params"] + one["buffers"],
                           strict=True):
            torch.testing.assert_close(p, want, rtol=1e-5, atol=1e-6)


def test_a_metric_is_released_once_from_every_processs_records(ranks):
    """optimizer.release across the processes, before and after step(): each process's
    share clipped, process 0's noise, the shares added up; the released values, the ledger
    and the weights are the one-process run's with the same seed."""
    _, results = ranks
    one = run.metrics(2 * run.BATCH)
    assert len(one["released"]) == run.STEPS
    for rank in results:
        got = rank["metrics"]
        torch.testing.assert_close(torch.stack(got["released"]), torch.stack(one["released"]),
                                   rtol=1e-5, atol=1e-6)
        assert got["events"] == one["events"]
        for p, want in zip(got["params"], one["params"], strict=True):
            torch.testing.assert_close(p, want, rtol=1e-5, atol=1e-6)


def test_adaptive_clipping_counts_every_processs_records_once(ranks):
    """Adaptive clipping across the two processes moves the clip as the one-process run
    with the same seed does (the counts of the union, one count noise draw, process 0's) and
    trains the same model; every process's clip moves alike."""
    _, results = ranks
    one = run.adaptive(2 * run.BATCH)
    clips = one["clips"]
    assert len(clips) == run.STEPS and len({c[0] for c in clips}) == run.STEPS  # it moved
    for rank in results:
        assert sum(rank["adaptive"]["clips"], []) == pytest.approx(sum(clips, []), rel=1e-6)
        for got, want in zip(rank["adaptive"]["events"], one["events"], strict=True):
            # the counts are added up in float32 in another order: the clips agree to 1e-6
            assert type(got) is type(want)
            for a, b in zip(astuple(got), astuple(want), strict=True):
                assert a == (pytest.approx(b, rel=1e-6) if isinstance(b, float) else b)
        for p, expected in zip(rank["adaptive"]["params"], one["params"], strict=True):
            torch.testing.assert_close(p, expected, rtol=1e-5, atol=1e-6)
    assert results[0]["adaptive"]["clips"] == results[1]["adaptive"]["clips"]


def test_only_process_0_writes_the_ledger_file_and_every_process_keeps_its_events(ranks):
    out, results = ranks
    events = [r["same_seed"]["events"] for r in results]
    assert events[0] == events[1] and len(events[0]) == 2 * run.STEPS
    assert list(dpcore.read_ledger(out / "ledger.jsonl").events) == events[0]
    assert [r["same_seed"]["in_memory"] for r in results] == [False, True]


@pytest.mark.parametrize("kind", ["noise", "secure_noise"])
def test_the_noise_is_drawn_once_for_all_processes(ranks, kind):
    """Zero gradients: the release times q n is the noise, of std z S = 0.91 as the ledger
    records (the same release in both processes). Ten steps of a 64 x 64 weight: 40,960
    draws, relative standard error 0.35%; 4 of them (1.4%) catch a 10% error, and std
    0.91 sqrt(2) (each process adding noise) fails by far."""
    _, results = ranks
    noise = [r[kind]["noise"].double() for r in results]
    assert torch.equal(noise[0], noise[1])
    assert torch.equal(results[0][kind]["weight"], results[1][kind]["weight"])
    tolerance = 4 / math.sqrt(2 * noise[0].numel())
    assert noise[0].numel() == 10 * 64 * 64 and tolerance < 0.1 / 7
    assert abs(noise[0].std().item() / (1.3 * 0.7) - 1) < tolerance
    assert abs(noise[0].mean().item()) < 4 * 1.3 * 0.7 / math.sqrt(noise[0].numel())


def test_a_step_that_fails_in_one_process_fails_in_all_and_they_stay_in_step(ranks):
    """A NaN in record 1 (process 1's shard, q = 1): process 1 raises its NonFiniteNormError,
    process 0 one saying another process's record has it (a loop that skips such steps
    catches one kind); neither records a sum query nor keeps its clipped sums for the next
    step, which both then take alike."""
    _, results = ranks
    nan = [r["nan_record"] for r in results]
    assert nan[1]["error"][0] == "NonFiniteNormError"
    assert nan[0]["error"] == ("NonFiniteNormError", "a record of another process has a NaN "
                               "or infinite norm (its error says which); nothing was released")
    for rank in nan:
        assert rank["after_failure"] == ["SamplingEvent"]
        assert rank["metric"][0] == "NonFiniteNormError"  # process 0's recorded it before
        assert rank["events"] == ["SamplingEvent", "SamplingEvent", "SumQueryEvent"]
    for p, q in zip(nan[0]["params"], nan[1]["params"]):
        assert torch.equal(p, q)


def test_processes_that_clip_at_other_bounds_refuse_the_step(ranks):
    """A process clipping at 2.0 while process 0's ledger says 1.0 would break the guarantee:
    make_private refuses in both; a schedule that moves the clip in process 1 only trains
    step 0 and refuses every later step in both, before anything of it is released."""
    _, results = ranks
    other = [r["other_clip"] for r in results]
    for rank, clip in ((0, 1.0), (1, 2.0)):
        kind, made = other[rank]["made"]
        assert kind == "ValueError"
        assert made.startswith(f"the processes disagree: process {rank} has q=0.2, n=40 and")
        assert f"clip={clip}" in made and "the same arguments in every process" in made
        taken = other[rank]["taken"]
        assert taken[0] is None and len(taken) == run.STEPS
        for step, (kind, message) in enumerate(taken[1:], start=1):
            assert kind == "ValueError" and f"process {rank} has step {step} at q=0.2" in message
            assert f"clip={1.0 + rank}" in message and "nothing was released" in message
        assert other[rank]["events"] == ["SamplingEvent", "SumQueryEvent"] + [
            "SamplingEvent"] * (run.STEPS - 1)
    for p, q in zip(other[0]["params"], other[1]["params"]):
        assert torch.equal(p, q)


def test_a_micro_batch_that_fails_in_one_process_abandons_the_step_in_all(ranks):
    """Process 1's accumulate() keeps the NaN record's error (raised there, it would leave a
    loop that skips failed steps before step(), and the processes would pair different
    steps) and drops its later micro-batches; step() raises in both (the same kind),
    nothing is released, and the next sample trains in both alike."""
    _, results = ranks
    failed = [r["failed_micro_batch"] for r in results]
    raised = [[(where, step, error[0]) for where, step, error in rank["raised"] if error]
              for rank in failed]
    assert raised[0] == raised[1] == [("step", 0, "NonFiniteNormError"),
                                      ("release", 1, "ValueError")]
    assert all(error is None for rank in failed for where, step, error in rank["raised"]
               if step == 1 and where != "release")
    for rank in failed:
        assert rank["events"] == ["SamplingEvent", "SamplingEvent", "SumQueryEvent"]
    for p, q in zip(failed[0]["params"], failed[1]["params"]):
        assert torch.equal(p, q)


def test_a_resumed_ledger_is_every_processs_so_they_price_the_run_alike(ranks):
    """Process 0 reopens its ledger file; process 1 starts from its events."""
    _, results = ranks
    resumed = [r["resumed"] for r in results]
    assert resumed[0] == resumed[1] and resumed[0]["events"] == 8
    assert resumed[0]["starts"] == [0, 2] and resumed[0]["step"] == 3
    assert resumed[0]["epsilons"][1] > resumed[0]["epsilons"][0]


def test_other_models_and_a_failed_release_raise_in_every_process(ranks):
    _, results = ranks
    refusals = [r["refusals"] for r in results]
    for rank in refusals:
        assert rank["dtype"][0] == "ValueError"
        assert rank["dtype"][1] == ("process 1's model differs from process 0's: ('0.weight', "
                                 "(16, 6), 'torch.float64') against ('0.weight', (16, 6), "
                                 "'torch.float32') (name, shape, dtype); make the same "
                                 "model in every process")
    assert refusals[0]["release"][0] == "LedgerError"  # its file closed after the sampling
    assert refusals[1]["release"] == ("RuntimeError", "the release failed in another process "
                                      "(its error says why); nothing was applied")


def test_settings_of_one_processs_own_are_refused_in_every_process(ranks):
    """Another learning rate or loss reduction in process 1 (the models would part), or
    another BatchNorm statistics clip or declared metric clip (it would clip at another
    bound than process 0's ledger records; the gradient's mechanism is the same): refused
    at make_private in both. A ledger path given to process 1 is named in a warning."""
    _, results = ranks
    for rank, got in enumerate(r["other_settings"] for r in results):
        for what, refused in got["refused"].items():
            assert refused is not None and refused[0] == "ValueError", (rank, what, refused)
            assert refused[1].startswith(f"the processes disagree: process {rank} has q=0.2")
        assert "rank1-ledger.jsonl" not in got["ledger_files"]
        assert got["accepted"] is None  # a function in a parameter group: its type compared
    settings = results[1]["other_settings"]
    assert "'lr': 1.5" in settings["refused"]["lr"][1]
    assert "loss_reduction='sum'" in settings["refused"]["loss_reduction"][1]
    assert "clip=500.5" in settings["refused"]["batch_norm"][1]
    assert "clip=2.0" in settings["refused"]["metrics"][1]
    assert results[0]["other_settings"]["warnings"] == []
    (warned,) = settings["warnings"]
    assert "process 1 was given the ledger path" in warned and "rank1-ledger.jsonl" in warned


def test_a_release_of_another_clip_is_refused_and_values_are_added_by_name(ranks):
    """A metric clipped at 1000 in process 1 while process 0's ledger would record 1: both
    refuse before either records it. Values given in another key order in process 1 are
    still added leaf by leaf: every record's a = b = 100, a clipped to 1 and b not, over the
    16 records at q n = 16 (they had been added by position, a's group holding b's values)."""
    _, results = ranks
    for rank, got in enumerate(r["other_releases"] for r in results):
        kind, message = got["clip"]
        assert kind == "ValueError" and message.startswith(
            f"the processes disagree: process {rank} has a release at step 0 of")
        assert f"clip={1.0 + 999 * rank}" in message
        assert got["recorded"] == 0
        torch.testing.assert_close(got["released"]["a"], torch.tensor([1.0]))
        torch.testing.assert_close(got["released"]["b"], torch.tensor([100.0]))


def test_steps_on_other_samples_are_refused_in_every_process(ranks):
    """Process 1 stepping on the loader's next sample (its loop skipped a batch) or on a
    batch of another DataLoader would add its share of another sample to process 0's:
    refused in both, with the samples each began on, nothing released."""
    _, results = ranks
    for rank, got in enumerate(r["other_samples"] for r in results):
        for case, sample in (("skipped", 1 + rank), ("foreign", 1 - rank)):
            kind, message = got["outcomes"][case]
            assert kind == "ValueError" and "the processes disagree" in message, case
            assert f"begun on the loader's sample {sample}" in message, case
            assert got["events"][case] == ["SamplingEvent"]


def test_sharded_batch_samplers_split_one_sample():
    whole = list(PoissonBatchSampler(100, 0.3, steps=4, seed=2))
    shards = [list(PoissonBatchSampler(100, 0.3, steps=4, seed=2, shard=(r, 3)))
              for r in range(3)]
    for step, sample in enumerate(whole):
        parts = [shard[step] for shard in shards]
        assert sorted(sum(parts, [])) == sample
        assert all(i % 3 == r for r, part in enumerate(parts) for i in part)
    with pytest.raises(ValueError, match=r"shard must be \(rank, world\).*\(3, 3\)"):
        PoissonBatchSampler(100, 0.3, shard=(3, 3))


def test_the_batch_size_is_per_process():
    loader = DataLoader(run.data(), batch_size=4)
    assert sample_rate_of(loader, 5) == 0.5
    with pytest.raises(ValueError, match="batch_size 4 times 11 processes must be in"):
        sample_rate_of(loader, 11)


@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def private(model, **options):
    return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                        DataLoader(run.data(), batch_size=4), noise_multiplier=1.0,
                        max_grad_norm=1.0, **options)


def test_distributed_needs_torch_distributed_initialised():
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        private(run.mlp(), distributed=True)


def test_a_distributed_data_parallel_model_is_refused(one_process_group):
    with pytest.raises(TypeError, match="pass model.module with distributed=True"):
        private(nn.parallel.DistributedDataParallel(run.mlp()), distributed=True)
    model, opt, loader = private(run.mlp(), distributed=True, seed=0)  # one process: plain
    twin, twin_opt, twin_loader = private(run.mlp(), seed=0)
    for (x, y, _), (tx, ty, _) in zip(loader, twin_loader):
        for m, o, a, b in ((model, opt, x, y), (twin, twin_opt, tx, ty)):
            o.zero_grad()
            F.cross_entropy(m(a), b).backward()
            o.step()
    for p, t in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, t)
